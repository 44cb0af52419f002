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


def test_lerobot_policy_folder_matches_predict_action_chunk(one_thread):
    """A `GrootPolicy.save_pretrained` folder (its own fine-tuned weights, base_model_path -> the raw
    N1.7 folder for architecture and sidecars, embodiment_tag from its config) vs lerobot's
    `predict_action_chunk` + action decode (tests/fixtures/gen/gen_groot_n17_policy.py)."""
    io = load_file(str(FIX / "n17_policy_io.safetensors"))
    meta = json.loads((FIX / "n17_policy_io.json").read_text())
    policy = flashrt.load_policy(FIX / "n17_policy")
    assert policy.info()["embodiment"] == meta["embodiment"]
    obs = {
        "images": {c: io[f"policy/image.{c}"].numpy() for c in ("front", "wrist")},
        "state": io["policy/state"].numpy(),
        "prompt": meta["prompt"],
    }
    out = policy.infer(obs, noise=io["policy/noise"].numpy())
    assert np.abs(out["actions"] - io["policy/actions"].numpy()).max() <= 1e-4
    base = flashrt.load_policy(FIX / "n17_tiny", embodiment="tag_a").infer(
        obs, noise=io["policy/noise"].numpy()
    )
    assert np.abs(base["actions"] - out["actions"]).max() > 1e-3  # the policy's own weights were read
