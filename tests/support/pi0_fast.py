"""Readers of the Pi0-FAST fixtures (tests/fixtures/pi0_fast, made by gen_pi0_fast.py)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "pi0_fast"
TOKENIZER = ROOT / "tokenizer.model"


@cache
def case(name: str) -> tuple[dict, dict]:
    """(io.json, io.safetensors tensors) of a case ("cam1", "cam2")."""
    return json.loads((ROOT / name / "io.json").read_text()), load_file(str(ROOT / name / "io.safetensors"))


def observation(name: str, i: int) -> dict:
    """Observation i of a case, openpi style (raw uint8 images, raw state, prompt)."""
    info, io = case(name)
    o = info["observations"][i]
    return {"images": {c: io[f"obs{i}.image.{c}"].numpy() for c in o["cameras"]},
            "state": io[f"obs{i}.state"].numpy(), "prompt": o["prompt"]}


def reference_tokens(name: str, i: int, end: int) -> list[int]:
    """lerobot's greedy ids up to (not including) the first end marker."""
    ids = case(name)[1][f"obs{i}.greedy"].tolist()
    return ids[: ids.index(end)] if end in ids else ids
