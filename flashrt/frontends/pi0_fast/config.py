"""Frozen configuration of Pi0-FAST: PaliGemma (SigLIP + projector + Gemma 2B + lm_head) emitting FAST
action tokens, and the sizes that come from the checkpoint's config rather than its tensors.

Sizes come from the tensors (`config_from_shapes`, reusing the Pi0 family's shape rules: 8 query heads,
SigLIP heads from the So400m head size or the Gemma head size); the decode limits come from lerobot's
config.json (`max_decoding_steps`, `fast_skip_tokens`, `chunk_size`, `n_action_steps`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.pi0.config import (
    LLM,
    PG,
    GemmaSpec,
    SiglipSpec,
    _check_sizes,
    _gemma_from_shapes,
    _need,
    _siglip_from_shapes,
)

__all__ = ["Pi0FastConfig", "PRESETS", "preset", "config_from_shapes", "IMAGE_FEATURE_NORM"]

# lerobot 0.6.1 `PI0FastPaliGemma.embed_image` computes ``features / 2048**0.5 * 2048**0.5`` whatever
# the width (a float32 rounding step, reproduced for token-exact parity).
IMAGE_FEATURE_NORM = 2048**0.5
LIMITS = {"max_decoding_steps": 4096, "fast_skip_tokens": 1 << 20}


@dataclass(frozen=True)
class Pi0FastConfig:
    """Everything that fixes the shapes of a Pi0-FAST model.

    max_decoding_steps  tokens generated per call at most (the first from the prefill)
    fast_skip_tokens    FAST id f is PaliGemma id ``vocab - 1 - fast_skip_tokens - f``
    """

    vision: SiglipSpec = field(default_factory=SiglipSpec)
    vlm: GemmaSpec = GemmaSpec(width=2048, depth=18, mlp_dim=16_384, vocab_size=257_152)
    max_decoding_steps: int = 256
    fast_skip_tokens: int = 128

    def __post_init__(self) -> None:
        if not isinstance(self.vision, SiglipSpec) or not isinstance(self.vlm, GemmaSpec):
            raise ConfigError("Pi0FastConfig needs a SiglipSpec vision and a GemmaSpec vlm")
        if self.vlm.vocab_size <= 0:
            raise ConfigError("Pi0-FAST needs a vocabulary (vlm.vocab_size > 0)")
        for name, limit in LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
                raise ConfigError(f"Pi0FastConfig.{name} must be an int in 1..{limit}, got {value!r}")
        if self.fast_skip_tokens >= self.vlm.vocab_size:
            raise ConfigError(f"fast_skip_tokens {self.fast_skip_tokens} leaves no FAST ids in a "
                              f"{self.vlm.vocab_size}-token vocabulary")

    def replace(self, **changes) -> Pi0FastConfig:
        return replace(self, **changes)


PRESETS: dict[str, Pi0FastConfig] = {
    "pi0_fast": Pi0FastConfig(),
    "pi0_fast-tiny": Pi0FastConfig(
        vision=SiglipSpec(width=32, depth=2, mlp_dim=64, num_heads=2, patch=14, image_size=28),
        vlm=GemmaSpec(width=64, depth=2, mlp_dim=128, head_dim=16, vocab_size=1024), max_decoding_steps=24),
}


def preset(name: str, **overrides) -> Pi0FastConfig:
    """A named configuration ("pi0_fast", "pi0_fast-tiny"), optionally with overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown Pi0-FAST preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)


def config_from_shapes(shapes: Mapping[str, tuple[int, ...]], **overrides) -> Pi0FastConfig:
    """Sizes from the tensor shapes (keys with or without lerobot's ``model.``), the rest from
    ``overrides`` (max_decoding_steps, fast_skip_tokens). The vocabulary is the lm_head's rows (the
    logits' size), which must equal the embedding's when both are stored."""
    flat = {k.removeprefix("model."): tuple(v) for k, v in shapes.items()}
    vlm = _gemma_from_shapes(flat, LLM, embed=True)
    head = PG + "lm_head.weight"
    if head in flat and _need(flat, head) != (vlm.vocab_size, vlm.width):
        raise CheckpointError(f"{head} has shape {flat[head]}, the embedding says "
                              f"({vlm.vocab_size}, {vlm.width})")
    vision = _siglip_from_shapes(flat, vlm.head_dim)
    try:
        _check_sizes(vlm, ("vocab_size",))
        return Pi0FastConfig(vision=vision, vlm=vlm, **overrides)
    except (ConfigError, TypeError) as exc:
        raise CheckpointError(f"checkpoint shapes and config do not form a Pi0-FAST config: {exc}") from None
