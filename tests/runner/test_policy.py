"""Policy runner, end to end against lerobot 0.6.1 (PI0Policy / PI05Policy with their pre- and post-
processor pipelines, fixtures from tests/fixtures/gen/gen_pi0_e2e.py): raw observation in, un-normalized
actions out. Also: both observation spellings, the openpi layout of the same checkpoint, the trace
backend, step / replan / reset, and bad inputs followed by a good call."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
import torch
from support import pi0_e2e

from flashrt.errors import CheckpointError, ConfigError, InputError
from flashrt.frontends.pi0.observation import split_observation
from flashrt.runner.policy import Policy, load_policy

TOL = 1e-4


E2E = pi0_e2e


@cache
def policy(name: str, backend: str = "eager") -> Policy:
    return load_policy(E2E.case(name).policy_dir, tokenizer=E2E.TOKENIZER, backend=backend)


def _max_err(out: dict, case, i: int) -> float:
    assert out["actions"].dtype == np.float32
    assert out["actions"].shape == (case.info["chunk_size"], case.info["action_dim"])
    return float(np.abs(out["actions"] - case.tensor(i, "actions").numpy()).max())


@pytest.mark.parametrize("name", E2E.CASES)
def test_end_to_end_parity_with_lerobot(name):
    """1, 2 and 3 cameras (one left out), resized images, padded prompts, Pi0.5's discretized state."""
    case, pol = E2E.case(name), policy(name)
    for i in case.observations:
        noise = case.tensor(i, "noise").numpy()
        out = pol.infer(case.obs(i, "openpi"), noise=noise)
        assert _max_err(out, case, i) <= TOL, (name, i)
        again = pol.infer(case.obs(i, "lerobot"), noise=noise[0])  # lerobot keys, (chunk, A) noise
        assert np.array_equal(again["actions"], out["actions"])
        assert set(out["timing"]) == {"preprocess_ms", "replay_ms", "postprocess_ms", "total_ms"}
        assert all(v >= 0 for v in out["timing"].values())


def test_float_images_equal_uint8():
    case, pol = E2E.case("pi0_cam2"), policy("pi0_cam2")
    obs = case.obs(0)
    obs["images"] = {c: np.ascontiguousarray(img.transpose(2, 0, 1)).astype(np.float32) / np.float32(255)
                     for c, img in obs["images"].items()}
    out = pol.infer(obs, noise=case.tensor(0, "noise").numpy())
    assert _max_err(out, case, 0) <= TOL


@pytest.mark.parametrize(("name", "obs_ids"), [("pi0_cam1", (0, 2)), ("pi0_cam3", (0, 2)),
                                               ("pi05_cam3", (0, 1, 2))])
def test_openpi_layout_gives_the_same_actions(tmp_path, name, obs_ids):
    """The same weights and statistics saved in the openpi PyTorch layout: three fixed camera slots
    (unused ones masked), openpi's epsilon, openpi's prompt cleaning (prompts chosen so that Pi0's
    lerobot and openpi token ids agree)."""
    case = E2E.case(name)
    folder = E2E.to_openpi(case, tmp_path / "openpi")
    pol = load_policy(folder, tokenizer=E2E.TOKENIZER, num_steps=case.info["num_steps"])
    assert pol.checkpoint.layout == "openpi"
    slots = dict(zip(case.info["cameras"], pol.cameras, strict=False))
    for i in obs_ids:
        obs = case.obs(i)
        obs["images"] = {slots[c]: img for c, img in obs["images"].items()}
        out = pol.infer(obs, noise=case.tensor(i, "noise").numpy())
        assert _max_err(out, case, i) <= TOL, (name, i)


def test_trace_backend_equals_eager_bit_for_bit():
    case = E2E.case("pi05_cam3")
    traced, eager = policy("pi05_cam3", "trace"), policy("pi05_cam3")
    assert traced.frontend.report()["backend"] == "trace"
    for i in case.observations:
        a = traced.infer(case.obs(i), seed=i)["actions"]
        b = eager.infer(case.obs(i), seed=i)["actions"]
        assert np.array_equal(a, b)


def test_seed_and_steps():
    case = E2E.case("pi0_cam1")
    pol = policy("pi0_cam1")
    a, b = pol.infer(case.obs(0), seed=3)["actions"], pol.infer(case.obs(0), seed=3)["actions"]
    assert np.array_equal(a, b)
    assert not np.array_equal(a, pol.infer(case.obs(0), seed=4)["actions"])
    more = load_policy(case.policy_dir, tokenizer=E2E.TOKENIZER, num_steps=6)
    assert more.config.num_steps == 6
    assert np.abs(more.infer(case.obs(0), seed=3)["actions"] - a).max() > 1e-3


def test_step_replans_after_n_action_steps_and_reset():
    case = E2E.case("pi05_cam2")
    pol = load_policy(case.policy_dir, tokenizer=E2E.TOKENIZER)
    n = pol.n_action_steps
    assert n == case.info["n_action_steps"] < pol.chunk_size
    chunk = pol.infer(case.obs(0), seed=11)["actions"]
    calls = []
    real_replay = pol.frontend.replay
    pol.frontend.replay = lambda bucket: calls.append(bucket) or real_replay(bucket)
    got = [pol.step(case.obs(0), seed=11) for _ in range(n)]
    assert len(calls) == 1 and pol.queued == 0
    assert all(np.array_equal(g, chunk[k]) for k, g in enumerate(got))
    pol.step(case.obs(1), seed=12)
    assert len(calls) == 2 and pol.queued == n - 1
    pol.reset()
    assert pol.queued == 0
    first = pol.step(case.obs(0), seed=11)
    assert len(calls) == 3 and np.array_equal(first, chunk[0])
    with pytest.raises(ConfigError, match="n_action_steps"):
        load_policy(case.policy_dir, tokenizer=E2E.TOKENIZER, n_action_steps=pol.chunk_size + 1)


def _bad_inputs(case) -> dict:
    good = case.obs(0)
    img = next(iter(good["images"].values()))
    cam = next(iter(good["images"]))
    state = good["state"]
    return {
        "four channels": {**good, "images": {cam: np.zeros((20, 20, 4), np.uint8)}},
        "grey image": {**good, "images": {cam: img[..., 0]}},
        "int32 image": {**good, "images": {cam: img.astype(np.int32)}},
        "float image 0..255": {**good, "images": {cam: img.astype(np.float32)}},
        "unknown camera": {**good, "images": {**good["images"], "belly": img}},
        "no camera": {**good, "images": {}},
        "nan state": {**good, "state": np.full_like(state, np.nan)},
        "inf state": {**good, "state": np.where(np.arange(state.size) == 1, np.inf, state)},
        "int state": {**good, "state": np.zeros(state.shape, np.int64)},
        "short state": {**good, "state": state[:-1]},
        "long prompt": {**good, "prompt": "pick up the cube " * 40},
        "bytes prompt": {**good, "prompt": b"pick up"},
        "no prompt": {k: v for k, v in good.items() if k != "prompt"},
        "no state": {k: v for k, v in good.items() if k != "state"},
        "not a dict": [good],
    }


@pytest.mark.parametrize("name", ["pi0_cam2", "pi05_cam2"])
def test_bad_inputs_then_a_good_call(name):
    case, pol = E2E.case(name), policy(name)
    noise = case.tensor(0, "noise").numpy()
    for what, obs in _bad_inputs(case).items():
        with pytest.raises(InputError):
            pol.infer(obs, noise=noise)
        assert _max_err(pol.infer(case.obs(0), noise=noise), case, 0) <= TOL, what
    for bad_noise in (noise[:, :-1], np.full_like(noise, np.nan), noise.astype(np.int64)):
        with pytest.raises(InputError, match="noise"):
            pol.infer(case.obs(1), noise=bad_noise)
        assert _max_err(pol.infer(case.obs(0), noise=noise), case, 0) <= TOL


def test_observation_spellings():
    obs = split_observation({"observation.images.top": 1, "images": {"wrist": 2}, "observation.state": 3,
                             "task": "t", "timestamp": 0.5})
    assert (obs.images, obs.state, obs.prompt) == ({"top": 1, "wrist": 2}, 3, "t")
    renamed = split_observation({"images": {"front": 1}, "state": 0, "prompt": "p"},
                                {"observation.images.front": "observation.images.top"})
    assert renamed.images == {"top": 1}
    with pytest.raises(InputError, match="given twice"):
        split_observation({"observation.images.top": 1, "images": {"top": 2}, "state": 0, "prompt": "p"})
    with pytest.raises(InputError, match="both 'state' and 'observation.state'"):
        split_observation({"images": {}, "state": 0, "observation.state": 0, "prompt": "p"})


def test_load_refusals(tmp_path):
    with pytest.raises(CheckpointError, match="google/paligemma-3b-pt-224"):
        load_policy(E2E.case("pi0_cam1").policy_dir)
    with pytest.raises(CheckpointError, match="neither a lerobot policy dir"):
        load_policy(tmp_path)
    with pytest.raises(ConfigError, match="precision"):
        load_policy(E2E.case("pi0_cam1").policy_dir, tokenizer=E2E.TOKENIZER, precision="int4")


# Measured max |Δ| vs lerobot's float32 actions over every case and observation (this CPU, torch 2.13):
# bf16 0.018, fp16 0.0021. The bounds are ~2.2x those: tight enough that fp16 run as bf16 fails.
HALF_TOL = {"bfloat16": 0.04, "float16": 0.005}


@pytest.mark.parametrize("precision", list(HALF_TOL))
@pytest.mark.parametrize("name", E2E.CASES)
def test_half_precisions_run_close_to_float32(name, precision):
    case = E2E.case(name)
    pol = load_policy(case.policy_dir, tokenizer=E2E.TOKENIZER, precision=precision)
    assert pol.info()["dtype"] == precision
    for i in case.observations:
        out = pol.infer(case.obs(i), noise=case.tensor(i, "noise").numpy())
        assert _max_err(out, case, i) <= HALF_TOL[precision], (name, i)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", ["pi0_cam3", "pi05_cam2"])
def test_cuda_graphs_end_to_end(name):
    """On a GPU: CUDA-graph replay per bucket, same actions as lerobot on the CPU (cuDNN may run the
    SigLIP patch convolution in TF32, hence the looser tolerance), and replay == eager on the GPU."""
    case = E2E.case(name)
    graphs = load_policy(case.policy_dir, device="cuda", tokenizer=E2E.TOKENIZER)
    eager = load_policy(case.policy_dir, device="cuda", tokenizer=E2E.TOKENIZER, backend="eager")
    assert graphs.frontend.report()["backend"] == "cuda"
    for i in case.observations:
        noise = case.tensor(i, "noise").numpy()
        out = graphs.infer(case.obs(i), noise=noise)
        assert _max_err(out, case, i) <= 1e-3, (name, i)
        assert np.allclose(out["actions"], eager.infer(case.obs(i), noise=noise)["actions"], atol=1e-5)


@pytest.mark.parametrize("name", ["pi0_rel", "pi05_rel"])
def test_relative_actions_mask_follows_the_checkpoint(name):
    """lerobot's use_relative_actions checkpoints (in the parity table above, which pins the sum and its
    sign): every dim relative for pi0_rel; pi05_rel keeps its "gripper" dim absolute, by name."""
    mask = policy(name).checkpoint.relative_mask
    assert mask == ((True,) * 5 if name == "pi0_rel" else (True,) * 4 + (False, True))


def test_seed_is_the_cpu_generators_draw():
    """seed=s is N(0, 1) from a CPU generator seeded with s, copied in: the same noise on any device."""
    case = E2E.case("pi05_cam1")
    pol = policy("pi05_cam1")
    shape = (1, case.info["chunk_size"], case.info["max_dim"])
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    assert np.array_equal(pol.infer(case.obs(0), seed=7)["actions"],
                          pol.infer(case.obs(0), noise=noise.numpy())["actions"])
