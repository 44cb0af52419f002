"""`LMConfig`: the sizes of a Llama / Qwen2 / Qwen3 causal LM, read from a transformers config.json.

The family differences are flags (`ARCHITECTURES`): Qwen2 has q/k/v biases, Qwen3 q/k RMSNorms over
head_dim; a Llama with ``attention_bias`` has biases on q/k/v/o. RoPE comes from ``rope_parameters``
(transformers 5) or ``rope_theta`` + ``rope_scaling`` (transformers 4 files, e.g. Llama 3.2 / Orpheus),
scaling types in `flashrt.nn.llama.ROPE_SCALINGS`. Anything else that changes the math (another
activation, sliding windows) is a CheckpointError naming the field, never silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from flashrt.errors import CheckpointError, ConfigError
from flashrt.io.fields import Fields
from flashrt.nn.llama import LayerShape, RopeScaling

__all__ = ["LMConfig", "ARCHITECTURES", "PRESETS"]

# model_type -> layer flags
ARCHITECTURES: dict[str, dict[str, bool]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
}


@dataclass(frozen=True)
class LMConfig:
    """One causal LM. ``max_positions`` bounds the K/V cache a loader may allocate."""

    model_type: str = "llama"
    vocab_size: int = 512
    width: int = 64
    depth: int = 2
    mlp: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    eps: float = 1e-6
    rope_theta: float = 10000.0
    rope: RopeScaling = RopeScaling()
    tied: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    max_positions: int = 2048

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ConfigError(f"lm: {self.heads} query heads are not a multiple of {self.kv_heads} kv heads")
        if self.head_dim % 2:
            raise ConfigError(f"lm: head_dim {self.head_dim} must be even (RoPE pairs)")

    @property
    def layer(self) -> LayerShape:
        return LayerShape(self.width, self.mlp, self.heads, self.kv_heads, self.head_dim, self.eps,
                          self.qkv_bias, self.o_bias, self.qk_norm)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "config.json") -> LMConfig:
        """A transformers config.json (LlamaConfig, Qwen2Config, Qwen3Config, MistralConfig). Every field
        read is checked for its type and range (`flashrt.io.fields`): CheckpointError naming the field."""
        f = Fields(d, where)
        kind = d.get("model_type")
        if kind not in ARCHITECTURES:
            raise CheckpointError(f"{where}: model_type {kind!r} is not a supported causal LM "
                                  f"(supported: {sorted(ARCHITECTURES)})")
        _refuse(d, where)
        heads = f.int("num_attention_heads", lo=1, hi=_MAX_HEADS)
        width = f.int("hidden_size", lo=1, hi=_MAX_DIM)
        flags = dict(ARCHITECTURES[kind])
        if f.bool("attention_bias", False):
            flags.update(qkv_bias=True, o_bias=kind != "qwen3")
        theta, rope = _rope(f, where)
        kv_heads = f.int("num_key_value_heads", heads, lo=1, hi=heads)
        if heads % kv_heads:
            raise CheckpointError(f"{where}: num_key_value_heads: {kv_heads} does not divide the {heads} "
                                  "attention heads")
        head_dim = f.int("head_dim", width // heads, lo=2, hi=_MAX_DIM)
        if head_dim % 2:
            raise CheckpointError(f"{where}: head_dim: {head_dim} must be even (RoPE pairs)")
        return cls(model_type=kind, vocab_size=f.int("vocab_size", lo=1, hi=_MAX_VOCAB), width=width,
                   depth=f.int("num_hidden_layers", lo=1, hi=_MAX_DEPTH),
                   mlp=f.int("intermediate_size", lo=1, hi=_MAX_DIM), heads=heads, kv_heads=kv_heads,
                   head_dim=head_dim, eps=f.float("rms_norm_eps", 1e-6, lo=0.0, hi=1.0, lo_open=True),
                   rope_theta=theta, rope=rope, tied=f.bool("tie_word_embeddings", False),
                   max_positions=f.int("max_position_embeddings", 2048, lo=1, hi=_MAX_POSITIONS), **flags)


# Bounds of the sizes a config.json may declare: far above any released model, low enough that a typo
# or a hostile file cannot ask for an absurd allocation before the weights are even opened.
_MAX_VOCAB, _MAX_DIM, _MAX_DEPTH, _MAX_HEADS, _MAX_POSITIONS = 1 << 22, 1 << 17, 1024, 1024, 1 << 24


def _refuse(d: Mapping[str, Any], where: str) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{where}: hidden_act {act!r} is not supported (SwiGLU with silu only)")
    if d.get("use_sliding_window") or (d.get("model_type") == "mistral" and d.get("sliding_window")):
        raise CheckpointError(f"{where}: sliding-window attention is not supported")
    if d.get("mlp_bias"):
        raise CheckpointError(f"{where}: mlp_bias=true is not supported")


_ROPE_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor")


def _rope(f: Fields, where: str) -> tuple[float, RopeScaling]:
    """(theta, scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``."""
    theta = f.float("rope_theta", 10000.0, lo=0.0, lo_open=True)
    if f.has("rope_parameters"):
        params = f.table("rope_parameters")
        theta = params.float("rope_theta", theta, lo=0.0, lo_open=True)
    else:
        params = f.table("rope_scaling", {})
    for name in _ROPE_NUMBERS:
        params.float(name, None, lo=0.0, lo_open=True)
    params.int("original_max_position_embeddings", None, lo=1, hi=_MAX_POSITIONS)
    return theta, RopeScaling.from_dict(params.data, where)


_LLAMA3 = RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)

PRESETS: dict[str, LMConfig] = {
    "tiny": LMConfig(),
    "tiny-qwen3": LMConfig(model_type="qwen3", qk_norm=True, tied=True, rope_theta=1e6),
    # Llama-3.2-3B with Orpheus' vocabulary (128,256 text tokens + 10 specials + 7 x 4096 audio codes + 8)
    "orpheus-3b": LMConfig(vocab_size=156940, width=3072, depth=28, mlp=8192, heads=24, kv_heads=8,
                           head_dim=128, eps=1e-5, rope_theta=500000.0, rope=_LLAMA3, tied=True,
                           max_positions=131072),
}


def preset(name: str, **overrides: Any) -> LMConfig:
    if name not in PRESETS:
        raise ConfigError(f"lm: unknown preset {name!r}; presets: {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)
