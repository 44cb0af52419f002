"""`flashrt serve-policy` against the real openpi-client (PyPI): metadata on connect, 50 sequential
infers equal to in-process `infer` with the same seed, ActionChunkBroker stepping, malformed /
oversize / disconnect cases, and the server still healthy after each."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from functools import cache

import msgpack
import numpy as np
import pytest
from support import pi0_e2e as E2E

from flashrt.runner.policy import load_policy
from flashrt.serve.policy_server import PolicyServer
from flashrt.serve.wire import WireError, packb, unpackb

openpi_client = pytest.importorskip("openpi_client", reason="openpi-client (the test extra) is not installed")
from openpi_client import action_chunk_broker, msgpack_numpy, websocket_client_policy  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

CASE = "pi05_cam1"
# openpi-client's own connect() call warns on websockets >= 14
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used:DeprecationWarning")


@cache
def policy():
    return load_policy(E2E.case(CASE).policy_dir, tokenizer=E2E.TOKENIZER)


@pytest.fixture(scope="module")
def server(one_thread):
    with PolicyServer(policy(), port=0, max_message_bytes=2**20) as srv:
        yield srv


def _client(srv) -> websocket_client_policy.WebsocketClientPolicy:
    return websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=srv.port)


def _error(reply, code: str) -> dict:
    """The error of a text reply (`{"error": {"code", "type", "message"}}`), checked to carry `code`."""
    assert isinstance(reply, str), reply
    error = json.loads(reply)["error"]
    assert error["code"] == code, error
    assert isinstance(error["type"], str) and isinstance(error["message"], str)
    return error


def _good_call_on(ws, seed: int = 1) -> None:
    """A good request on an open connection is answered exactly as in process."""
    ws.send(msgpack_numpy.packb({**E2E.case(CASE).obs(0), "seed": seed}))
    out = msgpack_numpy.unpackb(ws.recv(timeout=60))
    assert np.array_equal(out["actions"], policy().infer(E2E.case(CASE).obs(0), seed=seed)["actions"])


def _check_alive(srv) -> None:
    obs = E2E.case(CASE).obs(0)
    out = _client(srv).infer({**obs, "seed": 5})
    assert np.array_equal(out["actions"], policy().infer(obs, seed=5)["actions"])


def test_binds_localhost_by_default():
    srv = PolicyServer(policy(), port=0)
    try:
        assert srv.host == "127.0.0.1"
    finally:
        srv.close()


def test_metadata_on_connect(server):
    meta = _client(server).get_server_metadata()
    assert meta["server"] == "flashrt"
    assert (meta["chunk_size"], meta["action_dim"]) == (policy().chunk_size, policy().action_dim)
    assert meta["n_action_steps"] == policy().n_action_steps
    assert meta["policy"]["family"] == "pi0"


def test_fifty_infers_equal_in_process(server):
    case, client = E2E.case(CASE), _client(server)
    for k in range(50):
        obs = case.obs(k % 3)
        out = client.infer({**obs, "seed": k})
        want = policy().infer(obs, seed=k)["actions"]
        assert out["actions"].dtype == np.float32 and out["actions"].shape == want.shape
        assert np.array_equal(out["actions"], want), k
        assert out["server_timing"]["infer_ms"] > 0
        assert set(out["policy_timing"]) == {"preprocess_ms", "replay_ms", "postprocess_ms", "total_ms"}
        if k:
            assert out["server_timing"]["prev_total_ms"] > 0


def test_concurrent_connections_get_their_own_results(server):
    obs = [E2E.case(CASE).obs(i) for i in range(3)]
    want = {(c, k): policy().infer(obs[c], seed=100 * c + k)["actions"] for c in range(3) for k in range(5)}
    got, errors = {}, []

    def client(c: int) -> None:
        try:
            cl = _client(server)
            for k in range(5):
                got[c, k] = cl.infer({**obs[c], "seed": 100 * c + k})["actions"]
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and set(got) == set(want)
    assert all(np.array_equal(got[key], want[key]) for key in want)


def test_noise_over_the_wire_matches_lerobot(server):
    """The caller's noise travels as a numpy array; the result is lerobot's own chunk."""
    case, client = E2E.case(CASE), _client(server)
    for i in case.observations:
        out = client.infer({**case.obs(i, "lerobot"), "noise": case.tensor(i, "noise").numpy()})
        assert np.abs(out["actions"] - case.tensor(i, "actions").numpy()).max() <= 1e-4


def test_action_chunk_broker_steps_through_chunks(server):
    case, horizon = E2E.case(CASE), policy().n_action_steps
    broker = action_chunk_broker.ActionChunkBroker(_client(server), action_horizon=horizon)
    obs = {**case.obs(1), "seed": 3}
    chunk = policy().infer(case.obs(1), seed=3)["actions"]
    for t in range(2 * horizon):
        step = broker.infer(obs)
        assert step["actions"].shape == (policy().action_dim,)
        assert np.array_equal(step["actions"], chunk[t % horizon])
    broker.reset()


def _raw_array(dtype: str, data: bytes, shape: list) -> dict:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


@pytest.mark.parametrize(("message", "code", "expect"), [
    (b"\xc1\x00garbage", "invalid_message", "not a msgpack message"),
    (msgpack.packb({"state": _raw_array("|O", b"\0" * 8, [1])}), "unsupported_dtype", "dtype"),
    (msgpack.packb({"state": _raw_array("<f16", b"\0" * 96, [6])}), "unsupported_dtype", "float128"),
    (msgpack.packb({"state": _raw_array("<c8", b"\0" * 48, [6])}), "unsupported_dtype", "complex64"),
    (msgpack.packb({"state": _raw_array("<f4", b"\0" * 4, [9])}), "invalid_message", "needs 36 bytes"),
    (msgpack.packb([1, 2, 3]), "invalid_observation", "must be a map"),
    ("a text frame", "invalid_message", "expected a binary"),
])
def test_malformed_message_gets_an_error_and_the_connection_stays(server, message, code, expect):
    with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as ws:
        assert unpackb(ws.recv(), 2**20)["server"] == "flashrt"
        ws.send(message)
        assert expect in _error(ws.recv(), code)["message"]
        _good_call_on(ws)  # same connection, good call


@pytest.mark.parametrize(("change", "code", "expect"), [
    ({"state": np.full(2, np.nan, dtype=np.float32)}, "invalid_observation", "state"),
    ({"seed": -1}, "invalid_observation", "seed"),
    ({"seed": 1.5}, "invalid_observation", "seed"),
    ({"images": {"nope": np.zeros((4, 4, 3), np.uint8)}}, "invalid_observation", "camera"),
    ({"prompt": 5}, "invalid_observation", "prompt"),
    ({"noise": "abc"}, "invalid_observation", "noise"),
    ({"noise": {"x": 1}}, "invalid_observation", "noise"),
    ({"noise": [[1.0] * 12] * 6}, "invalid_observation", "noise"),
    ({"noise": np.zeros((3, 3), np.float32)}, "invalid_observation", "noise"),
], ids=["nan-state", "negative-seed", "float-seed", "unknown-camera", "int-prompt", "text-noise", "map-noise",
        "list-noise", "misshaped-noise"])
def test_each_refusal_carries_its_code_and_the_connection_stays(server, change, code, expect):
    with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as ws:
        ws.recv()
        ws.send(msgpack_numpy.packb(_obs_with(**change)))
        assert expect in _error(ws.recv(timeout=60), code)["message"]
        _good_call_on(ws, seed=7)


def test_error_codes_follow_the_error_class():
    from flashrt.errors import CheckpointError, ConfigError, InputError, NumericalError
    from flashrt.serve.policy_server import error_code

    assert error_code(InputError("x")) == "invalid_observation"
    assert error_code(ConfigError("x")) == "invalid_request"
    assert error_code(NumericalError("x")) == "numerical_error"
    assert error_code(CheckpointError("x")) == "policy_error"
    assert error_code(WireError("x", "unsupported_dtype")) == "unsupported_dtype"
    assert error_code(RuntimeError("x")) == "internal_error"


def test_a_bug_is_answered_internal_error_and_closes_only_that_connection(one_thread, monkeypatch):
    from websockets.exceptions import ConnectionClosed

    with PolicyServer(policy(), port=0) as srv:
        real = srv.policy.infer

        def broken(obs, **kw):
            if obs.get("prompt") == "boom":
                raise RuntimeError("a bug")
            return real(obs, **kw)

        monkeypatch.setattr(srv.policy, "infer", broken)
        with connect(f"ws://127.0.0.1:{srv.port}", max_size=None) as ws:
            ws.recv()
            ws.send(msgpack_numpy.packb(_obs_with(prompt="boom")))
            assert "a bug" in _error(ws.recv(timeout=60), "internal_error")["message"]
            with pytest.raises(ConnectionClosed) as info:
                ws.recv(timeout=30)
            assert info.value.rcvd.code == 1011
        monkeypatch.undo()
        with connect(f"ws://127.0.0.1:{srv.port}", max_size=None) as ws:
            ws.recv()
            _good_call_on(ws, seed=3)


def test_bad_observation_through_openpi_client_raises_and_next_call_works(server):
    client, obs = _client(server), E2E.case(CASE).obs(0)
    with pytest.raises(RuntimeError, match='"code": "invalid_observation"') as info:
        client.infer({**obs, "state": np.full(2, np.nan, dtype=np.float32)})
    assert "InputError" in str(info.value)
    with pytest.raises(RuntimeError, match="seed"):
        client.infer({**obs, "seed": -1})
    out = client.infer({**obs, "seed": 2})
    assert np.array_equal(out["actions"], policy().infer(obs, seed=2)["actions"])


def test_oversize_message_closes_that_connection_only(server):
    from websockets.exceptions import ConnectionClosed

    with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as ws:
        ws.recv()
        ws.send(msgpack_numpy.packb({"blob": np.zeros(2**20, dtype=np.uint8)}))
        with pytest.raises(ConnectionClosed) as info:
            ws.recv()
        assert info.value.rcvd.code == 1009
    _check_alive(server)


def test_disconnect_mid_inference_leaves_server_healthy(server):
    served = server.served
    with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as ws:
        ws.recv()
        ws.send(msgpack_numpy.packb({**E2E.case(CASE).obs(0), "seed": 0}))
    with socket.create_connection(("127.0.0.1", server.port)) as raw:  # half-open: no handshake at all
        raw.sendall(b"GET / HTTP/1.1\r\n")
    _check_alive(server)
    assert server.served >= served + 1


def test_healthz(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10) as r:
        assert r.status == 200


def test_wire_roundtrip_and_refusals():
    arrays = {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "b": np.float32(2.5), "c": [np.ones(2, bool)]}
    back = unpackb(packb(arrays), 2**20)
    assert np.array_equal(back["a"], arrays["a"]) and back["a"].dtype == np.int16
    assert back["a"].flags.writeable
    assert back["b"] == np.float32(2.5) and isinstance(back["b"], np.float32)
    assert back["c"][0].dtype == bool
    assert np.array_equal(msgpack_numpy.unpackb(packb(arrays))["a"], arrays["a"])  # openpi reads ours
    with pytest.raises(WireError, match="exceeds"):
        unpackb(packb({"x": np.zeros(100)}), 64)
    with pytest.raises(WireError, match="shape"):
        unpackb(msgpack.packb({b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": [-1]}), 99)


def test_cli_user_errors_are_one_line(capsys, tmp_path):
    from flashrt.cli import main

    assert main(["serve-policy", str(tmp_path / "missing")]) == 2
    assert main(["serve-policy", str(tmp_path), "--port", "70000"]) == 2
    assert main(["serve-policy", str(tmp_path), "--max-connections", "0"]) == 2
    assert main(["serve-policy", str(tmp_path), "--max-held-mb", "0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("flashrt: error") == 4
    assert "--max-connections" in err and "--max-held-mb" in err


def test_cli_passes_the_resource_limits_to_the_server(monkeypatch):
    from flashrt.cli import main
    from flashrt.serve import policy_server

    got = {}

    class Stub:
        host, port, max_message_bytes = "127.0.0.1", 0, 1

        def __init__(self, policy, host, port, **kwargs):
            got.update(kwargs)

        def serve_forever(self):
            return None

        def close(self):
            return None

    monkeypatch.setattr(policy_server, "PolicyServer", Stub)
    assert main(["serve-policy", str(E2E.case(CASE).policy_dir), "--tokenizer", str(E2E.TOKENIZER),
                 "--max-connections", "5", "--max-held-mb", "3", "--max-message-mb", "2"]) == 0
    assert got == {"max_connections": 5, "max_bytes_held": 3 * 2**20, "max_message_bytes": 2 * 2**20,
                   "max_batch": 4, "batch_window_ms": 2.0}


def test_cli_passes_the_embodiment_to_the_family(capsys):
    """--embodiment reaches load_policy: a Pi0 checkpoint refuses it by name (GROOT takes it)."""
    from flashrt.cli import main

    assert main(["serve-policy", str(E2E.case("pi05_cam1").policy_dir), "--embodiment", "tag_a",
                 "--tokenizer", str(E2E.TOKENIZER)]) == 2
    assert "take no option(s) ['embodiment']" in capsys.readouterr().err


# ------------------------------------------------------------ resources, server paths, wire dtypes


def test_metadata_names_no_server_path(server):
    meta = _client(server).get_server_metadata()
    text = repr(meta)
    assert str(E2E.case(CASE).policy_dir) not in text and "/work" not in text and "/tmp" not in text
    assert meta["policy"]["path"] == E2E.case(CASE).policy_dir.name


def _obs_with(**changes):
    return {**E2E.case(CASE).obs(0), **changes}


@pytest.mark.parametrize("convert", [
    lambda o: {"state": o["state"].astype(np.float16).astype(np.float32)},  # the value float16 carries
    lambda o: {"images": {k: v.astype(np.uint16) for k, v in o["images"].items()}},
    lambda o: {"images": {k: v.astype(np.int64) for k, v in o["images"].items()}},
], ids=["float16-state", "uint16-images", "int64-images"])
def test_lossless_dtypes_are_converted_and_served(server, convert):
    obs = E2E.case(CASE).obs(0)
    sent = {**obs, **convert(obs)}
    if "state" in convert(obs):
        sent["state"] = sent["state"].astype(np.float16)
        obs = {**obs, "state": sent["state"].astype(np.float32)}
    out = _client(server).infer({**sent, "seed": 4})
    assert np.array_equal(out["actions"], policy().infer(obs, seed=4)["actions"])


def test_int_state_is_converted_exactly():
    from flashrt.serve.wire import coerce

    sent = {"state": np.array([-3, 7, 2**20], np.int32), "images": {"a": np.full((2, 2, 3), 9, np.int16)}}
    got = coerce(sent)
    assert got["state"].dtype == np.float32 and got["state"].tolist() == [-3.0, 7.0, 2.0**20]
    assert got["images"]["a"].dtype == np.uint8 and int(got["images"]["a"][0, 0, 0]) == 9


@pytest.mark.parametrize(("sent", "expect"), [
    ({"images": {"top": np.full((37, 50, 3), 4000, np.uint16)}}, "does not fit uint8"),
    ({"images": {"top": np.full((37, 50, 3), -1, np.int8)}}, "does not fit uint8"),
    ({"state": np.ones(6, bool)}, "bool array"),
    ({"state": np.full(6, 2**40, np.int64)}, "not exact in float32"),
    ({"state": np.full(6, 2**25, np.uint32)}, "not exact in float32"),
], ids=["uint16-image-out-of-range", "negative-int8-image", "bool-state", "huge-int-state",
        "huge-uint32-state"])
def test_lossy_dtypes_get_a_wire_error_and_the_connection_stays(server, sent, expect):
    with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as ws:
        ws.recv()
        ws.send(msgpack_numpy.packb(_obs_with(**sent)))
        error = _error(ws.recv(), "unsupported_dtype")
        assert error["type"] == "WireError" and expect in error["message"]
        _good_call_on(ws)


def test_the_default_message_limit_follows_the_policy():
    from flashrt.serve.policy_server import MAX_IMAGE_BYTES, message_limit

    srv = PolicyServer(policy(), port=0)
    try:
        assert srv.max_message_bytes == message_limit(policy()) == MAX_IMAGE_BYTES + 2**20  # one camera
    finally:
        srv.close()


def test_connections_beyond_the_cap_are_refused_and_the_others_served(one_thread):
    from websockets.exceptions import ConnectionClosed

    with PolicyServer(policy(), port=0, max_connections=2) as srv:
        first = connect(f"ws://127.0.0.1:{srv.port}", max_size=None)
        second = connect(f"ws://127.0.0.1:{srv.port}", max_size=None)
        try:
            first.recv(), second.recv()
            with connect(f"ws://127.0.0.1:{srv.port}", max_size=None) as third:
                with pytest.raises(ConnectionClosed) as info:
                    third.recv(timeout=30)
                assert info.value.rcvd.code == 1013
            second.send(msgpack_numpy.packb({**E2E.case(CASE).obs(0), "seed": 6}))
            out = msgpack_numpy.unpackb(second.recv(timeout=60))
            assert np.array_equal(out["actions"], policy().infer(E2E.case(CASE).obs(0), seed=6)["actions"])
        finally:
            first.close()
            second.close()


def test_messages_beyond_the_byte_budget_are_refused_with_the_connection_kept(one_thread):
    with PolicyServer(policy(), port=0, max_bytes_held=1000) as srv:
        with connect(f"ws://127.0.0.1:{srv.port}", max_size=None) as ws:
            ws.recv()
            ws.send(msgpack_numpy.packb(_obs_with(seed=1)))  # ~6 KB: twice its size is over 1000 bytes
            assert "retry" in _error(ws.recv(timeout=60), "server_busy")["message"]
        assert srv._budget.held == 0


DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64"]


def _dtype_case(role: str, dtype: str) -> tuple[dict, dict | None, str | None]:
    """(what is sent, the observation in-process that must give the same chunk (None: refused), the
    refusal's code). Values are chosen so that every integer dtype can hold them."""
    obs = _obs_with(seed=9)
    kind = np.dtype(dtype).kind
    if role == "state":
        value = np.arange(6) if kind in "biu" else obs["state"]
        sent = {"state": value.astype(dtype)}
        if kind == "b":
            return sent, None, "unsupported_dtype"
        state = sent["state"].astype(np.float32) if dtype != "float64" else sent["state"]
        return sent, {"state": state}, None
    if role == "image":  # 0..127 integer pixels: uint8 in-process; float data in 0..255 is not an image
        img = obs["images"]["top"] // 2
        sent = {"images": {"top": (img > 64) if kind == "b" else img.astype(dtype)}}
        if kind == "f":
            return sent, None, "invalid_observation"
        return sent, {"images": {"top": sent["images"]["top"].astype(np.uint8)}}, None
    if role == "unit-image":  # floats in [0, 1]: taken as they are (float16 widened exactly)
        sent = {"images": {"top": (obs["images"]["top"] / 255.0).astype(dtype)}}
        top = sent["images"]["top"]
        return sent, {"images": {"top": top.astype(np.float32) if dtype == "float16" else top}}, None
    noise = np.random.default_rng(0).standard_normal((1, 6, 12))  # the family's noise shape
    sent = {"noise": (np.round(noise * 3) if kind in "iu" else noise).astype(dtype)}
    if kind == "u":
        sent["noise"] = np.abs(noise * 3).round().astype(dtype)
    if kind == "b":
        return sent, None, "unsupported_dtype"
    return sent, {"noise": sent["noise"].astype(np.float32) if dtype != "float64" else sent["noise"]}, None


DTYPE_CASES = [(role, dtype) for role in ("state", "image", "unit-image", "noise") for dtype in DTYPES
               if role != "unit-image" or dtype.startswith("float")]


@pytest.mark.parametrize(("role", "dtype"), DTYPE_CASES, ids=[f"{r}-{d}" for r, d in DTYPE_CASES])
def test_every_dtype_is_converted_exactly_or_refused_with_the_connection_kept(server, role, dtype):
    """Each wire dtype in each role: served bit-identically to the in-process call on the exactly
    converted value, or refused with its code; then the same connection serves a good call."""
    sent, want, code = _dtype_case(role, dtype)
    with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as ws:
        ws.recv()
        ws.send(msgpack_numpy.packb(_obs_with(seed=9, **sent)))
        reply = ws.recv(timeout=60)
        if want is None:
            _error(reply, code)
        else:
            assert not isinstance(reply, str), reply
            obs = _obs_with(**{k: v for k, v in want.items() if k != "noise"})
            expect = policy().infer(obs, noise=want.get("noise"), seed=None if "noise" in want else 9)
            assert np.array_equal(msgpack_numpy.unpackb(reply)["actions"], expect["actions"])
        _good_call_on(ws, seed=2)


# ------------------------------------------------------------------------------- resources (#28.6)


def _raw_handshake(port: int) -> socket.socket:
    """A websocket opened by hand (to send a frame header without its payload); the metadata frame is
    read and dropped."""
    import base64
    import os

    raw = socket.create_connection(("127.0.0.1", port), timeout=30)
    key = base64.b64encode(os.urandom(16)).decode()
    raw.sendall(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += raw.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    _raw_frame(raw)  # the metadata
    return raw


def _recv_exact(raw: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = raw.recv(n - len(data))
        assert chunk, "connection closed mid-frame"
        data += chunk
    return data


def _raw_frame(raw: socket.socket) -> tuple[int, bytes]:
    """(opcode, payload) of the next unmasked server frame."""
    b0, b1 = _recv_exact(raw, 2)
    n = b1 & 0x7F
    if n == 126:
        n = int.from_bytes(_recv_exact(raw, 2), "big")
    elif n == 127:
        n = int.from_bytes(_recv_exact(raw, 8), "big")
    return b0 & 0x0F, _recv_exact(raw, n)


def test_an_oversized_message_is_refused_from_its_header_before_any_decoding(server, monkeypatch):
    """A frame that announces more than the limit is refused (close 1009) before its payload arrives:
    the server never buffers or decodes it, and goes on serving."""
    from flashrt.serve import policy_server

    decoded = []
    monkeypatch.setattr(policy_server, "unpackb", lambda *a: decoded.append(a) or unpackb(*a))
    with _raw_handshake(server.port) as raw:
        raw.sendall(bytes([0x82, 0x80 | 127]) + (2**40).to_bytes(8, "big") + b"\0\0\0\0")  # no payload
        opcode, payload = _raw_frame(raw)
    assert opcode == 0x8 and int.from_bytes(payload[:2], "big") == 1009
    assert decoded == []
    _check_alive(server)


def test_other_clients_are_served_while_a_large_message_is_decoded(one_thread, monkeypatch):
    """Client A's 1080p message is held in decoding (a hook); meanwhile client B's pings are answered
    and its requests served exactly; then A's message is served too."""
    from flashrt.serve import policy_server

    entered, release = threading.Event(), threading.Event()

    def held(data, limit):
        if len(data) > 2**20:
            entered.set()
            release.wait(60)
        return unpackb(data, limit)

    monkeypatch.setattr(policy_server, "unpackb", held)
    big = np.random.default_rng(0).integers(0, 256, (1080, 1920, 3), dtype=np.uint8)
    replies: list = []
    with PolicyServer(policy(), port=0) as srv:
        def client_a() -> None:
            with connect(f"ws://127.0.0.1:{srv.port}", max_size=None) as ws:
                ws.recv()
                ws.send(msgpack_numpy.packb(_obs_with(images={"top": big}, seed=4)))
                replies.append(ws.recv(timeout=60))

        a = threading.Thread(target=client_a)
        a.start()
        try:
            assert entered.wait(60)
            with connect(f"ws://127.0.0.1:{srv.port}", max_size=None) as ws:
                ws.recv()
                assert ws.ping().wait(30)
                for seed in (1, 2):
                    _good_call_on(ws, seed=seed)
                assert not replies  # A is still held in decoding
        finally:
            release.set()
            a.join(60)
    want = policy().infer(_obs_with(images={"top": big}), seed=4)["actions"]
    assert len(replies) == 1 and np.array_equal(msgpack_numpy.unpackb(replies[0])["actions"], want)


class _Described:
    """A stand-in policy that only describes itself."""

    chunk_size, action_dim, n_action_steps = 4, 2, 4

    def __init__(self, described) -> None:
        self.frontend = type("F", (), {"describe": lambda _self: described()})()


def _fails():
    raise ValueError("cannot describe")


@pytest.mark.parametrize(("described", "frames"), [
    (lambda: {"cameras": ["a", "b"]}, 2),
    (lambda: {"cameras": ["a"], "frames_per_camera": 2}, 2),
    (lambda: {"cameras": ["a", "b"], "frames_per_camera": 2}, None),  # 4 frames: over the 64 MiB cap
    (lambda: {"cameras": 2}, 2),
    (lambda: {"family": "x"}, None),
    (lambda: {"cameras": []}, None),
    (_fails, None),
], ids=["two-cameras", "two-frames", "four-frames", "camera-count", "undescribed", "no-cameras",
        "describe-fails"])
def test_the_message_limit_counts_every_frame_the_policy_takes(described, frames):
    """Each camera frame at up to 1080p float32 plus 1 MiB; the 64 MiB default when that is more or
    when the policy does not say what it takes."""
    from flashrt.serve.policy_server import DEFAULT_MAX_MESSAGE_BYTES, MAX_IMAGE_BYTES, message_limit

    want = DEFAULT_MAX_MESSAGE_BYTES if frames is None else frames * MAX_IMAGE_BYTES + 2**20
    assert message_limit(_Described(described)) == want


def test_metadata_cuts_every_server_path_to_its_last_part(tmp_path):
    from flashrt.serve.policy_server import policy_metadata

    folder = tmp_path / "ckpt" / "pi05_libero"
    folder.mkdir(parents=True)
    meta = policy_metadata(_Described(lambda: {
        "path": str(folder), "note": f"loaded from {folder} (lerobot)",
        "files": [f"{folder}/model.safetensors"],
        "home": "~/models/pi05_libero", "nested": {"tokenizer": f"tokenizer={tmp_path}/tok.model"},
        "ratio": "3/4", "hub": "lerobot/pi05_base"}))
    text = json.dumps(meta)
    assert str(tmp_path) not in text and "~" not in text and "/ckpt" not in text
    assert meta["policy"]["path"] == "pi05_libero"
    assert meta["policy"]["note"] == "loaded from pi05_libero (lerobot)"
    assert meta["policy"]["files"] == ["model.safetensors"] and meta["policy"]["home"] == "pi05_libero"
    assert meta["policy"]["nested"]["tokenizer"] == "tokenizer=tok.model"
    assert (meta["policy"]["ratio"], meta["policy"]["hub"]) == ("3/4", "lerobot/pi05_base")  # not paths
