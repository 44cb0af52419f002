"""A calibration-cache key and scales for the cache tests (tests/quant, tests/test_cli.py)."""

from __future__ import annotations

import dataclasses

import torch

from flashrt.quant.cache import CacheKey
from flashrt.quant.calibrate import Recipe
from flashrt.quant.precision import PrecisionSpec


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    width: int = 64
    depth: int = 2


def make_key(**overrides) -> CacheKey:
    fields = dict(data_digest="d" * 64, config=TinyConfig(), shapes={"views": 2, "chunk": 10, "steps": 10},
                  recipe=Recipe().key_fields("s" * 64), precision=PrecisionSpec.named("fp8").cache_fields(),
                  arch="sm89", model="tiny")
    fields.update(overrides)
    return CacheKey.create(**fields)


def make_scales(value: float = 0.5) -> dict[str, torch.Tensor]:
    return {"fc1": torch.tensor(value), "fc2": torch.tensor(value * 2), "w": torch.full((4,), value / 3)}
