"""The policy deployment of `flashrt.integrations.ray_serve` without Ray: a replica loaded with batch
buckets runs the requests waiting for its worker together (`Policy.infer_batch`), each answered with
the actions it gets alone (up to float rounding) or its own error; a lone request is `Policy.infer`."""

import asyncio
import json

import numpy as np
import pytest

pytest.importorskip("msgpack")
pytest.importorskip("starlette")

from flashrt.demo import ToyRobot, ensure_demo_checkpoint  # noqa: E402
from flashrt.integrations.ray_serve import PolicyIngress  # noqa: E402
from flashrt.runner.policy import load_policy  # noqa: E402
from flashrt.serve.wire import packb, unpackb  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    folder, _ = ensure_demo_checkpoint(tmp_path_factory.mktemp("demo") / "pi05")
    return folder


def _answers(ingress, messages):
    async def run():
        return await asyncio.gather(*(ingress._answer(m, None) for m in messages))

    return asyncio.run(asyncio.wait_for(run(), 60))


def test_requests_waiting_together_share_one_batched_replay(demo, one_thread):
    ingress = PolicyIngress(str(demo), {"batches": [1, 2, 4]}, 1)
    alone = load_policy(demo)
    robot = ToyRobot()
    observations = [robot.observe() for _ in range(3)]
    bad = {**observations[0], "state": "not an array"}
    messages = [packb({**obs, "seed": k}) for k, obs in enumerate(observations)] + [packb(bad)]
    replies = _answers(ingress, messages)
    assert ingress.rounds == {4: 1}  # all four in one run of the worker
    for k, obs in enumerate(observations):
        status, body = replies[k]
        assert status == 200, body
        reply = unpackb(body, 1 << 24)
        assert reply["server_timing"]["batch"] == 3  # the bad one took no row
        want = alone.infer(obs, seed=k)["actions"]
        np.testing.assert_allclose(reply["actions"], want, rtol=1e-4, atol=1e-5)
    status, body = replies[3]
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_observation"
    (status, body), = _answers(ingress, [packb({**observations[1], "seed": 7})])  # a lone one: infer, exactly
    assert status == 200 and ingress.rounds == {4: 1, 1: 1}
    assert np.array_equal(unpackb(body, 1 << 24)["actions"], alone.infer(observations[1], seed=7)["actions"])
