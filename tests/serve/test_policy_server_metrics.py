"""The policy server's ``GET /metrics`` (plain HTTP on its websocket port), parsed by prometheus_client's
own text parser: requests by outcome, the step latency histogram, connections (open and refused) and
the queue depth change with what the server did. A stand-in policy: the metrics know no family."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("websockets")
pytest.importorskip("msgpack")
parser = pytest.importorskip("prometheus_client.parser")

from prometheus_client import CONTENT_TYPE_LATEST  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from flashrt.errors import InputError  # noqa: E402
from flashrt.serve.policy_server import PolicyServer, reply_outcome  # noqa: E402
from flashrt.serve.wire import packb  # noqa: E402

WAIT = 30.0  # guard against a hung test only; nothing asserts a duration


class _Policy:
    chunk_size, action_dim, n_action_steps = 4, 2, 4

    def infer(self, obs, noise=None, seed=None):
        if "state" not in obs:
            raise InputError("the observation has no state")
        return {"actions": np.zeros((4, 2), np.float32)}


def _scrape(server: PolicyServer) -> tuple[dict, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=WAIT) as r:
        assert r.status == 200
        content_type = r.headers["Content-Type"]
        text = r.read().decode()
    samples = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, content_type


def _requests(samples: dict, outcome: str) -> float:
    return samples.get(("flashrt_policy_requests_total", (("outcome", outcome),)), 0.0)


def test_metrics_parse_and_count_requests_connections_and_steps():
    with PolicyServer(_Policy(), port=0, max_connections=1) as server:
        before, content_type = _scrape(server)
        assert content_type == CONTENT_TYPE_LATEST
        with connect(f"ws://127.0.0.1:{server.port}", open_timeout=WAIT) as ws:
            ws.recv(timeout=WAIT)  # the metadata
            ws.send(packb({"state": np.zeros(2, np.float32)}))
            assert isinstance(ws.recv(timeout=WAIT), bytes)
            ws.send(packb({"images": {}}))
            assert json.loads(ws.recv(timeout=WAIT))["error"]["code"] == "invalid_observation"
            ws.send(b"\xc1")  # not msgpack
            assert json.loads(ws.recv(timeout=WAIT))["error"]["code"] == "invalid_message"
            during, _ = _scrape(server)
            with connect(f"ws://127.0.0.1:{server.port}", open_timeout=WAIT) as extra, \
                    pytest.raises(ConnectionClosed):  # beyond the cap: closed at once
                extra.recv(timeout=WAIT)
            after, _ = _scrape(server)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=WAIT) as r:
            assert r.status == 200  # the probe beside it is unchanged
    for outcome in ("ok", "invalid_observation", "invalid_message"):
        assert _requests(after, outcome) == _requests(before, outcome) + 1, outcome
    steps = ("flashrt_policy_step_seconds_count", ())
    assert after[steps] == before[steps] + 3
    assert before[("flashrt_policy_connections", ())] == 0 and during[("flashrt_policy_connections", ())] == 1
    assert after[("flashrt_policy_connections_refused_total", ())] == 1
    assert after[("flashrt_policy_queue_depth", ())] == 0 and after[("flashrt_policy_bytes_held", ())] == 0


def test_without_prometheus_client_metrics_is_a_501_naming_the_extra(monkeypatch):
    from flashrt.serve import metrics

    monkeypatch.setattr(metrics, "available", lambda: False)
    with PolicyServer(_Policy(), port=0) as server:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=WAIT)
        assert err.value.code == 501 and "flashrt[serve]" in err.value.read().decode()


def test_the_outcome_of_a_reply_is_ok_or_its_error_code():
    assert reply_outcome(b"\x80") == "ok"
    assert reply_outcome('{"error": {"code": "server_busy", "type": "x", "message": "y"}}') == "server_busy"
    assert reply_outcome("not json") == "internal_error"
