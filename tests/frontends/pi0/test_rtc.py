"""Real-time chunking on Pi0 / Pi0.5, inside the captured step, against lerobot 0.6.1's RTC
(`RTCProcessor` through `predict_action_chunk(..., inference_delay, prev_chunk_left_over,
execution_horizon)`; fixtures from tests/fixtures/gen/gen_pi0_rtc.py)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file
from support import pi0_e2e as E2E

from flashrt.errors import ConfigError, InputError
from flashrt.runner.policy import load_policy
from flashrt.runtime.rtc import Guidance

ROOT = Path(__file__).resolve().parents[2] / "fixtures" / "pi0_rtc"
META = json.loads((ROOT / "io.json").read_text())
IO = load_file(str(ROOT / "io.safetensors"))
TOL = 1e-4
CASES = [(c, v) for c in META["cases"] for v in range(len(META["variants"]))]


@cache
def policy(name: str, backend: str = "eager"):
    return load_policy(E2E.case(name).policy_dir, tokenizer=E2E.TOKENIZER, backend=backend)


def _guidance(case: str, v: int) -> Guidance:
    p = META["variants"][v]
    return Guidance(IO[f"{case}.{v}.prev"].numpy(), p["delay"], p["horizon"], p["schedule"].lower(),
                    p["max_guidance"])


def _obs_noise(case: str, v: int) -> tuple[dict, np.ndarray]:
    i = META["variants"][v]["obs"]
    return E2E.case(case).obs(i), E2E.case(case).tensor(i, "noise").numpy()


@pytest.mark.parametrize(("case", "v"), CASES)
def test_guided_chunk_equals_lerobot_rtc(one_thread, case, v):
    obs, noise = _obs_noise(case, v)
    out = policy(case).infer(obs, noise=noise, guide=_guidance(case, v))["actions"]
    want = IO[f"{case}.{v}.actions"].numpy()
    assert np.abs(want - IO[f"{case}.{v}.unguided"].numpy()).max() > 100 * TOL  # the guidance matters
    assert np.abs(out - want).max() <= TOL, (case, v)


@pytest.mark.parametrize("case", META["cases"])
def test_frozen_prefix_is_reproduced(one_thread, case):
    """The frozen (weight-1) actions come out close to the executing ones: much closer than unguided."""
    v = 0  # delay 2, beta 10
    obs, noise = _obs_noise(case, v)
    g = _guidance(case, v)
    guided = policy(case).infer(obs, noise=noise, guide=g)["actions"][: g.delay]
    unguided = policy(case).infer(obs, noise=noise)["actions"][: g.delay]
    frozen = g.frozen[: g.delay]
    err, base = np.abs(guided - frozen).max(), np.abs(unguided - frozen).max()
    assert err < 0.1 * base, (err, base)


def test_unguided_after_guided_is_bit_identical(one_thread):
    case = "pi05_cam1"
    obs, noise = _obs_noise(case, 0)
    fresh = load_policy(E2E.case(case).policy_dir, tokenizer=E2E.TOKENIZER).infer(obs, noise=noise)["actions"]
    pol = policy(case)
    pol.infer(obs, noise=noise, guide=_guidance(case, 0))
    assert np.array_equal(pol.infer(obs, noise=noise)["actions"], fresh)
    assert np.abs(fresh - E2E.case(case).tensor(0, "actions").numpy()).max() <= TOL


def test_trace_backend_replays_the_guided_step(one_thread):
    case = "pi0_cam1"
    obs, noise = _obs_noise(case, 1)
    eager = policy(case).infer(obs, noise=noise, guide=_guidance(case, 1))["actions"]
    traced = policy(case, "trace").infer(obs, noise=noise, guide=_guidance(case, 1))["actions"]
    assert np.array_equal(eager, traced)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("frozen", np.zeros((3, 2), np.float32), "frozen actions"),
    ("frozen", np.full((2, 5), np.nan, np.float32), "finite"),
    ("frozen", np.zeros((7, 5), np.float32), "frozen actions"),
    ("delay", -1, "delay"),
    ("schedule", "cosine", "schedule"),
    ("max_guidance", 0.0, "max_guidance"),
])
def test_bad_guidance_is_refused_before_any_write(one_thread, field, value, match):
    case = "pi05_cam1"
    obs, noise = _obs_noise(case, 0)
    good = _guidance(case, 0)
    bad = Guidance(**{**good.__dict__, field: value})
    with pytest.raises(InputError, match=match):
        policy(case).infer(obs, noise=noise, guide=bad)
    want = IO[f"{case}.0.actions"].numpy()
    assert np.abs(policy(case).infer(obs, noise=noise, guide=good)["actions"] - want).max() <= TOL


def test_family_without_guidance_refuses_it():
    from flashrt.runner.policy import Policy

    class NoGuide:  # a frontend without `supports_guidance`
        chunk_size, action_dim, n_action_steps, device = 2, 1, 2, "cpu"

        def check(self, obs, noise=None):
            raise AssertionError("not reached")

    with pytest.raises(ConfigError, match="real-time chunking"):
        Policy(NoGuide()).infer({}, guide=Guidance(np.zeros((1, 1), np.float32), 1, 1))
