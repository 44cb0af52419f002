"""SNAC (Siuzdak et al. 2024): multi-scale codes -> latent -> audio (the codec's decoder half).

The codes of every scale go in (three at 24 kHz, four at 32/44 kHz; scale i has L / vq_strides[i] codes
for L latent frames), each scale's codebook row is projected to the latent width, repeated stride
times and summed (the quantizer's ``from_codes``); the decoder upsamples by prod(decoder_rates).

Frame unit: one frame is the coarsest codes that span one attention window, g = lcm(vq_strides[0],
window) / vq_strides[0] coarse codes (g = 1 without attention, e.g. snac_24khz). Inputs ``codes.i``
are (B, T * g * vq_strides[0] / vq_strides[i]); a stream is cut at frame boundaries, so SNAC's local
attention windows are never split. Inputs that are not a whole number of frames are an InputError.

Noise: the released decoders add ``randn * conv1x1(x)`` after each upsampler. ``noise_mode="off"``
(default) drops it (the reference with ``noise=False``); ``"seeded"`` draws it from `hashed_normal`
keyed by ``noise_seed`` and the absolute sample position (deterministic, no generator state). Chosen at
load: ``load_vocoder(..., overrides={"noise_mode": "seeded", "noise_seed": 7})``, a card's
``[config]``, or ``--snac-noise seeded`` on `flashrt say` / `serve` / `bench`; `describe()` says which.

Checkpoints: ``config.json`` (SNAC's constructor arguments) + ``pytorch_model.bin`` (weights_only).
Weight norm is folded once at load from any stored form (``parametrizations.weight.original0/1``, the
old ``weight_g/weight_v``, or plain ``weight``); transposed-conv weights are laid out for a GEMM. The
encoder and the quantizer's ``in_proj`` (encode side) and the rotary ``inv_freq`` (recomputed) are
ignored on purpose. Checked against the ``snac`` package on tiny 24/32/44 kHz-shaped configs
(tests/frontends/vocoders/test_snac.py).

Shape legend:
    B batch, S scales, T frames, L latent frames (T * g * vq_strides[0]), D_lat latent width,
    N samples = L * prod(decoder_rates).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.vocoders import register_vocoder
from flashrt.frontends.vocoders.base import (
    CheckpointSource,
    FeatureInput,
    VocoderFamily,
    VocoderSignature,
    as_tuples,
    check_field_types,
)
from flashrt.io import build_on_meta
from flashrt.io.transforms import weight_norm
from flashrt.io.weightmap import Rule, WeightMap
from flashrt.nn.audio import EXACT, WEIGHT_NORM_SOURCES
from flashrt.nn.snac_blocks import SnacDecoder, SnacQuantizer, convt_weight_to_gemm

__all__ = ["SnacConfig", "Snac", "PRESETS", "weight_map", "signature", "detect", "notes", "load_config",
           "FAMILY"]

NOISE_MODES = ("off", "seeded")


@dataclass(frozen=True)
class SnacConfig:
    """SNAC hyper-parameters (names follow config.json) plus the runtime noise choice."""

    sampling_rate: int = 24000
    encoder_dim: int = 48
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    latent_dim: int | None = None
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    attn_window_size: int | None = None
    codebook_size: int = 4096
    codebook_dim: int = 8
    vq_strides: tuple[int, ...] = (4, 2, 1)
    noise: bool = True
    depthwise: bool = True
    noise_mode: str = "off"
    noise_seed: int = 0

    def __post_init__(self) -> None:
        check_field_types(self, "snac", zero_ok=("noise_seed",))
        if self.noise_mode not in NOISE_MODES:
            raise ConfigError(f"snac: noise_mode {self.noise_mode!r} is not one of {NOISE_MODES}")
        if self.noise_mode == "seeded" and not self.noise:
            raise ConfigError("snac: noise_mode='seeded' needs a decoder with noise blocks (noise=true)")
        if any(self.vq_strides[0] % s for s in self.vq_strides):
            raise ConfigError(f"snac: every vq stride must divide the coarsest one, got {self.vq_strides}")
        if self.attn_window_size and self.decoder_dim % 64:
            raise ConfigError(f"snac: decoder_dim {self.decoder_dim} must be a multiple of 64 with attention")

    @property
    def latent(self) -> int:
        return self.latent_dim or self.encoder_dim * 2 ** len(self.encoder_rates)

    @property
    def coarse_per_frame(self) -> int:
        """g: coarsest codes per frame (one attention window, or one code without attention)."""
        return math.lcm(self.vq_strides[0], self.attn_window_size or 1) // self.vq_strides[0]

    @property
    def latents_per_frame(self) -> int:
        return self.coarse_per_frame * self.vq_strides[0]

    @property
    def hop_length(self) -> int:
        """Samples per frame."""
        return self.latents_per_frame * math.prod(self.decoder_rates)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SnacConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"snac: unknown config.json keys {sorted(unknown)}")
        return cls(**{k: as_tuples(v) for k, v in d.items()})


def load_config(path: str | Path) -> SnacConfig:
    """The config.json of a SNAC checkpoint folder (or the file itself)."""
    path = Path(path)
    found = path if path.suffix == ".json" else (path if path.is_dir() else path.parent) / "config.json"
    if not os.path.lexists(found):  # there but not a regular file: read_json says what it is
        raise CheckpointError(f"snac: no config.json at {found}")
    from flashrt.io.files import read_json

    return SnacConfig.from_dict(read_json(found, "SNAC config"))


PRESETS: dict[str, SnacConfig] = {
    "tiny": SnacConfig(encoder_dim=4, encoder_rates=(2, 2, 4), decoder_dim=32, decoder_rates=(4, 2, 2),
                       codebook_size=64, codebook_dim=4, noise=False),
    "tiny-32khz": SnacConfig(sampling_rate=32000, encoder_dim=4, encoder_rates=(2, 3, 4), decoder_dim=128,
                             decoder_rates=(4, 3, 2), attn_window_size=16, codebook_size=64, codebook_dim=4,
                             vq_strides=(8, 4, 2, 1), noise=False),
    "24khz": SnacConfig(),
    "32khz": SnacConfig(sampling_rate=32000, encoder_dim=64, encoder_rates=(2, 3, 8, 8), decoder_dim=1536,
                        decoder_rates=(8, 8, 3, 2), attn_window_size=32, vq_strides=(8, 4, 2, 1)),
    "44khz": SnacConfig(sampling_rate=44100, encoder_dim=64, encoder_rates=(2, 3, 8, 8), decoder_dim=1536,
                        decoder_rates=(8, 8, 3, 2), attn_window_size=32, vq_strides=(8, 4, 2, 1)),
}


class Snac(nn.Module):
    """S code tensors (B, T * rate_i) -> audio (B, N). ``noise_seed`` is a (1,) int64 buffer."""

    def __init__(self, cfg: SnacConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.quantizer = SnacQuantizer(cfg.latent, cfg.codebook_size, cfg.codebook_dim, cfg.vq_strides)
        self.decoder = SnacDecoder(cfg.latent, cfg.decoder_dim, cfg.decoder_rates, cfg.noise, cfg.depthwise,
                                   cfg.attn_window_size)
        self.register_buffer("noise_seed", torch.empty(1, dtype=torch.int64), persistent=False)

    def reset_derived(self) -> None:
        self.noise_seed = torch.full((1,), self.cfg.noise_seed, dtype=torch.int64)

    def forward(self, *codes: torch.Tensor, valid=EXACT, offset: torch.Tensor | int = 0) -> torch.Tensor:
        """``offset``: absolute frame index of the first input frame (positions of seeded noise)."""
        z = self.quantizer(codes)  # (B, L, D_lat)
        noises = None
        if self.cfg.noise_mode == "seeded":
            seed = self.noise_seed.expand(z.shape[0])
            noises = self.decoder.seeded_noises(seed, offset * self.cfg.latents_per_frame, z.shape[1])
        return self.decoder(z, noises, valid)


# ------------------------------------------------------------------------------ family plumbing

@functools.cache
def receptive_field(cfg: SnacConfig) -> tuple[int, int]:
    """(left, right) whole frames one output sample depends on, from the decoder's own reaches (built on
    the meta device). With attention the convs before it and everything after it are rounded up to
    whole frames separately, because attention makes an output depend on its entire window (= frame)."""
    pre, rest = build_on_meta(lambda: Snac(cfg)).decoder.reaches(cfg.latents_per_frame)
    if not cfg.attn_window_size:
        return (pre + rest).frames()
    (pl, pr), (rl, rr) = pre.frames(), rest.frames()
    return pl + rl, pr + rr


def signature(cfg: SnacConfig) -> VocoderSignature:
    top = cfg.latents_per_frame
    inputs = tuple(FeatureInput(f"codes.{i}", None, top // s, cfg.codebook_size - 1)
                   for i, s in enumerate(cfg.vq_strides))
    return VocoderSignature(inputs, cfg.hop_length, cfg.sampling_rate, receptive_field(cfg))


def _wn_rules(source: str, target: str, transform=None, bias: bool = True) -> list[Rule]:
    """One rule per stored weight-norm form (see `flashrt.nn.audio.WEIGHT_NORM_SOURCES`), folded once."""
    rules = []
    for names in WEIGHT_NORM_SOURCES.values():
        srcs = tuple(f"{source}.{n}" for n in names)
        fold = weight_norm(0) if len(srcs) == 2 else None
        rules.append(Rule(srcs if len(srcs) > 1 else srcs[0], f"{target}.weight", _compose(fold, transform)))
    return rules + ([Rule(f"{source}.bias", f"{target}.bias")] if bias else [])


@dataclass(frozen=True)
class _compose:  # noqa: N801 - a weight-map transform
    first: Any
    then: Any

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        out = self.first(*tensors) if self.first else tensors[0]
        return self.then(out) if self.then else out


def _squeeze_last(t: torch.Tensor) -> torch.Tensor:
    """1x1 conv weight (O, I, 1) -> linear weight (O, I)."""
    return t[..., 0]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """Snake alpha (1, C, 1) -> (C,)."""
    return t.reshape(-1)


def _quantizer_rules(cfg: SnacConfig) -> list[Rule]:
    rules = [Rule("quantizer.quantizers.{i}.codebook.weight", "quantizer.codebooks.{i}")]
    return rules + _wn_rules("quantizer.quantizers.{i}.out_proj", "quantizer.proj.{i}", _squeeze_last)


def _block_rules(src: str, dst: str, cfg: SnacConfig) -> list[Rule]:
    rules = [Rule(f"{src}.block.0.alpha", f"{dst}.snake.alpha", _flat),
             *_wn_rules(f"{src}.block.1", f"{dst}.up.gemm", convt_weight_to_gemm, bias=False),
             Rule(f"{src}.block.1.bias", f"{dst}.up.bias")]
    first = 2
    if cfg.noise:
        rules += _wn_rules(f"{src}.block.2.linear", f"{dst}.noise.linear", _squeeze_last, bias=False)
        first = 3
    for r in range(3):
        s, d = f"{src}.block.{first + r}.block", f"{dst}.res.{r}"
        rules += [Rule(f"{s}.0.alpha", f"{d}.snake1.alpha", _flat), *_wn_rules(f"{s}.1", f"{d}.conv1"),
                  Rule(f"{s}.2.alpha", f"{d}.snake2.alpha", _flat),
                  *_wn_rules(f"{s}.3", f"{d}.conv2", _squeeze_last)]
    return rules


def _decoder_rules(cfg: SnacConfig) -> tuple[list[Rule], list[str]]:
    m, rules, ignore = "decoder.model", [], []
    stages = (["pre_dw", "pre"] if cfg.depthwise else ["pre"]) + (["attn"] if cfg.attn_window_size else [])
    for j, name in enumerate(stages):
        if name == "attn":
            rules += [Rule(f"{m}.{j}.{p}", f"decoder.attn.{p}")
                      for p in ("norm.weight", "norm.bias", "to_qkv.weight", "to_out.weight")]
            ignore.append(f"{m}.{j}.rel_pos.inv_freq")
        else:  # a 1x1 "pre" after the depthwise conv is a linear layer
            pointwise = name == "pre" and cfg.depthwise
            rules += _wn_rules(f"{m}.{j}", f"decoder.{name}", _squeeze_last if pointwise else None)
    j = len(stages)
    for i in range(len(cfg.decoder_rates)):
        rules += _block_rules(f"{m}.{j + i}", f"decoder.blocks.{i}", cfg)
    j += len(cfg.decoder_rates)
    rules += [Rule(f"{m}.{j}.alpha", "decoder.post_snake.alpha", _flat),
              *_wn_rules(f"{m}.{j + 1}", "decoder.post")]
    return rules, ignore


def weight_map(cfg: SnacConfig, checkpoint: Any = ()) -> WeightMap:
    """Strict map from the SNAC state dict (decoder side; encoder deliberately ignored)."""
    rules, ignore = _decoder_rules(cfg)
    return WeightMap(_quantizer_rules(cfg) + rules,
                     ["encoder.*", "quantizer.quantizers.{i}.in_proj.*", *ignore])


def notes(cfg: SnacConfig) -> list[str]:
    """What `describe()` says about the noise (nothing for a decoder without noise blocks)."""
    if not cfg.noise:
        return []
    if cfg.noise_mode == "seeded":
        return [f"noise seeded (noise_seed {cfg.noise_seed}): position-hashed, as the released decoder "
                "adds it but reproducible"]
    return ["noise off: the released decoder's noise is dropped (deterministic; load with "
            "overrides={'noise_mode': 'seeded'}, CLI --snac-noise seeded, to add it reproducibly)"]


def detect(source: CheckpointSource) -> bool:
    """SNAC config.json (vq_strides + decoder_rates) or SNAC keys (quantizer.quantizers + decoder.model)."""
    cfg = source.config or {}
    if cfg:
        return "vq_strides" in cfg and "decoder_rates" in cfg
    return "quantizer.quantizers.0.codebook.weight" in source.keys and any(
        k.startswith("decoder.model.") for k in source.keys)


FAMILY = register_vocoder(VocoderFamily(
    name="snac", presets=PRESETS, config_from_dict=SnacConfig.from_dict, build=Snac,
    weight_map=weight_map, signature=signature, detect=detect, notes=notes,
    doc="SNAC 24/32/44 kHz multi-scale codec decoders (codes of every scale -> audio)"))
