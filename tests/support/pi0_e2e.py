"""Readers of the Pi0 / Pi0.5 end-to-end fixtures (tests/fixtures/pi0_e2e, made by gen_pi0_e2e.py).

Test support for a source checkout: the fixtures live in the repository's tests/ folder, which is not
part of the wheel.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "pi0_e2e"
TOKENIZER = ROOT / "tokenizer.model"
CASES = ("pi0_cam1", "pi0_cam2", "pi0_cam3", "pi05_cam1", "pi05_cam2", "pi05_cam3", "pi0_rel", "pi05_rel")


@dataclass(frozen=True)
class Case:
    name: str
    info: dict
    io: dict

    @property
    def policy_dir(self) -> Path:
        return ROOT / self.name / "policy"

    @property
    def observations(self) -> range:
        return range(len(self.info["observations"]))

    def prompt(self, i: int) -> str:
        return self.info["observations"][i]["prompt"]

    def cameras(self, i: int) -> list[str]:
        return self.info["observations"][i]["cameras"]

    def images(self, i: int) -> dict:
        return {c: self.io[f"obs{i}.image.{c}"].numpy() for c in self.cameras(i)}

    def obs(self, i: int, style: str = "openpi") -> dict:
        state = self.io[f"obs{i}.state"].numpy()
        if style == "openpi":
            return {"images": self.images(i), "state": state, "prompt": self.prompt(i)}
        obs = {f"observation.images.{c}": img for c, img in self.images(i).items()}
        return {**obs, "observation.state": state, "task": self.prompt(i)}

    def tensor(self, i: int, name: str) -> torch.Tensor:
        return self.io[f"obs{i}.{name}"]


@cache
def case(name: str) -> Case:
    info = json.loads((ROOT / name / "io.json").read_text())
    return Case(name, info, load_file(str(ROOT / name / "io.safetensors")))


def to_openpi(case: Case, out: Path, asset_id: str = "robot") -> Path:
    """Write the same checkpoint in the openpi PyTorch layout: keys without "model.", config.json with
    action_dim / action_horizon, assets/<asset_id>/norm_stats.json with the lerobot statistics."""
    out.mkdir(parents=True, exist_ok=True)
    weights = load_file(str(case.policy_dir / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in weights.items()}, str(out / "model.safetensors"))
    config = json.loads((case.policy_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({
        "action_dim": config["max_action_dim"], "action_horizon": config["chunk_size"],
        "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m", "precision": "float32"}))
    (state_file,) = case.policy_dir.glob("policy_preprocessor_step_*_normalizer_processor.safetensors")
    pre = load_file(str(state_file))
    table = {}
    for key, name in (("observation.state", "state"), ("action", "actions")):
        table[name] = {s: pre[f"{key}.{s}"].tolist() for s in ("mean", "std", "q01", "q99")}
    (out / "assets" / asset_id).mkdir(parents=True, exist_ok=True)
    (out / "assets" / asset_id / "norm_stats.json").write_text(json.dumps({"norm_stats": table}))
    return out


def copy_policy(case: Case, out: Path) -> Path:
    shutil.copytree(case.policy_dir, out)
    return out
