"""Pi0 / Pi0.5 batch buckets: each row of a batched replay is the observation served alone (<= 1e-5,
float32, same noise), whatever its neighbours and the rows left over in a padded bucket; every
(batch, prompt) bucket is captured at load and never again; the trace backend records the batched
step; refused batch settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import pi0_e2e as E2E

from flashrt.errors import ConfigError, InputError
from flashrt.frontends.pi0.frontend import Pi0Frontend, batch_buckets
from flashrt.frontends.pi0.weights import load_pi0
from flashrt.runner.policy import Request, load_policy

ATOL = 1e-5
LONG_PROMPT = "pick up the red cube and put it into the box"  # another prompt bucket than the fixtures'


def _policies(name: str, batches=(1, 2, 4)):
    case = E2E.case(name)
    return (load_policy(case.policy_dir, tokenizer=E2E.TOKENIZER, batches=batches),
            load_policy(case.policy_dir, tokenizer=E2E.TOKENIZER))


def _requests(name: str, n: int) -> list[Request]:
    """n robots: the case's observations in turn, one with a longer prompt, each its own seed; the last
    with its own noise array instead."""
    case, rng = E2E.case(name), np.random.default_rng(n)
    obs = [case.obs(i % len(case.observations)) for i in range(n)]
    obs[min(1, n - 1)] = {**obs[min(1, n - 1)], "prompt": LONG_PROMPT}
    requests = [Request(o, seed=20 + i) for i, o in enumerate(obs)]
    noise = rng.standard_normal(case.tensor(0, "noise").shape[-2:]).astype(np.float32)  # (H, A)
    return [*requests[:-1], Request(obs[-1], noise=noise)]


@pytest.mark.parametrize("name", ["pi0_cam2", "pi05_cam1", "pi0_rel", "pi05_cam3"])
def test_each_row_equals_its_observation_alone(one_thread, name):
    batched, alone = _policies(name)
    for n in (2, 3, 4):
        requests = _requests(name, n)
        outs = batched.infer_batch(requests)
        for r, out in zip(requests, outs):
            want = alone.infer(r.obs, noise=r.noise, seed=r.seed)["actions"]
            assert out["actions"].shape == want.shape and out["actions"].dtype == np.float32
            assert np.abs(out["actions"] - want).max() <= ATOL, (n, r.seed)
            assert (out["rows"], out["batch"]) == (n, 4 if n > 2 else 2)
    assert batched.frontend.report()["batch_replays"] == {1: 0, 2: 1, 4: 2}


def test_rows_do_not_see_each_other(one_thread):
    """Row 0's actions depend on row 0 only: at one (batch, prompt) bucket they are the same bits
    whatever the other rows hold (other observations and noise, stale rows of an earlier batch left in
    a padded bucket); across batch buckets they agree within float rounding."""
    batched, _ = _policies("pi0_cam2")
    case = E2E.case("pi0_cam2")
    first = Request(case.obs(0), seed=3)
    got = {}
    short = [case.obs(0), case.obs(2)]  # prompts of the same (smallest) bucket as row 0's
    for k, (others, stale) in enumerate([(short[1:], None), (short[:1], None), (short, 1), (short[::-1], 2)]):
        if stale is not None:  # row 3 of the batch-4 bucket left from another batch
            batched.infer_batch([Request(case.obs(stale), seed=40 + i) for i in range(4)])
        outs = batched.infer_batch([first, *(Request(o, seed=50 + k + i) for i, o in enumerate(others))])
        got[k] = outs[0]["actions"]
        assert outs[0]["batch"] == (2 if len(others) == 1 else 4)
    assert np.array_equal(got[0], got[1]) and np.array_equal(got[2], got[3])
    assert np.abs(got[0] - got[2]).max() <= ATOL


def test_a_group_of_one_is_infer_exactly(one_thread):
    batched, alone = _policies("pi05_cam1")
    obs = E2E.case("pi05_cam1").obs(0)
    (out,) = batched.infer_batch([Request(obs, seed=7)])
    assert np.array_equal(out["actions"], alone.infer(obs, seed=7)["actions"]) and out["batch"] == 1
    assert np.array_equal(batched.infer(obs, seed=7)["actions"], out["actions"])


def test_every_bucket_is_captured_at_load_and_never_again(one_thread):
    batched, _ = _policies("pi0_cam2", batches=(2, 4))
    report = batched.frontend.report()
    assert report["batches"] == [1, 2, 4]
    captured = report["batch_captured"]
    assert captured == {n: list(batched.buckets) for n in (1, 2, 4)}
    for n in (1, 2, 3, 4, 5, 7):
        batched.infer_batch(_requests("pi0_cam2", n))
    after = batched.frontend.report()
    assert after["batch_captured"] == captured and after["batch_capture_s"] == report["batch_capture_s"]
    assert after["captured_on_miss"] == [] and after["fallbacks"]["total"] == 0
    # groups of at most 4: 1 | 2 | 3 | 4 | 4 + 1 | 4 + 3, each at the smallest batch bucket holding it
    assert after["batch_replays"] == {1: 2, 2: 1, 4: 5}


def test_trace_records_the_batched_step_and_equals_eager():
    """The batched step holds no host sync or data-dependent shape (the trace backend records it) and its
    replays equal eager runs bit for bit."""
    case = E2E.case("pi0_cam2")
    from flashrt.frontends.pi0.checkpoint import load_checkpoint

    ck = load_checkpoint(case.policy_dir, tokenizer=E2E.TOKENIZER)
    model = load_pi0(ck.model_config, ck.weights)
    fronts = [Pi0Frontend(model, 2, (16,), backend=b, batches=(2,)) for b in ("trace", "eager")]
    g = torch.Generator().manual_seed(0)
    values = {n: torch.rand(fronts[0].buffers[n].shape, generator=g)
              for n in ("vision_images", "expert_state")}
    for front in fronts:
        front.capture()
        b = front.buffers
        b["vision_images"].copy_(values["vision_images"] * 2 - 1)
        b["vision_masks"].fill_(True)
        b["prefix_tokens"].copy_(torch.arange(b["prefix_tokens"].numel()).view_as(b["prefix_tokens"]) % 50)
        b["prefix_token_masks"].copy_(torch.arange(16)[None] < torch.tensor([[5], [16]]))
        b["expert_state"].copy_(values["expert_state"])
        front.write_noise_rows([(None, 1), (None, 2)])
        front.run(16, 2)
    assert torch.equal(fronts[0].buffers["expert_actions"], fronts[1].buffers["expert_actions"])
    assert not torch.equal(fronts[0].actions(0), fronts[0].actions(1))


def test_batch_settings_are_checked():
    assert batch_buckets(None) == (1,) and batch_buckets((4, 2)) == (1, 2, 4)
    for bad in ((0,), (2.0,), (True,), (65,)):
        with pytest.raises(ConfigError, match="batch buckets"):
            batch_buckets(bad)
    case = E2E.case("pi0_cam1")
    with pytest.raises(ConfigError, match="batch buckets"):
        load_policy(case.policy_dir, tokenizer=E2E.TOKENIZER, batches=(0, 2))
    front = load_policy(case.policy_dir, tokenizer=E2E.TOKENIZER, batches=(2,)).frontend
    with pytest.raises(InputError, match="batch buckets"):
        front.batch_for(3)
