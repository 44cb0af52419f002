"""The policy server batching several robots: 4 openpi-client connections at once each get the actions
of their own observation (<= 1e-5 vs the request served alone, same noise) from shared replays; a bad
request among good ones gets its own error and the good ones their actions; a bug in one request
closes only its connection; captures do not grow; a policy that cannot batch is served one request at
a time; the connection and byte limits still hold; the CLI's batching options."""

from __future__ import annotations

import json
import threading
from functools import cache

import numpy as np
import pytest
from support import pi0_e2e as E2E
from support import pi0_fast

from flashrt.runner.policy import load_policy
from flashrt.serve.policy_server import PolicyServer

openpi_client = pytest.importorskip("openpi_client", reason="openpi-client (the test extra) is not installed")
from openpi_client import msgpack_numpy, websocket_client_policy  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

CASE = "pi05_cam1"
WINDOW_MS = 500.0  # long enough that every robot's request joins the round (it closes once all are in)
TIMEOUT = 120
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used:DeprecationWarning")


@cache
def batched():
    return load_policy(E2E.case(CASE).policy_dir, tokenizer=E2E.TOKENIZER, batches=(1, 2, 4))


@cache
def alone():
    return load_policy(E2E.case(CASE).policy_dir, tokenizer=E2E.TOKENIZER)


def _obs(robot: int) -> dict:
    case = E2E.case(CASE)
    obs = case.obs(robot % len(case.observations))
    return {**obs, "prompt": f"{obs['prompt']} {'now ' * robot}".strip()}  # each robot its own prompt


def _noise(robot: int) -> np.ndarray:
    return np.random.default_rng(robot).standard_normal((1, 6, 12)).astype(np.float32)


def _want(robot: int, k: int) -> np.ndarray:
    """What robot's k-th request gets served alone: robot 3 sends noise, the others seeds."""
    if robot == 3:
        return alone().infer(_obs(robot), noise=_noise(k))["actions"]
    return alone().infer(_obs(robot), seed=100 * robot + k)["actions"]


def _message(robot: int, k: int) -> dict:
    extra = {"noise": _noise(k)} if robot == 3 else {"seed": 100 * robot + k}
    return {**_obs(robot), **extra}


def _run_threads(target, n: int) -> list:
    errors: list = []

    def guarded(i: int) -> None:
        try:
            target(i)
        except Exception as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a client hung"
    return errors


def test_four_openpi_clients_at_once_get_their_own_actions(one_thread):
    captured = batched().frontend.report()["batch_captured"]
    replays = dict(batched().frontend.report()["batch_replays"])
    with PolicyServer(batched(), port=0, batch_window_ms=WINDOW_MS) as srv:
        assert srv.max_batch == 4
        clients = [websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=srv.port)
                   for _ in range(4)]
        start, got = threading.Barrier(4, timeout=TIMEOUT), {}

        def robot(i: int) -> None:
            start.wait()
            for k in range(3):
                got[i, k] = clients[i].infer(_message(i, k))

        assert _run_threads(robot, 4) == []
        served, rounds = srv.served, dict(srv.rounds)
    assert served == 12 and max(rounds) > 1, rounds
    for (i, k), out in got.items():
        want = _want(i, k)
        assert out["actions"].dtype == np.float32 and out["actions"].shape == want.shape
        assert np.abs(out["actions"] - want).max() <= 1e-5, (i, k)
    assert max(out["server_timing"]["batch"] for out in got.values()) > 1
    after = batched().frontend.report()
    assert sum(after["batch_replays"][n] - replays[n] for n in (2, 4)) > 0  # a bucket > 1 was replayed
    assert after["batch_captured"] == captured and after["captured_on_miss"] == []


def _sockets(srv, n: int) -> list:
    sockets = [connect(f"ws://127.0.0.1:{srv.port}", max_size=None) for _ in range(n)]
    for ws in sockets:
        ws.recv(timeout=TIMEOUT)  # the metadata
    return sockets


def _error(reply) -> dict:
    assert isinstance(reply, str), reply
    return json.loads(reply)["error"]


def test_a_bad_request_among_good_ones_gets_its_own_error(one_thread):
    bad_state = {**_obs(1), "state": np.full(2, np.nan, np.float32), "seed": 1}
    bad_noise = {**_obs(2), "noise": "abc"}
    messages = [_message(0, 0), bad_state, _message(3, 0), bad_noise]
    with PolicyServer(batched(), port=0, batch_window_ms=WINDOW_MS) as srv:
        sockets = _sockets(srv, 4)
        try:
            for ws, message in zip(sockets, messages):
                ws.send(msgpack_numpy.packb(message))
            replies = [ws.recv(timeout=TIMEOUT) for ws in sockets]
            for k, field in ((1, "state"), (3, "noise")):
                error = _error(replies[k])
                assert error["code"] == "invalid_observation" and field in error["message"]
            for k, robot in ((0, 0), (2, 3)):
                out = msgpack_numpy.unpackb(replies[k])
                assert np.abs(out["actions"] - _want(robot, 0)).max() <= 1e-5
                assert out["server_timing"]["batch"] == 2  # the two good ones shared a replay
            sockets[1].send(msgpack_numpy.packb(_message(1, 0)))  # the refused connection goes on
            out = msgpack_numpy.unpackb(sockets[1].recv(timeout=TIMEOUT))
            assert np.abs(out["actions"] - _want(1, 0)).max() <= 1e-5
        finally:
            for ws in sockets:
                ws.close()
        assert srv.rounds[4] == 1 and srv.errors == 2


def test_a_bug_in_one_request_closes_only_its_connection(one_thread, monkeypatch):
    from websockets.exceptions import ConnectionClosed

    front = batched().frontend
    check = front.check

    def broken(obs, noise=None):
        if obs.get("prompt") == "boom":
            raise RuntimeError("a bug")
        return check(obs, noise)

    monkeypatch.setattr(front, "check", broken)
    with PolicyServer(batched(), port=0, batch_window_ms=WINDOW_MS) as srv:
        sockets = _sockets(srv, 3)
        try:
            for ws, message in zip(sockets, [_message(0, 1), {**_obs(1), "prompt": "boom"}, _message(2, 1)]):
                ws.send(msgpack_numpy.packb(message))
            assert _error(sockets[1].recv(timeout=TIMEOUT))["code"] == "internal_error"
            with pytest.raises(ConnectionClosed) as info:
                sockets[1].recv(timeout=TIMEOUT)
            assert info.value.rcvd.code == 1011
            for k in (0, 2):
                out = msgpack_numpy.unpackb(sockets[k].recv(timeout=TIMEOUT))
                assert np.abs(out["actions"] - _want(k, 1)).max() <= 1e-5
                assert out["server_timing"]["batch"] == 2
        finally:
            for ws in sockets:
                ws.close()


def test_a_policy_that_cannot_batch_is_served_one_request_at_a_time(one_thread):
    folder = pi0_fast.ROOT / "cam1" / "policy"
    pol = load_policy(folder, tokenizer=pi0_fast.TOKENIZER)
    obs = [pi0_fast.observation("cam1", i % 2) for i in range(3)]
    want = [pol.infer(o)["actions"] for o in obs]
    with PolicyServer(pol, port=0, max_batch=4, batch_window_ms=WINDOW_MS) as srv:
        assert srv.max_batch == 1
        clients = [websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=srv.port)
                   for _ in range(3)]
        got = {}
        assert _run_threads(lambda i: got.__setitem__(i, clients[i].infer(obs[i])), 3) == []
        assert dict(srv.rounds) == {1: 3}
    assert all(np.array_equal(got[i]["actions"], want[i]) for i in range(3))
    assert all(got[i]["server_timing"]["batch"] == 1 for i in range(3))


def test_the_limits_hold_with_batching(one_thread):
    from websockets.exceptions import ConnectionClosed

    with PolicyServer(batched(), port=0, max_connections=2, batch_window_ms=WINDOW_MS) as srv:
        sockets = _sockets(srv, 2)
        try:
            with connect(f"ws://127.0.0.1:{srv.port}", max_size=None) as third:
                with pytest.raises(ConnectionClosed) as info:
                    third.recv(timeout=TIMEOUT)
                assert info.value.rcvd.code == 1013
            for k, ws in enumerate(sockets):
                ws.send(msgpack_numpy.packb(_message(k, 2)))
            for k, ws in enumerate(sockets):
                out = msgpack_numpy.unpackb(ws.recv(timeout=TIMEOUT))
                assert np.abs(out["actions"] - _want(k, 2)).max() <= 1e-5
        finally:
            for ws in sockets:
                ws.close()
    with PolicyServer(batched(), port=0, max_bytes_held=1000) as srv:
        (ws,) = _sockets(srv, 1)
        with ws:
            ws.send(msgpack_numpy.packb(_message(0, 0)))
            assert _error(ws.recv(timeout=TIMEOUT))["code"] == "server_busy"
        assert srv._budget.held == 0


@pytest.mark.parametrize(("kwargs", "expect"), [({"max_batch": 0}, "max_batch"),
                                                ({"max_batch": 2.0}, "max_batch"),
                                                ({"batch_window_ms": -1.0}, "batch_window_ms")])
def test_bad_batching_settings_are_refused(kwargs, expect):
    from flashrt.errors import ConfigError

    with pytest.raises(ConfigError, match=expect):
        PolicyServer(batched(), port=0, **kwargs)


class _Stub:
    host, port, max_message_bytes = "127.0.0.1", 0, 1
    got: dict = {}

    def __init__(self, policy, host, port, **kwargs):
        _Stub.got = {"policy": policy, **kwargs}

    def serve_forever(self):
        return None

    def close(self):
        return None


@pytest.mark.parametrize(("args", "batches"), [([], (1, 2, 4)), (["--max-batch", "8"], (1, 2, 4, 8)),
                                               (["--max-batch", "1"], (1,))])
def test_cli_loads_the_batch_buckets(monkeypatch, args, batches):
    from flashrt.cli import main
    from flashrt.serve import policy_server

    monkeypatch.setattr(policy_server, "PolicyServer", _Stub)
    assert main(["serve-policy", str(E2E.case(CASE).policy_dir), "--tokenizer", str(E2E.TOKENIZER),
                 "--batch-window-ms", "3", *args]) == 0
    assert _Stub.got["policy"].batches == batches and _Stub.got["batch_window_ms"] == 3.0
    assert _Stub.got["max_batch"] == batches[-1]


def test_cli_says_when_a_family_cannot_batch(monkeypatch, capsys):
    from flashrt.cli import main
    from flashrt.serve import policy_server

    monkeypatch.setattr(policy_server, "PolicyServer", _Stub)
    assert main(["serve-policy", str(pi0_fast.ROOT / "cam1" / "policy"), "--tokenizer",
                 str(pi0_fast.TOKENIZER)]) == 0
    assert "one request at a time (Pi0-FAST decodes" in capsys.readouterr().err
    assert _Stub.got["policy"].batches == (1,)


def test_cli_refuses_bad_batching_options(capsys, tmp_path):
    from flashrt.cli import main

    assert main(["serve-policy", str(tmp_path), "--max-batch", "0"]) == 2
    assert main(["serve-policy", str(tmp_path), "--batch-window-ms", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--max-batch" in err and "--batch-window-ms" in err and "Traceback" not in err
