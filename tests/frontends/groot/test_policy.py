"""GR00T through the generic runner: `flashrt.load_policy(folder)` detects the family; infer, step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

import flashrt

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "groot"
IO = load_file(str(FIX / "n17_io.safetensors"))
META = json.loads((FIX / "n17_io.json").read_text())


def test_load_policy_infer_matches_lerobot_and_steps(one_thread):
    case = "emb_b"
    m = META[case]
    policy = flashrt.load_policy(FIX / "n17_tiny", embodiment=m["embodiment"], cameras=m["cameras"])
    obs = {"observation.images." + c: IO[f"{case}/image.{c}"].numpy() for c in m["cameras"]}
    obs.update({"observation.state": IO[f"{case}/state"].numpy(), "task": m["prompt"]})
    out = policy.infer(obs, noise=IO[f"{case}/noise"].numpy())
    assert np.abs(out["actions"] - IO[f"{case}/actions"].numpy()).max() <= 1e-4
    assert policy.info()["family"] == "groot"
    chunk = policy.infer(obs, seed=5)["actions"]
    policy.reset()
    steps = [policy.step(obs, seed=5) for _ in range(policy.n_action_steps)]
    assert np.array_equal(np.stack(steps), chunk[: policy.n_action_steps])
