"""Frozen configuration of the Pi0 / Pi0.5 family: presets and size derivation from tensor shapes.

The family (openpi, lerobot 0.6.1) is PaliGemma = SigLIP vision tower + linear projector + Gemma 2B,
plus a Gemma 300M "action expert" that shares head count and head size with the VLM (layer i of the
expert attends to layer i of the VLM's keys and values). Fixed constants of the family:

* 8 query heads and 1 key/value head in both Gemmas (lerobot's attention hard-codes ``8 * head_dim``);
* RMSNorm eps 1e-6, RoPE theta 10000, GELU(tanh) MLPs;
* SigLIP LayerNorm eps 1e-6; real towers are So400m/14: head_dim 72, patch 14.

`config_from_state_dict_shapes` derives every size from the checkpoint's tensor shapes; the rules are
listed in its docstring.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Literal

import torch

from flashrt.errors import CheckpointError, ConfigError

Variant = Literal["pi0", "pi05"]
VARIANTS: tuple[str, ...] = ("pi0", "pi05")
NUM_HEADS = 8  # query heads of both Gemmas (fixed by the family)
SIGLIP_HEAD_DIM = 72  # So400m/14

# Sane upper bounds of every size (real Pi0: width 2048, vocab 257,152, chunk 50). A checkpoint beyond
# them is refused at load, not discovered as a huge allocation at the first call.
LIMITS: dict[str, int] = {
    "width": 1 << 16, "depth": 512, "mlp_dim": 1 << 18, "num_heads": 1024, "num_kv_heads": 1024,
    "head_dim": 1024, "vocab_size": 1 << 22, "patch": 1024, "image_size": 8192, "chunk_size": 4096,
    "max_state_dim": 4096, "max_action_dim": 4096, "num_steps": 1000,
}


def _check_sizes(obj: object, names: tuple[str, ...], allow_zero: tuple[str, ...] = ()) -> None:
    """Each named field is a Python int (not a bool), positive (or zero where allowed), within LIMITS."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{type(obj).__name__}.{name} must be an integer, got {value!r}")
        low = 0 if name in allow_zero else 1
        if value < low:
            raise ConfigError(f"{type(obj).__name__}.{name} must be >= {low}, got {value}")
        if value > LIMITS[name]:
            raise ConfigError(f"{type(obj).__name__}.{name} = {value} is beyond the limit {LIMITS[name]} "
                              "flashrt accepts")


def _check_positive_floats(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or value <= 0:
            raise ConfigError(f"{type(obj).__name__}.{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class GemmaSpec:
    """One Gemma decoder stack. ``vocab_size`` is 0 for the action expert (it has no embedding)."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int = NUM_HEADS
    num_kv_heads: int = 1
    head_dim: int = 256
    vocab_size: int = 0
    eps: float = 1e-6
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        _check_sizes(self, ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim",
                            "vocab_size"), allow_zero=("vocab_size",))
        _check_positive_floats(self, ("eps", "rope_theta"))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of "
                              f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class SiglipSpec:
    """SigLIP vision tower (no pooling head: PaliGemma uses the last hidden state)."""

    width: int = 1152
    depth: int = 27
    mlp_dim: int = 4304
    num_heads: int = 16
    patch: int = 14
    image_size: int = 224
    eps: float = 1e-6

    def __post_init__(self) -> None:
        _check_sizes(self, ("width", "depth", "mlp_dim", "num_heads", "patch", "image_size"))
        _check_positive_floats(self, ("eps",))
        if self.width % self.num_heads:
            raise ConfigError(f"SigLIP width {self.width} is not divisible by {self.num_heads} heads")
        if self.image_size % self.patch:
            raise ConfigError(f"image_size {self.image_size} is not a multiple of patch {self.patch}")

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def num_tokens(self) -> int:
        return (self.image_size // self.patch) ** 2


GEMMA_2B = GemmaSpec(width=2048, depth=18, mlp_dim=16_384, vocab_size=257_152)
GEMMA_300M = GemmaSpec(width=1024, depth=18, mlp_dim=4096)
SO400M = SiglipSpec()
# Sizes of the shared tiny reference builder (shared/reference/scripts/tiny_lerobot_common.py).
TINY_VLM = GemmaSpec(width=64, depth=2, mlp_dim=128, head_dim=16, vocab_size=512)
TINY_EXPERT = GemmaSpec(width=32, depth=2, mlp_dim=64, head_dim=16)
TINY_VISION = SiglipSpec(width=32, depth=2, mlp_dim=64, num_heads=2, patch=14, image_size=28)

# Named variants of lerobot/openpi configs. A name maps to its fixed sizes (vocab not part of the check);
# "tiny" is the explicit "no named sizes" marker used by test fixtures.
GEMMA_VARIANTS: dict[str, GemmaSpec | None] = {"gemma_2b": GEMMA_2B, "gemma_300m": GEMMA_300M, "tiny": None}


@dataclass(frozen=True)
class Pi0Config:
    """Everything that fixes the shapes of a Pi0 / Pi0.5 model.

    variant      "pi0" (state token + action/time MLP) or "pi05" (adaRMS time conditioning, no state)
    chunk_size   actions per chunk (lerobot ``chunk_size``, openpi ``action_horizon``)
    num_steps    Euler steps of the flow-matching sampler (dt = -1/num_steps)
    """

    variant: Variant = "pi0"
    vision: SiglipSpec = field(default_factory=SiglipSpec)
    vlm: GemmaSpec = GEMMA_2B
    expert: GemmaSpec = GEMMA_300M
    chunk_size: int = 50
    max_state_dim: int = 32
    max_action_dim: int = 32
    num_steps: int = 10
    min_period: float = 4e-3
    max_period: float = 4.0

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ConfigError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        for name, cls in (("vision", SiglipSpec), ("vlm", GemmaSpec), ("expert", GemmaSpec)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"Pi0Config.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
        _check_shared_attention(self.vlm, self.expert)
        if self.vlm.vocab_size <= 0:
            raise ConfigError("the VLM needs a vocabulary (vlm.vocab_size > 0)")
        _check_sizes(self, ("chunk_size", "max_state_dim", "max_action_dim", "num_steps"))
        _check_positive_floats(self, ("min_period", "max_period"))
        if self.min_period >= self.max_period:
            raise ConfigError(f"Pi0Config.min_period {self.min_period} must be below max_period "
                              f"{self.max_period}")
        if self.expert.width % 2:
            raise ConfigError("the sinusoidal time embedding needs an even expert width")

    @property
    def has_state_token(self) -> bool:
        """Pi0 feeds the state as one expert token; Pi0.5 tokenizes it into the prompt instead."""
        return self.variant == "pi0"

    @property
    def suffix_len(self) -> int:
        """Expert tokens per step: the state token (pi0 only) + one token per action."""
        return int(self.has_state_token) + self.chunk_size

    def prefix_len(self, n_cams: int, prompt_len: int) -> int:
        """Prefix tokens: every camera's image tokens, then the prompt tokens."""
        return n_cams * self.vision.num_tokens + prompt_len

    def replace(self, **changes) -> Pi0Config:
        return replace(self, **changes)


def _check_shared_attention(vlm: GemmaSpec, expert: GemmaSpec) -> None:
    shared = ("depth", "num_heads", "num_kv_heads", "head_dim", "rope_theta")
    diff = [f"{n}: vlm {getattr(vlm, n)} vs expert {getattr(expert, n)}" for n in shared
            if getattr(vlm, n) != getattr(expert, n)]
    if diff:
        raise ConfigError("the VLM and the action expert must share depth and attention sizes; "
                          + "; ".join(diff))


PRESETS: dict[str, Pi0Config] = {
    "pi0": Pi0Config(variant="pi0"),
    "pi05": Pi0Config(variant="pi05"),
    "pi0-tiny": Pi0Config(variant="pi0", vision=TINY_VISION, vlm=TINY_VLM, expert=TINY_EXPERT,
                          chunk_size=6, max_state_dim=12, max_action_dim=16, num_steps=4),
    "pi05-tiny": Pi0Config(variant="pi05", vision=TINY_VISION, vlm=TINY_VLM, expert=TINY_EXPERT,
                           chunk_size=6, max_state_dim=12, max_action_dim=16, num_steps=4),
}


def preset(name: str, **overrides) -> Pi0Config:
    """A named configuration ("pi0", "pi05", "pi0-tiny", "pi05-tiny"), optionally with overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown Pi0 preset {name!r}; known: {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


# ------------------------------------------------------------------------- model cards

CARD_IO_KEYS = ("chunk_size", "max_state_dim", "max_action_dim", "num_steps", "min_period", "max_period")


def config_from_card(card: Mapping) -> Pi0Config:
    """`Pi0Config` from a parsed model card (models/pi0-*.toml): ``variant``, ``[sizes.vision|vlm|expert]``
    and ``[io]``. Other top-level tables (source, preprocess, ...) are not read here. Unknown keys inside
    the tables read here are a ConfigError."""
    if not isinstance(card, Mapping):
        raise ConfigError(f"model card: expected a table, got {type(card).__name__}")
    sizes, io = _card_table(card, "sizes"), _card_table(card, "io")
    unknown = sorted(set(sizes) - {"vision", "vlm", "expert"})
    unknown += sorted(f"io.{k}" for k in set(io) - set(CARD_IO_KEYS))
    if unknown:
        raise ConfigError(f"model card: unknown keys {unknown}")
    specs = {name: _card_spec(sizes, name, cls) for name, cls in
             (("vision", SiglipSpec), ("vlm", GemmaSpec), ("expert", GemmaSpec))}
    return Pi0Config(variant=card.get("variant", "pi0"), **specs, **io)


def _card_table(card: Mapping, name: str) -> Mapping:
    table = card.get(name, {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"model card [{name}]: expected a table, got {table!r}")
    return table


def _card_spec(sizes: Mapping, name: str, cls: type) -> GemmaSpec | SiglipSpec:
    if name not in sizes:
        raise ConfigError(f"model card [sizes.{name}]: missing")
    table = sizes[name]
    if not isinstance(table, Mapping):
        raise ConfigError(f"model card [sizes.{name}]: expected a table, got {table!r}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"model card [sizes.{name}]: unknown keys {unknown}; known: {sorted(known)}")
    try:
        return cls(**table)
    except TypeError as exc:  # a required size absent
        raise ConfigError(f"model card [sizes.{name}]: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"model card [sizes.{name}]: {exc}") from None


# ------------------------------------------------------------------------- sizes from tensor shapes

# Key stems, relative to the checkpoint root after any "model." prefix is removed.
PG = "paligemma_with_expert.paligemma."
VISION = PG + "model.vision_tower.vision_model."
LLM = PG + "model.language_model."
EXPERT = "paligemma_with_expert.gemma_expert.model."
_LAYER = re.compile(r"layers\.(\d+)\.")

Shapes = Mapping[str, "torch.Size | tuple[int, ...]"]


def config_from_state_dict_shapes(
    shapes: Shapes,
    variant: Variant,
    paligemma_variant: str | None = None,
    action_expert_variant: str | None = None,
    **overrides,
) -> Pi0Config:
    """Derive a `Pi0Config` from checkpoint tensor shapes (lerobot or openpi-PyTorch key layout).

    ``shapes`` maps key -> shape, with or without lerobot's ``model.`` prefix. How each size is found:

    * VLM width, vocab: ``language_model.embed_tokens.weight`` (vocab, width); if absent (tied
      checkpoints), ``paligemma.lm_head.weight``. Fixtures may keep a shrunken vocabulary.
    * depth: number of distinct ``layers.{i}`` indices (VLM and expert separately; must agree).
    * mlp_dim: rows of ``mlp.gate_proj.weight``; expert width: columns of its ``q_proj.weight``.
    * heads: ``num_heads`` is the family constant 8, ``head_dim = q_proj rows / 8``,
      ``num_kv_heads = k_proj rows / head_dim``.
    * SigLIP: width and patch from ``patch_embedding.weight`` (width, 3, patch, patch); image size
      ``= sqrt(position_embedding rows) * patch``; depth from layer indices; mlp from ``fc1`` rows;
      heads ``= width / 72`` (So400m head_dim) when 72 divides the width, else ``width / head_dim`` of the
      Gemmas (the rule the tiny reference builder satisfies: width 32, head_dim 16, 2 heads), else
      CheckpointError (pass ``vision=SiglipSpec(...)`` explicitly).
    * Named variants (``gemma_2b``, ``gemma_300m``, from lerobot's config.json) are cross-checked
      against the derived sizes; any disagreement is a CheckpointError. ``None`` or ``"tiny"`` skips it.

    ``overrides`` set the fields the tensors do not fix (chunk_size, max_state_dim, max_action_dim,
    num_steps, min_period, max_period) or replace a derived spec.
    """
    flat = _strip_model_prefix(shapes)
    if variant not in VARIANTS:
        raise ConfigError(f"variant must be one of {VARIANTS}, got {variant!r}")
    vlm = _gemma_from_shapes(flat, LLM, embed=True)
    expert = _gemma_from_shapes(flat, EXPERT, embed=False)
    _cross_check("paligemma_variant", paligemma_variant, vlm)
    _cross_check("action_expert_variant", action_expert_variant, expert)
    vision = _siglip_from_shapes(flat, vlm.head_dim)
    derived = dict(variant=variant, vision=vision, vlm=vlm, expert=expert)
    derived.update(_io_dims(flat, variant, expert.width))
    unknown = sorted(set(overrides) - {f.name for f in fields(Pi0Config)})
    if unknown:
        raise ConfigError(f"unknown Pi0Config override(s) {unknown}")
    derived.update(overrides)
    try:
        return Pi0Config(**derived)
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint shapes and config do not form a valid Pi0 config: {exc}") from None


def _strip_model_prefix(shapes: Shapes) -> dict[str, tuple[int, ...]]:
    return {k.removeprefix("model."): tuple(v) for k, v in shapes.items()}


def _need(flat: Mapping[str, tuple[int, ...]], key: str, ndim: int = 2) -> tuple[int, ...]:
    """The shape of ``key``, which must have ``ndim`` dimensions, none of them empty."""
    if key not in flat:
        raise CheckpointError(f"checkpoint has no tensor {key!r} (nor with a 'model.' prefix); "
                              "is this a Pi0/Pi0.5 checkpoint in the lerobot or openpi layout?")
    shape = flat[key]
    if len(shape) != ndim or 0 in shape:
        raise CheckpointError(f"checkpoint tensor {key!r} has shape {tuple(shape)}; a Pi0 checkpoint has a "
                              f"{ndim}-D tensor there with no empty dimension")
    return shape


def _depth(flat: Mapping[str, tuple[int, ...]], stem: str) -> int:
    idx = {int(m.group(1)) for k in flat if k.startswith(stem) and (m := _LAYER.match(k[len(stem):]))}
    if not idx or idx != set(range(max(idx) + 1)):
        raise CheckpointError(f"layers under {stem!r} are missing or not numbered 0..n-1: {sorted(idx)}")
    return len(idx)


def _gemma_from_shapes(flat: Mapping[str, tuple[int, ...]], stem: str, embed: bool) -> GemmaSpec:
    q_rows, width = _need(flat, stem + "layers.0.self_attn.q_proj.weight")
    if q_rows % NUM_HEADS:
        raise CheckpointError(f"{stem}q_proj has {q_rows} rows, not a multiple of the family's "
                              f"{NUM_HEADS} heads")
    head_dim = q_rows // NUM_HEADS
    kv_rows = _need(flat, stem + "layers.0.self_attn.k_proj.weight")[0]
    if kv_rows % head_dim:
        raise CheckpointError(f"{stem}k_proj has {kv_rows} rows, not a multiple of head_dim {head_dim}")
    vocab = _vocab(flat, width) if embed else 0
    mlp = _need(flat, stem + "layers.0.mlp.gate_proj.weight")[0]
    try:
        return GemmaSpec(width=width, depth=_depth(flat, stem), mlp_dim=mlp,
                         num_kv_heads=max(kv_rows // head_dim, 1), head_dim=head_dim, vocab_size=vocab)
    except ConfigError as exc:
        raise CheckpointError(f"{stem}: {exc}") from None


def _vocab(flat: Mapping[str, tuple[int, ...]], width: int) -> int:
    for key in (LLM + "embed_tokens.weight", PG + "lm_head.weight"):
        if key in flat:
            vocab, w = _need(flat, key)
            if w != width:
                raise CheckpointError(f"{key} has width {w}, but q_proj says {width}")
            return vocab
    raise CheckpointError(f"checkpoint has neither {LLM}embed_tokens.weight nor {PG}lm_head.weight")


def _cross_check(label: str, name: str | None, got: GemmaSpec) -> None:
    if name is None:
        return
    if name not in GEMMA_VARIANTS:
        raise CheckpointError(f"{label} {name!r} is not a known variant; known: {sorted(GEMMA_VARIANTS)}")
    want = GEMMA_VARIANTS[name]
    if want is None:
        return
    fields = ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim")
    diff = [f"{f} {getattr(got, f)} (expected {getattr(want, f)})" for f in fields
            if getattr(got, f) != getattr(want, f)]
    if diff:
        raise CheckpointError(f"{label} says {name!r} but the checkpoint tensors disagree: "
                              + ", ".join(diff))


def _siglip_from_shapes(flat: Mapping[str, tuple[int, ...]], gemma_head_dim: int) -> SiglipSpec:
    width, _, patch, _ = _need(flat, VISION + "embeddings.patch_embedding.weight", ndim=4)
    n_pos = _need(flat, VISION + "embeddings.position_embedding.weight")[0]
    side = math.isqrt(n_pos)
    if side * side != n_pos:
        raise CheckpointError(f"SigLIP position_embedding has {n_pos} rows, not a square patch grid")
    heads = _siglip_heads(width, gemma_head_dim)
    mlp = _need(flat, VISION + "encoder.layers.0.mlp.fc1.weight")[0]
    try:
        return SiglipSpec(width=width, depth=_depth(flat, VISION + "encoder."), mlp_dim=mlp,
                          num_heads=heads, patch=patch, image_size=side * patch)
    except ConfigError as exc:
        raise CheckpointError(f"{VISION}: {exc}") from None


def _siglip_heads(width: int, gemma_head_dim: int) -> int:
    for head_dim in (SIGLIP_HEAD_DIM, gemma_head_dim):
        if width % head_dim == 0:
            return width // head_dim
    raise CheckpointError(f"cannot infer SigLIP heads for width {width} (neither {SIGLIP_HEAD_DIM} nor "
                          f"{gemma_head_dim} divides it); pass vision=SiglipSpec(...) explicitly")


def _io_dims(flat: Mapping[str, tuple[int, ...]], variant: Variant, expert_width: int) -> dict[str, int]:
    """max_action_dim from action_in_proj; max_state_dim from state_proj (pi0 only)."""
    dims = {"max_action_dim": _need(flat, "action_in_proj.weight")[1]}
    if variant == "pi0":  # Pi0.5 has no state input (a stray state_proj is ignored, as lerobot does)
        dims["max_state_dim"] = _need(flat, "state_proj.weight")[1]
    if _need(flat, "action_in_proj.weight")[0] != expert_width:
        raise CheckpointError("action_in_proj output width differs from the expert width")
    return dims
