"""`Policy.infer_batch`: each request checked on its own (a bad one answered with its own error, the
good ones still batched and exact), a non-finite row failing only its request, more requests than the
largest bucket split into groups, and families that cannot batch saying why and answering one by one."""

from __future__ import annotations

import numpy as np
import pytest
from support import pi0_e2e as E2E
from support import pi0_fast

from flashrt.errors import ConfigError, InputError, NumericalError
from flashrt.runner.policy import Request, batch_ladder, load_policy

CASE = "pi0_cam2"


def _policy(batches=(1, 2, 4)):
    return load_policy(E2E.case(CASE).policy_dir, tokenizer=E2E.TOKENIZER, batches=batches)


def test_a_bad_request_among_good_ones_gets_its_own_error(one_thread):
    batched, alone, case = _policy(), _policy(None), E2E.case(CASE)
    requests = [Request(case.obs(0), seed=1),
                Request({**case.obs(1), "state": np.full(2, np.nan, np.float32)}, seed=2),
                Request(case.obs(2), seed=3),
                Request(case.obs(1), seed=-1),
                Request({**case.obs(0), "images": {"nope": np.zeros((4, 4, 3), np.uint8)}}),
                Request(case.obs(1), seed=4)]
    outs = batched.infer_batch(requests)
    for k in (1, 3, 4):
        assert isinstance(outs[k], InputError), outs[k]
    assert "state" in str(outs[1]) and "seed" in str(outs[3]) and "camera" in str(outs[4])
    for k in (0, 2, 5):
        want = alone.infer(requests[k].obs, seed=requests[k].seed)["actions"]
        assert np.abs(outs[k]["actions"] - want).max() <= 1e-5
        assert (outs[k]["rows"], outs[k]["batch"]) == (3, 4)  # the three good ones shared one replay
    assert batched.frontend.report()["batch_replays"] == {1: 0, 2: 0, 4: 1}


def test_a_non_finite_row_fails_only_its_request(one_thread, monkeypatch):
    batched, case = _policy(), E2E.case(CASE)
    read_rows = batched.frontend.read_rows

    def one_broken(rows):
        out = read_rows(rows)
        out[1] = np.full_like(out[1], np.nan)
        return out

    monkeypatch.setattr(batched.frontend, "read_rows", one_broken)
    outs = batched.infer_batch([Request(case.obs(i), seed=i) for i in range(3)])
    assert isinstance(outs[1], NumericalError)
    assert all(isinstance(outs[k], dict) and np.isfinite(outs[k]["actions"]).all() for k in (0, 2))


def test_more_requests_than_the_largest_bucket_run_in_groups(one_thread):
    batched, alone, case = _policy((1, 2)), _policy(None), E2E.case(CASE)
    requests = [Request(case.obs(i % 3), seed=i) for i in range(5)]
    outs = batched.infer_batch(requests)
    assert [(o["rows"], o["batch"]) for o in outs] == [(2, 2), (2, 2), (2, 2), (2, 2), (1, 1)]
    for r, out in zip(requests, outs):
        assert np.abs(out["actions"] - alone.infer(r.obs, seed=r.seed)["actions"]).max() <= 1e-5
    assert set(outs[0]["timing"]) == {"preprocess_ms", "replay_ms", "postprocess_ms", "total_ms"}


def test_a_policy_loaded_without_batches_says_so_and_answers_one_by_one(one_thread):
    pol, case = _policy(None), E2E.case(CASE)
    assert pol.batches == (1,) and "batch bucket 1 only" in pol.cannot_batch
    assert pol.info()["cannot_batch"] == pol.cannot_batch and pol.info()["batches"] == [1]
    assert _policy().cannot_batch == "" and _policy().max_batch == 4
    outs = pol.infer_batch([Request(case.obs(i), seed=i) for i in range(3)])
    for i, out in enumerate(outs):
        assert out["batch"] == 1 and np.array_equal(out["actions"], pol.infer(case.obs(i), seed=i)["actions"])


def test_a_family_that_cannot_batch_says_why_and_refuses_batches(one_thread):
    folder = pi0_fast.ROOT / "cam1" / "policy"
    with pytest.raises(ConfigError, match="pi0_fast policies cannot batch"):
        load_policy(folder, tokenizer=pi0_fast.TOKENIZER, batches=(1, 2))
    pol = load_policy(folder, tokenizer=pi0_fast.TOKENIZER, batches=(1,))
    assert pol.batches == (1,) and "autoregressively" in pol.cannot_batch
    assert pol.frontend.describe()["cannot_batch"] == pol.cannot_batch
    obs = [pi0_fast.observation("cam1", i) for i in range(2)]
    outs = pol.infer_batch([Request(o) for o in obs])
    for o, out in zip(obs, outs):
        assert out["batch"] == 1 and np.array_equal(out["actions"], pol.infer(o)["actions"])


def test_groot_says_it_cannot_batch():
    from flashrt.frontends.groot.common.frontend import GrootFrontend

    assert GrootFrontend.batches == (1,) and "no batch dimension" in GrootFrontend.cannot_batch


def test_batch_ladder():
    assert batch_ladder(1) == (1,) and batch_ladder(4) == (1, 2, 4) and batch_ladder(6) == (1, 2, 4, 6)
    assert batch_ladder(8) == (1, 2, 4, 8)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError):
            batch_ladder(bad)
