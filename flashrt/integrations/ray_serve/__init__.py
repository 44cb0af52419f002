"""flashrt on Ray Serve: the speech chain split at its stage boundary, and policies, as Serve deployments.

    from flashrt.integrations.ray_serve import deploy_speech, deploy_policy, SpeechApp, StageScale
    deploy_speech(SpeechApp("orpheus_dir", lm=StageScale(replicas=2), vocoder=StageScale(replicas=1)))
    # POST http://127.0.0.1:8000/v1/audio/speech   (Serve's HTTP proxy; as `flashrt serve`)
    deploy_policy(PolicyApp("policy_dir"))
    # ws://127.0.0.1:8000/ (openpi-client), POST http://127.0.0.1:8000/infer (msgpack in and out)

Speech (an Orpheus-style voice, `flashrt.frontends.orpheus`) runs as three deployments, each with its own
replica count, resources and ``max_ongoing_requests`` (`StageScale`):

    lm       `load_orpheus(..., vocoder=False)`: the model's own LM stage (its SlotDecoder, the requests
             of a replica decoding together as rows), a generator method streaming SNAC code chunks
    vocoder  `load_snac` (as `load_orpheus` loads it): streams a request's audio, pulling its code chunks
             from an lm replica (``handle.options(stream=True)``) into the request's SNAC stream
             (exact overlap windows: the chunks concatenate to what the single-process chain makes);
             the windows due in the requests a replica streams are decoded together, stacked as rows
             of one replay, as the single-process snac stage does (`VocoderStage`)
    ingress  POST /v1/audio/speech, GET /v1/models, GET /health: the request checks and error shapes
             of `flashrt serve` (`flashrt.serve.app.SpeechServer.parse`, its ``{"error": ...}`` body)

So the audio of a request and seed is the one `flashrt serve` sends (each replica sets torch's thread
count, `StageScale.threads`: float reductions, hence bits, depend on it). A replica loads and captures
its graphs in its constructor, so Serve reports it not ready and routes nothing to it before that; it
replays from then on; its ``check_health`` fails once its chain or worker is closed, so Serve replaces
it. A replica that dies mid-request ends that request with an error: before the first chunk a 500 in
OpenAI's shape, after it the response is cut short (the client's read fails: never a clean end of a
truncated stream); Serve restarts the replica and the next request is served. Back-pressure, refused at
once, never queued without bound: an ingress replica admits ``ingress.max_ongoing_requests`` speech
requests (a streamed one until its body ends) and answers the others `flashrt serve`'s 503
(``server_busy``, OpenAI's error shape, Retry-After); Serve hands it `REFUSAL_HEADROOM` times that many,
so its own refusals are the ones clients see, and queues ``max_queued_requests`` more for it while it
routes a burst (beyond: Serve's own 503, text, with Retry-After where its ``backpressure_config``
exists). Behind it the vocoder and lm deployments hold ``max_ongoing_requests`` per replica and queue
``max_queued_requests`` (beyond: 503 ``server_busy``), and each lm replica's chain refuses beyond
``max_pending`` (503 ``server_busy``).

Policies (`PolicyApp`): one ASGI deployment (`PolicyIngress`), `load_policy` inside each replica: the
openpi websocket protocol of `flashrt serve-policy` on any path of the application (metadata first, then
msgpack observations, ``seed``/``noise`` keys as there, answered with msgpack ``{"actions",
"policy_timing", "server_timing"}`` or a text error), and POST /infer (one observation, the same reply,
or a JSON error (`flashrt.serve.policy_server.error_reply`): 400 a refused request, 500 a bug). The
requests waiting for a replica's worker run together (`Policy.infer_batch`) where it loaded batch
buckets.

Scale: a `StageScale` with ``max_replicas`` autoscales (Serve's ``autoscaling_config``); `serve_config`
writes Serve's own YAML (the builder's ``args`` and each deployment's options) for ``serve deploy``.

Ray is optional (``pip install 'flashrt[ray]'``) and imported only when a deployment is built.
"""


from flashrt.integrations.ray_serve.apps import (
    STAGES,
    PolicyApp,
    SpeechApp,
    StageScale,
    check_fits,
    parse_count,
    parse_replicas,
)
from flashrt.integrations.ray_serve.cli import policy_command, serve_command
from flashrt.integrations.ray_serve.deploy import (
    REFUSAL_HEADROOM,
    deploy_policy,
    deploy_speech,
    init_local,
    policy_app,
    policy_builder,
    policy_deployments,
    serve_config,
    speech_app,
    speech_builder,
    speech_deployments,
)
from flashrt.integrations.ray_serve.policy import PolicyIngress
from flashrt.integrations.ray_serve.speech import VOCODER_OPTIONS, LMStage, SpeechIngress, VocoderStage

__all__ = ["StageScale", "SpeechApp", "PolicyApp", "speech_app", "policy_app", "deploy_speech",
           "deploy_policy", "LMStage", "VocoderStage", "SpeechIngress", "PolicyIngress", "parse_replicas",
           "parse_count", "serve_config", "speech_deployments", "policy_deployments", "speech_builder",
           "policy_builder", "serve_command", "policy_command", "check_fits", "STAGES", "init_local",
           "REFUSAL_HEADROOM", "VOCODER_OPTIONS"]
