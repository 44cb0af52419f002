"""`seed=` gives the same noise on every device: each family that draws flow-matching noise draws a seeded
call on a CPU generator (torch.randn(shape, generator=torch.Generator().manual_seed(seed))) and copies it
into its static noise buffer. On the CPU here; the same check on a GPU (pytest -m cuda)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import pi0_e2e

from flashrt.frontends.groot import family as groot
from flashrt.runner.policy import load_policy

GROOT = Path(__file__).resolve().parents[1] / "fixtures" / "groot"
SEEDS = (0, 7, 2**40 + 3)


def _pi0(device: str):
    return load_policy(pi0_e2e.case("pi05_cam2").policy_dir, device=device, tokenizer=pi0_e2e.TOKENIZER,
                       backend="eager").frontend


def _groot(device: str):
    meta = json.loads((GROOT / "n17_io.json").read_text())["one_cam"]
    return groot.load(GROOT / "n17_tiny", device=device, backend="eager", embodiment=meta["embodiment"],
                      cameras=meta["cameras"])


def _obs_pi0(frontend):
    return pi0_e2e.case("pi05_cam2").obs(0)


def _obs_groot(frontend):
    from safetensors.torch import load_file

    io, meta = load_file(str(GROOT / "n17_io.safetensors")), json.loads((GROOT / "n17_io.json").read_text())
    m = meta["one_cam"]
    return {"images": {c: io[f"one_cam/image.{c}"].numpy() for c in m["cameras"]},
            "state": io["one_cam/state"].numpy(), "prompt": m["prompt"]}


FAMILIES = {"pi0": (_pi0, _obs_pi0), "groot": (_groot, _obs_groot)}


def _check_seeded_noise(family: str, device: str) -> None:
    load, obs = FAMILIES[family]
    frontend = load(device)
    bucket, checked = frontend.check(obs(frontend))
    target = frontend.buffers["expert_noise"]
    for seed in SEEDS:
        frontend.write(bucket, checked, seed)
        want = torch.randn(target.shape, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(target.cpu(), want), (family, device, seed)
    frontend.write(bucket, checked)  # no seed: the frontend's own generator, not a fixed draw
    assert not torch.equal(target.cpu(), want)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_seeded_noise_is_a_cpu_draw(family, one_thread):
    _check_seeded_noise(family, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_seeded_noise_is_the_cpu_draw_on_a_gpu(family):
    _check_seeded_noise(family, "cuda")
