"""GR00T N1.5 as a lerobot policy folder, written from the committed fixtures (tests/fixtures/groot)."""

from __future__ import annotations

import shutil
from pathlib import Path

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
