"""Building and running the Serve applications: their deployments' options, the builders a Serve
config names, `serve_config` (Serve's YAML) and `deploy_speech` / `deploy_policy`."""

from __future__ import annotations

import os
from typing import Any

from flashrt.errors import ConfigError
from flashrt.integrations.ray_serve.apps import PolicyApp, SpeechApp, StageScale, check_fits
from flashrt.integrations.ray_serve.policy import PolicyIngress
from flashrt.integrations.ray_serve.speech import LMStage, SpeechIngress, VocoderStage

REFUSAL_HEADROOM = 4  # an ingress replica takes this many times the speech requests it admits (speech_app)


def serve_api() -> Any:
    from ray import serve  # the `ray` extra; a missing one is named by `flashrt.extras`

    return serve


def speech_deployments(app: SpeechApp) -> dict[str, dict[str, Any]]:
    """{deployment name: Serve options} of `app`'s stages: what `speech_app` deploys and what a Serve
    config (`serve_config`) lists under ``deployments``."""
    from flashrt.serve.app import ServerLimits

    limits = app.limits or ServerLimits()
    # Serve hands an ingress replica REFUSAL_HEADROOM x the requests it admits, so the ones beyond are
    # refused by it (OpenAI's 503 body, Retry-After) rather than by Serve's proxy (its own text 503)
    ingress = {**app.ingress.deployment_options(), **_backpressure(serve_api(), limits.retry_after_s),
               "max_ongoing_requests": REFUSAL_HEADROOM * app.ingress.max_ongoing_requests}
    return {f"{app.name}-lm": app.lm.deployment_options(),
            f"{app.name}-vocoder": app.vocoder.deployment_options(), "speech": ingress}


def speech_app(app: SpeechApp) -> Any:
    """The Serve application of `app` (lm -> vocoder -> ingress), not yet running."""
    from flashrt.serve.app import ServerLimits

    serve, limits = serve_api(), app.limits or ServerLimits()
    (lm_name, lm_options), (vocoder_name, vocoder_options), (_, ingress_options) = \
        speech_deployments(app).items()
    lm = serve.deployment(LMStage, name=lm_name, **lm_options)
    vocoder = serve.deployment(VocoderStage, name=vocoder_name, **vocoder_options)
    ingress = serve.deployment(SpeechIngress, name="speech", **ingress_options)
    lm_bound = lm.bind(str(app.folder), dict(app.options), limits, app.lm.torch_threads)
    vocoder_bound = vocoder.bind(str(app.folder), dict(app.options), app.vocoder.torch_threads, lm_bound)
    return ingress.bind({app.name: lm_bound}, {app.name: vocoder_bound}, limits,
                        app.ingress.max_ongoing_requests, app.api_key)


def policy_deployments(app: PolicyApp) -> dict[str, dict[str, Any]]:
    """{deployment name: Serve options} of `app` (one deployment, "policy")."""
    return {"policy": app.scale.deployment_options()}


def _backpressure(serve: Any, retry_after_s: float) -> dict[str, Any]:
    """Serve's own refusals (beyond a deployment's ``max_queued_requests``) with a Retry-After header,
    where this Ray's Serve has ``backpressure_config`` (newer than the oldest Ray 2 flashrt takes)."""
    import inspect

    if "backpressure_config" in inspect.signature(serve.deployment).parameters:
        return {"backpressure_config": {"retry_after_s": retry_after_s}}
    return {}


def policy_app(app: PolicyApp) -> Any:
    """The Serve application of `app` (one ASGI ingress deployment: websocket and HTTP routes)."""
    serve = serve_api()
    ingress = serve.ingress()(PolicyIngress)  # its routes built in each replica (__serve_build_asgi_app__)
    return serve.deployment(ingress, name="policy", **policy_deployments(app)["policy"]).bind(
        str(app.folder), dict(app.options), app.scale.torch_threads)


def _cluster_fits(scales: list[StageScale], check: bool) -> None:
    if check:
        import ray

        check_fits(scales, ray.cluster_resources())


def deploy_speech(app: SpeechApp, name: str = "flashrt-speech", route_prefix: str = "/",
                  blocking: bool = False, check_resources: bool = True) -> Any:
    """Run `app` on the connected Ray cluster (``ray.init`` first; Serve is started when it is not);
    the ingress's handle. Returns once every replica has loaded and captured. ``check_resources``:
    refuse at once (`check_fits`) what the cluster cannot hold at all (off for an autoscaling cluster)."""
    _cluster_fits([app.lm, app.vocoder, app.ingress], check_resources)
    return serve_api().run(speech_app(app), name=name, route_prefix=route_prefix, blocking=blocking)


def deploy_policy(app: PolicyApp, name: str = "flashrt-policy", route_prefix: str = "/",
                  blocking: bool = False, check_resources: bool = True) -> Any:
    """Run `app` on the connected Ray cluster; the deployment's handle (``check_resources``: as
    `deploy_speech`)."""
    _cluster_fits([app.scale], check_resources)
    return serve_api().run(policy_app(app), name=name, route_prefix=route_prefix, blocking=blocking)


def speech_builder(args: dict[str, Any]) -> Any:
    """The application builder a Serve config's ``import_path`` names
    (``flashrt.integrations.ray_serve:speech_builder``): `SpeechApp.args` -> the application."""
    return speech_app(SpeechApp.from_args(dict(args)))


def init_local(**options: Any) -> None:
    """Start a one-node Ray cluster on this machine's loopback only (127.0.0.1 for every Ray port).
    Ray swaps a loopback node address for the machine's routable one unless it is told the node is not
    part of a cluster, by its own variable RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which is set here for this
    process and the ones Ray starts (only when flashrt starts the cluster itself)."""
    import ray
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the processes Ray starts read it at import
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process imported ray already: its copy of the flag
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, **options)


def policy_builder(args: dict[str, Any]) -> Any:
    """The application builder of a policy's Serve config: `PolicyApp.args` -> the application."""
    return policy_app(PolicyApp.from_args(dict(args)))


# what a Serve config of each kind of app names: (its import_path, the application's default name)
CONFIG_KINDS: dict[type, tuple[str, str, Any]] = {
    SpeechApp: ("flashrt.integrations.ray_serve:speech_builder", "flashrt-speech", speech_deployments),
    PolicyApp: ("flashrt.integrations.ray_serve:policy_builder", "flashrt-policy", policy_deployments),
}


def serve_config(app: SpeechApp | PolicyApp, host: str = "127.0.0.1", port: int = 8000,
                 name: str | None = None, route_prefix: str = "/") -> dict[str, Any]:
    """Serve's own config (``serve deploy config.yaml``) running `app`: its ``args`` (what the builder
    rebuilds the app from: plain values only, so options such as a `Sampling` object are refused here)
    and its ``deployments`` (each one's Serve options: replicas or ``autoscaling_config``, resources,
    request bounds; Serve applies them over the builder's, so an operator may edit them there)."""
    import json

    import_path, default_name, deployments = CONFIG_KINDS[type(app)]
    args = app.args()
    try:
        json.dumps(args)
    except TypeError as exc:
        raise ConfigError(f"a Serve config holds plain values only: {exc}") from None
    return {"http_options": {"host": host, "port": port},
            "applications": [{"name": name or default_name, "route_prefix": route_prefix,
                              "import_path": import_path, "args": args,
                              "deployments": [{"name": deployment, **options}
                                              for deployment, options in deployments(app).items()]}]}
