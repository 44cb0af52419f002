"""Host work of one Pi0 / Pi0.5 `Policy.infer()` outside the replay: a small, pinned number of tensor
allocations, the same for a tiny and a larger model (`flashrt.profile.alloc`); the staging that gets it
there changes no action (layouts alternating, a fresh policy, seed == the CPU draw as noise); on a GPU:
none of them on the device, no CUDA event made per call, pinned staging."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from flashrt.bench.adapters.pi0 import OBS_KEYS, TOKENIZER_MAX, observations
from flashrt.profile.alloc import count_allocations, count_infer_allocations
from flashrt.runner.policy import load_policy
from flashrt.testing.synthetic.pi0 import TINY, SyntheticSizes, SyntheticSpec, write_checkpoint

LARGER = SyntheticSizes(vision_width=64, vision_depth=3, vision_mlp=128, image_size=112, vlm_width=128,
                        vlm_mlp=256, expert_width=64, expert_mlp=128, depth=3, head_dim=32, chunk_size=16,
                        n_action_steps=8, num_steps=3)
SIZES = {"tiny": (TINY, (48, 64)), "larger": (LARGER, (96, 160))}  # model sizes, raw frame (rows, cols)

# Tensors one infer() allocates outside the replay, 2 cameras of uint8 frames. Every one of them:
#   2  the frames wrapped as tensors (torch.from_numpy: no copy, counted as lift_fresh)
#   3  the state wrapped (1) and checked finite (aminmax: 2)
#   2  Pi0 state normalization (MEAN_STD: x - mean, / (std + eps)); Pi0.5 4 (QUANTILES: -, *, /, -)
#   2  Pi0 only: the normalized state checked finite (it is an input of its own; Pi0.5 discretizes it)
#   2  un-normalization (MEAN_STD: *, +); Pi0.5 4; its last output is the array returned to the caller
#   3  noise given as an array: wrapped (1) and checked finite (2); seed=: drawn into staging (0)
# Frames, tokens, mask, state and noise go through staging written in place; actions come back
# through the buffer (CPU) or its pinned twin (CUDA).
PINNED = {("pi0", "array"): 14, ("pi0", "seed"): 11, ("pi05", "array"): 16, ("pi05", "seed"): 13}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, one_thread):
    out = {}
    for variant in ("pi0", "pi05"):
        for size, (sizes, _) in SIZES.items():
            spec = SyntheticSpec(variant, replace(sizes, max_tokens=TOKENIZER_MAX[variant]), ("top", "wrist"))
            out[variant, size] = write_checkpoint(tmp_path_factory.mktemp(f"{variant}-{size}"), spec)
    return out


def _obs(policy, size: str, seed: int = 1) -> tuple[dict, np.ndarray]:
    o = observations(policy.frontend, 1, seed=seed, frame=SIZES[size][1])[0]
    return {k: o[k] for k in OBS_KEYS}, o["noise"]


def _kwargs(mode: str, noise: np.ndarray) -> dict:
    return {"noise": noise} if mode == "array" else {"seed": 3}


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
@pytest.mark.parametrize("mode", ["array", "seed"])
def test_allocations_per_infer_are_a_pinned_constant_whatever_the_model_size(folders, variant, mode):
    counts = {}
    for size in SIZES:
        pol = load_policy(folders[variant, size], backend="eager")
        obs, noise = _obs(pol, size)
        count = count_infer_allocations(pol, obs, calls=3, **_kwargs(mode, noise))
        assert count.constant is not None, (size, count.per_call)
        counts[size] = count.constant
        assert set(count.by_device) == {"cpu"}
    assert counts == {"tiny": PINNED[variant, mode], "larger": PINNED[variant, mode]}, counts


def test_the_replay_is_what_the_pause_leaves_out(folders):
    """The same call counted with the step included: the eager step allocates hundreds of tensors, so a
    counter that failed to pause it could not pass the pinned figures above."""
    pol = load_policy(folders["pi0", "tiny"], backend="eager")
    obs, noise = _obs(pol, "tiny")
    pol.infer(obs, noise=noise)
    whole = count_allocations(lambda counter: pol.infer(obs, noise=noise)).allocations
    assert whole > 10 * PINNED["pi0", "array"]


def _float_frames(obs: dict) -> dict:
    frames = {c: torch.from_numpy(v).permute(2, 0, 1).float() / 255 for c, v in obs["images"].items()}
    return {**obs, "images": frames}


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_staging_reused_across_frame_layouts_changes_no_action(folders, variant):
    """Frames of three layouts (uint8 H x W x 3 at two sizes, float 3 x H x W) through one policy, back
    and forth, and one camera missing: each call gives the fresh policy's actions bit for bit."""
    pol = load_policy(folders[variant, "tiny"], backend="eager")
    a, noise = _obs(pol, "tiny", seed=1)
    b, _ = _obs(pol, "larger", seed=2)  # another raw frame size into the same model
    c = _float_frames(a)
    d = {**a, "images": {"top": a["images"]["top"]}}
    calls = [a, b, c, a, d, b, a]
    got = [pol.infer(o, noise=noise)["actions"] for o in calls]
    for o, actions in zip(calls, got, strict=True):
        fresh = load_policy(folders[variant, "tiny"], backend="eager")
        assert np.array_equal(fresh.infer(o, noise=noise)["actions"], actions)
    assert np.array_equal(got[0], got[3]) and np.array_equal(got[0], got[6])
    assert not np.array_equal(got[0], got[1])


def test_seed_is_the_cpu_draw_given_as_noise(folders):
    pol = load_policy(folders["pi05", "tiny"], backend="eager")
    obs, _ = _obs(pol, "tiny")
    shape = pol.frontend.buffers["expert_noise"].shape
    drawn = torch.randn(shape, generator=torch.Generator().manual_seed(11)).numpy()
    assert np.array_equal(pol.infer(obs, seed=11)["actions"], pol.infer(obs, noise=drawn)["actions"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_on_a_gpu_nothing_is_allocated_on_the_device_and_no_event_is_made(folders, variant, monkeypatch):
    pol = load_policy(folders[variant, "tiny"], device="cuda")  # CUDA graphs
    obs, noise = _obs(pol, "tiny")
    count = count_infer_allocations(pol, obs, calls=3, noise=noise)
    assert count.per_call == [PINNED[variant, "array"]] * 3 and set(count.by_device) == {"cpu"}
    made = []

    class CountingEvent(torch.cuda.Event):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "Event", CountingEvent)
    for seed in range(5):
        pol.infer(obs, seed=seed)
    assert not made
    staging = pol.frontend.buffers._staging.values()
    assert staging and all(t.is_pinned() for t in staging)
    eager = load_policy(folders[variant, "tiny"], device="cuda", backend="eager")
    assert np.allclose(pol.infer(obs, noise=noise)["actions"], eager.infer(obs, noise=noise)["actions"],
                       atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_staged_inputs_equal_the_cpu_ones_call_after_call(folders):
    """Back-to-back writes of different observations (two cameras of one layout, so a shared host twin
    would be overwritten before its asynchronous copy ran): every static input equals the CPU's."""
    gpu, cpu = (load_policy(folders["pi0", "tiny"], device=d).frontend for d in ("cuda", "cpu"))
    names = ("vision_images", "vision_masks", "prefix_tokens", "prefix_token_masks", "expert_state",
             "expert_noise")
    for i, o in enumerate(observations(cpu, 6, seed=5, frame=SIZES["tiny"][1])):
        obs = {k: o[k] for k in OBS_KEYS}
        for f in (gpu, cpu):
            bucket, checked = f.check(obs, o["noise"] if i % 2 else None)
            f.write(bucket, checked, seed=i)
        for name in names:
            got, want = gpu.buffers[name].cpu(), cpu.buffers[name]
            assert torch.allclose(got.float(), want.float(), atol=1e-6, rtol=0), (i, name)
