"""flashrt on Ray Serve, on a local one-node Ray cluster the module starts (127.0.0.1, 2 CPUs): the
speech chain split into lm -> vocoder -> ingress deployments answers the OpenAI request with the audio
the single-process SpeechServer sends for it; its errors have `flashrt serve`'s shape; the policy
deployment answers `Policy.infer`'s actions for the same seed; an lm replica killed mid-stream ends that
stream with an error, and the next request is served."""

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'flashrt[ray]')")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'flashrt[ray]')")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("msgpack")

from ray.serve.schema import ServeDeploySchema  # noqa: E402
from support.servers import RunningServer  # noqa: E402

from flashrt.integrations.ray_serve import (  # noqa: E402
    PolicyApp,
    SpeechApp,
    StageScale,
    deploy_speech,
)
from flashrt.runner.tts import load_tts  # noqa: E402
from flashrt.serve.app import ServerLimits, SpeechServer  # noqa: E402

pytestmark = pytest.mark.timeout(120)

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "tts" / "orpheus_tiny"
# Orpheus' own sampling (so the seed matters); one row: a burst is decoded one request after another
OPTIONS = {"max_new_tokens": 300, "cache_len": 512, "slots": 1, "constrain_frames": True}
SERVE_PORT = 18431
WAIT = 30.0
SMALL = StageScale(num_cpus=0.25, max_ongoing_requests=4, max_queued_requests=4, threads=1)
# the ingress admits 4 at once; Serve's proxy queues up to 16 for it while it routes a burst (a request
# counts as queued there until a replica takes it, which the ingress's own refusals make quick)
INGRESS = StageScale(num_cpus=0.25, max_ongoing_requests=4, max_queued_requests=16, threads=1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import builtins

    from ray import serve

    saved_print = builtins.print  # Ray patches the builtin print (its tqdm); the suite gets it back

    from flashrt.integrations.ray_serve import init_local

    init_local(num_cpus=2, log_to_driver=False, _temp_dir=str(tmp_path_factory.mktemp("ray")))
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}  # loopback only
    serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
    yield f"http://127.0.0.1:{SERVE_PORT}"
    serve.shutdown()
    ray.shutdown()
    builtins.print = saved_print


@pytest.fixture(scope="module")
def speech(cluster):
    from ray import serve

    deploy_speech(SpeechApp(str(FIXTURE), options=OPTIONS, lm=SMALL, vocoder=SMALL, ingress=INGRESS))
    yield cluster
    serve.delete("flashrt-speech")


@pytest.fixture(scope="module")
def local(one_thread):
    model = load_tts(FIXTURE, **OPTIONS)
    server = SpeechServer({"orpheus": model}, ServerLimits())
    running = RunningServer(server)
    yield running.url
    running.stop()
    server.close()


def _speech(url, text, seed=None, **extra):
    body = {"model": "tts-1", "voice": "tara", "input": text, "response_format": "pcm", **extra}
    if seed is not None:
        body["seed"] = seed
    return httpx.post(url + "/v1/audio/speech", json=body, timeout=WAIT)


@pytest.mark.parametrize("text,seed,fmt", [
    ("Hello there.", 1, "pcm"), ("Hello there.", 2, "pcm"), ("Numbers: one, two, three.", 7, "pcm"),
    ("Hello there.", 3, "wav")])
def test_speech_matches_the_single_process_server(speech, local, text, seed, fmt):
    ray_reply = _speech(speech, text, seed, response_format=fmt)
    local_reply = _speech(local, text, seed, response_format=fmt)
    assert local_reply.status_code == 200, local_reply.text
    assert ray_reply.status_code == 200, ray_reply.text
    assert len(local_reply.content) > 0
    assert ray_reply.content == local_reply.content  # bit-identical audio (a wav: the same file)
    assert ray_reply.headers["x-sample-rate"] == local_reply.headers["x-sample-rate"]


@pytest.mark.parametrize("body", [
    {"model": "tts-1", "voice": "tara", "input": ""},                       # 400 empty_input
    {"model": "tts-1", "voice": "nobody", "input": "Hi."},                  # 400 unknown_voice
    {"model": "tts-1", "voice": "tara", "input": "Hi.", "speed": 9},        # 422 invalid_value
    {"model": "tts-1", "voice": "tara", "input": "Hi.", "speed": 2},        # 400 from the model (lm stage)
    {"model": "tts-1", "voice": "tara", "input": "Hi.", "response_format": "nope"},
])
def test_errors_have_the_single_process_shape(speech, local, body):
    ray_reply = httpx.post(speech + "/v1/audio/speech", json=body, timeout=WAIT)
    local_reply = httpx.post(local + "/v1/audio/speech", json=body, timeout=WAIT)
    assert local_reply.status_code >= 400
    assert (ray_reply.status_code, ray_reply.json()) == (local_reply.status_code, local_reply.json())


def _lm_replica():
    from ray.util import list_named_actors

    names = [a for a in list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA") and "orpheus-lm" in a["name"]]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])


def _stream(url, text, got, key, started):
    """One streamed request: ("complete", bytes) when it ended cleanly, ("cut", bytes) when the stream
    broke after its 200, (status, json) for an error answer."""
    body = {"model": "tts-1", "voice": "tara", "input": text, "response_format": "pcm", "seed": 5}
    parts = []
    try:
        with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=WAIT) as r:
            if r.status_code != 200:
                got[key] = (r.status_code, __import__("json").loads(r.read()))
                return
            for part in r.iter_raw():
                parts.append(part)
                started.set()
        got[key] = ("complete", b"".join(parts))
    except httpx.HTTPError:
        got[key] = ("cut", b"".join(parts))
    finally:
        started.set()


def test_a_replica_killed_mid_stream_ends_its_streams_with_an_error(speech, local):
    """The lm replica (one row: requests one after another) is stopped (SIGSTOP) and killed (ray.kill)
    once the first audio arrives;
    every request then either has its whole audio, or ends with an error (a 5xx in OpenAI's shape, or
    a stream cut short): never a clean end of partial audio. Serve restarts it; the next is served."""
    texts = [f"Request number {k} of the burst." for k in range(4)]
    want = {text: _speech(local, text, seed=5).content for text in texts}
    got, started = {}, threading.Event()
    victim = _lm_replica()
    pid = ray.get(victim.__ray_call__.remote(lambda _: os.getpid()), timeout=WAIT)
    readers = [threading.Thread(target=_stream, args=(speech, text, got, text, started), daemon=True)
               for text in texts]
    for reader in readers:
        reader.start()
    assert started.wait(WAIT)
    os.kill(pid, signal.SIGSTOP)  # frozen at once (ray.kill lands later): the lm is mid-utterance
    ray.kill(victim, no_restart=False)
    for reader in readers:
        reader.join(WAIT)
    assert len(got) == len(texts), got
    outcomes = []
    for text, (kind, value) in got.items():
        if kind == "complete":
            assert value == want[text], text  # a clean end is the whole utterance, never a part
        elif kind == "cut":
            assert len(value) < len(want[text])
        else:
            assert kind >= 500 and value["error"]["type"] == "server_error", (kind, value)
        outcomes.append(kind)
    assert "cut" in outcomes, outcomes  # the stream the lm was speaking when it died broke off
    deadline = time.monotonic() + WAIT
    while True:  # Serve replaces the replica; the next request is served
        reply = _speech(speech, "Hello there.", seed=5)
        if reply.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert reply.status_code == 200, reply.text
    assert reply.content == _speech(local, "Hello there.", seed=5).content


@pytest.fixture(scope="module")
def demo_policy(tmp_path_factory):
    from flashrt.demo import ensure_demo_checkpoint

    folder, _ = ensure_demo_checkpoint(tmp_path_factory.mktemp("demo") / "pi05")
    return folder


@pytest.fixture(scope="module")
def ray_policy(cluster, demo_policy, tmp_path_factory):
    """The policy deployed from the Serve config `flashrt serve-policy --ray --write-config` writes (its
    import_path's builder), at /policy; its config."""
    import importlib
    from dataclasses import asdict

    import yaml
    from ray import serve
    from typer.testing import CliRunner

    from flashrt.cli import app as cli

    path = tmp_path_factory.mktemp("config") / "policy.yaml"
    result = CliRunner().invoke(cli, ["serve-policy", str(demo_policy), "--ray", "--replicas", "1",
                                      "--port", "8124", "--write-config", str(path)])
    assert result.exit_code == 0, result.output
    config = yaml.safe_load(path.read_text())
    (application,) = config["applications"]
    module, _, builder = application["import_path"].partition(":")
    args = {**application["args"], "scale": asdict(SMALL)}  # a quarter CPU, one thread
    serve.run(getattr(importlib.import_module(module), builder)(args), name="flashrt-policy",
              route_prefix="/policy")
    yield cluster + "/policy", config
    serve.delete("flashrt-policy")


@pytest.fixture(scope="module")
def local_policy(demo_policy, one_thread):
    from flashrt.runner.policy import load_policy
    from flashrt.serve.policy_server import PolicyServer

    with PolicyServer(load_policy(demo_policy, batches=(1, 2, 4)), port=0) as server:  # as serve-policy
        yield server


def test_policy_matches_policy_infer(ray_policy, demo_policy, one_thread):  # replicas: threads=1
    from flashrt.demo import ToyRobot
    from flashrt.runner.policy import load_policy
    from flashrt.serve.wire import packb, unpackb

    url, _ = ray_policy
    obs = ToyRobot().observe()
    reply = httpx.post(url + "/infer", content=packb({**obs, "seed": 5}), timeout=WAIT)
    assert reply.status_code == 200, reply.text
    want = load_policy(demo_policy).infer(obs, seed=5)["actions"]
    assert np.array_equal(unpackb(reply.content, 1 << 24)["actions"], want)
    bad = httpx.post(url + "/infer", content=b"\xc1 not msgpack", timeout=WAIT)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_message"


def test_serve_policy_ray_writes_the_policys_config(ray_policy, demo_policy):

    _, config = ray_policy
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8124}
    (application,) = config["applications"]
    assert application["import_path"] == "flashrt.integrations.ray_serve:policy_builder"
    app = PolicyApp.from_args(application["args"])
    assert app.folder == str(Path(demo_policy).resolve()) and app.scale.replicas == 1
    assert app.options == {"device": "cpu", "precision": "float32", "family": "pi0", "batches": [1, 2, 4]}
    assert PolicyApp.from_args(app.args()) == app


@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used:DeprecationWarning")
def test_openpi_client_gets_the_actions_of_serve_policy(ray_policy, local_policy):
    """openpi-client's WebsocketClientPolicy against the Ray app (its websocket at the app's root) and
    against `flashrt serve-policy`'s server: the same metadata first, the same actions per seed, a
    refused message answered as text (the client raises it) on a connection that then serves on."""
    openpi = pytest.importorskip("openpi_client.websocket_client_policy",
                                 reason="openpi-client (the test extra) is not installed")
    url, _ = ray_policy
    on_ray = openpi.WebsocketClientPolicy(host=url.replace("http://", "ws://"))
    served = openpi.WebsocketClientPolicy(host=f"ws://127.0.0.1:{local_policy.port}")
    try:
        _same_actions(on_ray, served, url)
    finally:  # an open websocket is an ongoing request: Serve would wait its graceful-shutdown timeout
        on_ray._ws.close()
        served._ws.close()


def _same_actions(on_ray, served, url):
    from websockets.sync.client import connect

    from flashrt.demo import ToyRobot
    from flashrt.serve.wire import unpackb

    assert on_ray.get_server_metadata() == served.get_server_metadata()
    robot = ToyRobot()
    for seed in (1, 2, 3):
        obs = {**robot.observe(), "seed": seed}
        got, want = on_ray.infer(obs), served.infer(obs)
        assert np.array_equal(got["actions"], want["actions"])
        assert set(got) == set(want) and got["server_timing"]["batch"] == 1
    with connect(url.replace("http://", "ws://"), open_timeout=WAIT) as ws:
        unpackb(ws.recv(timeout=WAIT), 1 << 20)  # the metadata
        ws.send(b"\xc1 not msgpack")
        error = __import__("json").loads(ws.recv(timeout=WAIT))["error"]
        assert error["code"] == "invalid_message"
    obs = {**robot.observe(), "seed": 4}
    assert np.array_equal(on_ray.infer(obs)["actions"], served.infer(obs)["actions"])


def _validate(config):
    """Serve's own check of a config file (pydantic 2's model_validate, 1's parse_obj)."""
    check = getattr(ServeDeploySchema, "model_validate", None) or ServeDeploySchema.parse_obj
    check(config)


def test_write_config_is_serve_config_that_rebuilds_the_app(tmp_path):
    """`flashrt serve --ray --write-config` writes Serve's config; its args rebuild the same SpeechApp,
    its deployments carry each stage's Serve options (``lm=1-3``: an autoscaling_config, fixed counts
    otherwise), and its import_path's builder makes the application with those options."""
    import importlib

    import yaml
    from typer.testing import CliRunner

    from flashrt.cli import app as cli

    path = tmp_path / "serve.yaml"
    result = CliRunner().invoke(cli, ["serve", "--ray", "--voice", f"talk={FIXTURE}", "--replicas",
                                      "lm=1-3,vocoder=2", "--port", "8123", "--write-config", str(path)])
    assert result.exit_code == 0, result.output
    config = yaml.safe_load(path.read_text())
    _validate(config)  # what `serve deploy` checks it against
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8123}
    (application,) = config["applications"]
    module, _, builder = application["import_path"].partition(":")
    speech = SpeechApp.from_args(application["args"])
    assert (speech.name, speech.lm.replicas, speech.lm.max_replicas, speech.vocoder.replicas) == \
        ("talk", 1, 3, 2)
    assert speech.options == {"device": "cpu"} and speech.limits == ServerLimits()
    assert SpeechApp.from_args(speech.args()) == speech
    deployments = {d["name"]: d for d in application["deployments"]}
    assert set(deployments) == {"talk-lm", "talk-vocoder", "speech"}
    assert deployments["talk-lm"]["autoscaling_config"] == {
        "min_replicas": 1, "initial_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2.0}
    assert "num_replicas" not in deployments["talk-lm"]  # Serve refuses both
    assert deployments["talk-vocoder"]["num_replicas"] == 2 and "autoscaling_config" not in \
        deployments["talk-vocoder"]
    built = getattr(importlib.import_module(module), builder)(application["args"])
    assert type(built).__name__ == "Application"
    # the deployed lm (bound in the ingress's arguments) autoscales as written (Ray's own attributes)
    lm = built._bound_deployment.init_args[0]["talk"]._bound_deployment
    scaling = lm._deployment_config.autoscaling_config
    assert (lm.name, scaling.min_replicas, scaling.max_replicas) == ("talk-lm", 1, 3)


def test_serve_policy_ray_replicas_range_autoscales(tmp_path, demo_policy):
    import yaml
    from typer.testing import CliRunner

    from flashrt.cli import app as cli

    path = tmp_path / "policy.yaml"
    result = CliRunner().invoke(cli, ["serve-policy", str(demo_policy), "--ray", "--replicas", "2-4",
                                      "--write-config", str(path)])
    assert result.exit_code == 0, result.output
    config = yaml.safe_load(path.read_text())
    _validate(config)
    (deployment,) = config["applications"][0]["deployments"]
    assert deployment["name"] == "policy"
    assert (deployment["autoscaling_config"]["min_replicas"], deployment["autoscaling_config"]
            ["max_replicas"]) == (2, 4)


@pytest.mark.parametrize("spec", ["lm=0", "lm", "lm=2,lm=1", "gpu=1", "lm=x", "lm=3-2", "lm=0-2", "lm=1-"])
def test_replicas_spec_is_checked(spec):
    from flashrt.errors import ConfigError
    from flashrt.integrations.ray_serve import parse_replicas

    with pytest.raises(ConfigError, match="--replicas"):
        parse_replicas(spec)
    assert parse_replicas("lm=2, vocoder=1-3") == {"lm": {"replicas": 2, "max_replicas": None},
                                                   "vocoder": {"replicas": 1, "max_replicas": 3}}


def test_a_burst_beyond_the_bounds_is_refused_at_once(speech, local):
    """12 streaming clients at once against an ingress that admits 4 (a stream until its end): every
    client is served (its whole audio) or refused at once with `flashrt serve`'s 503 (OpenAI's error
    shape, Retry-After), never Serve's own text 503; none waits without bound (each read has WAIT)."""
    want = _speech(local, "Yes.", seed=1).content
    got = {}

    def post(key):
        try:
            reply = _speech(speech, "Yes.", seed=1)
            got[key] = (reply.status_code, reply)
        except httpx.HTTPError as exc:
            got[key] = (None, repr(exc))

    clients = [threading.Thread(target=post, args=(k,), daemon=True) for k in range(12)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(WAIT)
    statuses = sorted(status for status, _ in got.values())
    assert len(got) == 12 and set(statuses) <= {200, 503}, got
    assert statuses.count(503) >= 1 and statuses.count(200) >= 4, statuses
    for status, reply in got.values():
        if status == 200:
            assert reply.content == want
            continue
        assert reply.headers.get("retry-after") == "1", (reply.headers, reply.text)
        error = reply.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "server_busy") and error["message"]


def test_deployments_that_cannot_fit_are_refused_at_once():
    """Replicas needing more CPUs than the cluster has are a ConfigError naming the numbers (Serve
    itself would wait for them forever)."""
    from flashrt.errors import ConfigError
    from flashrt.integrations.ray_serve import check_fits

    app = SpeechApp(str(FIXTURE), lm=StageScale(replicas=2))  # 2 x 1 + 0.5 + 0.25 CPUs
    with pytest.raises(ConfigError, match=r"need 2.75 CPUs \(2 x 1, 1 x 0.5, 1 x 0.25\).*has 2"):
        check_fits([app.lm, app.vocoder, app.ingress], {"CPU": 2.0})
    check_fits([app.lm, app.vocoder, app.ingress], {"CPU": 3.0})
    with pytest.raises(ConfigError, match="GPU"):
        check_fits([StageScale(num_gpus=0.5)], {"CPU": 8.0})
    with pytest.raises(ConfigError, match=r"need 3 CPUs \(3 x 1\)"):  # autoscaling: its most replicas
        check_fits([StageScale(replicas=1, max_replicas=3)], {"CPU": 2.0})


def test_an_api_key_reaches_the_ingress_and_never_a_written_config(tmp_path, monkeypatch):
    """`--ray --api-key`: the key is bound into the ingress deployment (which checks it: see
    test_ray_ingress.py), hidden from the app's repr, and never written into a Serve config (the YAML
    would hold it in plain text), so `--write-config` with a key is an error, not a leaked secret."""
    from flashrt.cli import main
    from flashrt.errors import ConfigError
    from flashrt.integrations.ray_serve import deploy, serve_config

    bound: dict[str, tuple] = {}

    class _Deployment:
        def __init__(self, cls, name, **_):
            self.name = name

        def bind(self, *args):
            bound[self.name] = args
            return self.name

    monkeypatch.setattr(deploy, "serve_api", lambda: type("Serve", (), {"deployment": _Deployment}))
    app = SpeechApp(str(FIXTURE), api_key="s3cret")
    deploy.speech_app(app)
    assert bound["speech"][-1] == "s3cret" and "s3cret" not in repr(app)
    with pytest.raises(ConfigError, match="plain text"):
        serve_config(app)
    with pytest.raises(ConfigError, match="blank"):
        SpeechApp(str(FIXTURE), api_key=" ")
    path = tmp_path / "serve.yaml"
    code = main(["serve", "--ray", "--voice", f"talk={FIXTURE}", "--api-key", "k",
                 "--write-config", str(path)])
    assert code == 2 and not path.exists()
