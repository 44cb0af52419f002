"""GR00T N1.5 as a lerobot policy folder, written from the committed fixtures (tests/fixtures/groot)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import load_file, save_file

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "groot"


def make_policy(root: Path) -> Path:
    """n15_policy + model.safetensors = n15_tiny's weights under `_groot_model.` (what
    GrootPolicy.save_pretrained stores; written here to keep the committed fixture small)."""
    shutil.copytree(FIX / "n15_tiny", root / "n15_tiny")
    policy = root / "n15_policy"
    shutil.copytree(FIX / "n15_policy", policy)
    weights = load_file(str(FIX / "n15_tiny" / "model.safetensors"))
    save_file({f"_groot_model.{k}": v for k, v in weights.items()}, str(policy / "model.safetensors"))
    return policy


def fixture_obs(io: dict[str, Any], meta: dict[str, Any], case: str) -> dict:
    """The raw observation of fixture ``case``: its cameras' frames, the state and the prompt."""
    m = meta[case]
    return {
        "images": {c: io[f"{case}/image.{c}"].numpy() for c in m["cameras"]},
        "state": io[f"{case}/state"].numpy(),
        "prompt": m["prompt"],
    }


def infer(frontend: Any, obs: dict, noise: Any = None, seed: int | None = None) -> np.ndarray:
    """One frontend call through its verbs: check, write, replay, read."""
    bucket, checked = frontend.check(obs, noise)
    frontend.write(bucket, checked, seed)
    frontend.replay(bucket)
    return frontend.read(checked)


TRACE_PROMPTS = ("open the drawer", "a much longer prompt that lands in the next bucket ok")


def assert_trace_replays_eager(trace: Any, eager: Any, obs: dict) -> None:
    """The trace-backend frontend equals the eager one bit for bit on two prompts in two buckets (whose
    image tokens sit at different positions)."""
    buckets = set()
    for seed, prompt in enumerate(TRACE_PROMPTS):
        buckets.add(trace.check(dict(obs, prompt=prompt))[0])
        got = [infer(f, dict(obs, prompt=prompt), seed=seed) for f in (trace, eager)]
        assert np.array_equal(got[0], got[1]), (seed, prompt)
    assert trace.report()["backend"] == "trace" and len(buckets) == 2
