"""`flashrt serve`'s start-up: the port is bound before any voice loads, the banner comes after the bind,
and clients see voice names, never this machine's paths."""

import socket

import numpy as np
import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from flashrt.cli import main  # noqa: E402
from flashrt.errors import ConfigError  # noqa: E402
from flashrt.serve.cli import named_sources, voice_name  # noqa: E402


class _Voice:
    sample_rate = 8000
    name = "/srv/models/secret-folder/voice"  # a family may name itself by its path: never shown

    def stream(self, text, seed=None, speed=1.0):
        yield np.zeros(8, np.float32)


@pytest.fixture
def loads(monkeypatch):
    calls = []

    def fake_load(source, **kw):
        calls.append(source)
        return _Voice()

    monkeypatch.setattr("flashrt.runner.tts.load_tts", fake_load)
    return calls


def test_a_busy_port_fails_at_once_before_any_voice_loads(capsys, loads):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code = main(["serve", "--port", str(port), "--voice", "/models/a"])
    out, err = capsys.readouterr()
    assert code == 2 and loads == [], (out, err)
    assert f"127.0.0.1:{port}" in err and "serving" not in out and "voices" not in out


def test_voices_are_served_by_name_and_the_banner_follows_the_bind(capsys, loads, monkeypatch):
    seen = {}

    def fake_run(self, sockets=None):
        seen["app"], seen["sockets"] = self.config.app, sockets
        seen["listening"] = sockets[0].getsockname()[1]
        seen["banner_before_run"] = capsys.readouterr().out

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    code = main(["serve", "--port", "0", "--no-warmup", "--voice", "/srv/models/en_US-joe-medium.onnx",
                 "--voice", "tara=/srv/models/orpheus-3b", "--voice", "/srv/models/vocos-folder/"])
    assert code == 0
    from starlette.testclient import TestClient

    models = TestClient(seen["app"]).get("/v1/models").json()
    ids = sorted(m["id"] for m in models["data"])
    assert ids == ["en_US-joe-medium", "tara", "vocos-folder"]
    assert loads == ["/srv/models/en_US-joe-medium.onnx", "/srv/models/orpheus-3b",
                     "/srv/models/vocos-folder/"]
    health = TestClient(seen["app"]).get("/health").text
    assert "/srv" not in health and "secret" not in health
    assert f":{seen['listening']}" in seen["banner_before_run"]


def test_voice_names():
    assert voice_name("en_US-joe-medium") == "en_US-joe-medium"
    assert voice_name("/a/b/en_US-joe-medium.onnx") == "en_US-joe-medium"
    assert voice_name("/a/b/en_US-joe-medium.onnx.json") == "en_US-joe-medium"
    assert voice_name("/a/b/orpheus/") == "orpheus"
    assert named_sources(["x=/a/b", "/c/d"]) == {"x": "/a/b", "d": "/c/d"}
    with pytest.raises(ConfigError, match="two voices are named 'd'"):
        named_sources(["/a/d", "/b/d"])
    with pytest.raises(ConfigError, match="NAME=SOURCE"):
        named_sources(["a/b=/c"])


def test_slots_reach_the_loader_and_bad_slots_load_nothing(capsys, monkeypatch):
    seen = []

    def fake_load(source, **kw):
        seen.append(kw.get("slots"))
        return _Voice()

    monkeypatch.setattr("flashrt.runner.tts.load_tts", fake_load)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    assert main(["serve", "--port", "0", "--no-warmup", "--voice", "/srv/orpheus", "--slots", "4"]) == 0
    assert main(["serve", "--port", "0", "--no-warmup", "--voice", "/srv/piper.onnx"]) == 0
    assert seen == [4, None]  # only given when asked: other families take no slots
    assert main(["serve", "--port", "0", "--voice", "/srv/orpheus", "--slots", "0"]) == 2
    assert main(["serve", "--port", "0", "--voice", "/srv/orpheus", "--threads", "0"]) == 2
    assert seen == [4, None] and "--slots" in capsys.readouterr().err


def test_threads_set_torchs_cpu_threads_before_the_voices_load(monkeypatch):
    import torch

    seen = []

    def fake_load(source, **kw):
        seen.append(torch.get_num_threads())
        return _Voice()

    monkeypatch.setattr("flashrt.runner.tts.load_tts", fake_load)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    before = torch.get_num_threads()
    try:
        assert main(["serve", "--port", "0", "--no-warmup", "--voice", "/srv/orpheus", "--threads", "1"]) == 0
        assert seen == [1]
    finally:
        torch.set_num_threads(before)


def test_decoder_precision_reaches_the_loader_only_when_asked_and_never_a_ray_deployment(capsys, monkeypatch):
    seen = []

    def fake_load(source, **kw):
        seen.append(kw.get("decoder_precision", "absent"))
        return _Voice()

    monkeypatch.setattr("flashrt.runner.tts.load_tts", fake_load)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    assert main(["serve", "--port", "0", "--no-warmup", "--voice", "/srv/piper.onnx",
                 "--decoder-precision", "bf16"]) == 0
    assert main(["serve", "--port", "0", "--no-warmup", "--voice", "/srv/orpheus"]) == 0
    assert seen == ["bf16", "absent"]
    assert main(["serve", "--ray", "--voice", "/srv/orpheus", "--decoder-precision", "bf16"]) == 2
    assert "Piper voices" in capsys.readouterr().err and len(seen) == 2
