"""BigVGAN (v1 and v2; Lee et al. 2022): mel -> waveform with anti-aliased periodic activations.

Layout (NVIDIA/BigVGAN ``bigvgan_generator.pt`` = ``{"generator": state_dict}`` + ``config.json``):
``conv_pre``, ``ups.{i}.0`` (transposed convs), ``resblocks.{k}.convs1.{j}/convs2.{j}`` (AMPBlock1) or
``resblocks.{k}.convs.{j}`` (AMPBlock2), ``resblocks.{k}.activations.{j}.act.{alpha,beta}``,
``activation_post.act.{alpha,beta}``, ``conv_post`` (bias only with ``use_bias_at_final``). Convs
carry weight norm (``weight_g/weight_v``) in training checkpoints and plain weights after
``remove_weight_norm``; both load, the fold happens once. The stored anti-alias filters
(``*.upsample.filter``, ``*.downsample.lowpass.filter``) are ignored: they are recomputed from their
definition (kaiser-windowed sinc, `flashrt.nn.audio.kaiser_sinc_filter1d`) in ``reset_derived``.

Snake/SnakeBeta parameters are log-scale when ``snake_logscale`` (v2 default). The output is tanh
(``use_tanh_at_final``, v1 default) or clamped to [-1, 1]. Checked against the ``bigvgan`` package on
tiny random configs with and without weight norm (tests/frontends/vocoders/test_bigvgan.py).

Shape legend:
    B  batch
    M  mel bins (num_mels)
    T  frames; stage-i tensors are rows (B, U/2^(i+1), 1, T * prod(rates[:i+1])), channels-last
    U  upsample_initial_channel
    N  samples = T * hop_length, hop_length = prod(upsample_rates)

Forward: conv_pre -> per stage: ups[i] (no activation before it) -> mean of the stage's AMP blocks
(each conv preceded by an anti-aliased snake) -> anti-aliased snake -> conv_post -> tanh | clamp.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
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
    Activation1d,
    Reach,
    Snake,
    SnakeBeta,
    conv1d,
    conv_rules,
    conv_transpose1d,
    mrf,
    to_rows,
)
from flashrt.nn.reach import chain

__all__ = ["BigVGANConfig", "BigVGAN", "AMPBlock1", "AMPBlock2", "PRESETS", "weight_map", "signature",
           "detect", "FAMILY"]

ACTIVATIONS = {"snake": Snake, "snakebeta": SnakeBeta}


@dataclass(frozen=True)
class BigVGANConfig:
    """BigVGAN generator hyper-parameters (names follow BigVGAN's config.json)."""

    num_mels: int = 100
    upsample_initial_channel: int = 512
    upsample_rates: tuple[int, ...] = (8, 8, 2, 2)
    upsample_kernel_sizes: tuple[int, ...] = (16, 16, 4, 4)
    resblock: str = "1"
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    activation: str = "snakebeta"
    snake_logscale: bool = True
    use_tanh_at_final: bool = True
    use_bias_at_final: bool = True
    sample_rate: int = 24000

    def __post_init__(self) -> None:
        check_field_types(self, "bigvgan")
        if self.resblock not in ("1", "2") or self.activation not in ACTIVATIONS:
            raise ConfigError(f"bigvgan: resblock {self.resblock!r} (1 or 2), activation {self.activation!r} "
                              f"(one of {sorted(ACTIVATIONS)})")
        check_upsampler_pairs("bigvgan", self)

    @property
    def hop_length(self) -> int:
        return math.prod(self.upsample_rates)

    def channels(self, stage: int) -> int:
        return self.upsample_initial_channel // (2 ** (stage + 1))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BigVGANConfig:
        """From BigVGAN's config.json (training-only keys are ignored)."""
        names = ("num_mels", "upsample_initial_channel", "upsample_rates", "upsample_kernel_sizes",
                 "resblock_kernel_sizes", "resblock_dilation_sizes", "activation", "snake_logscale",
                 "use_tanh_at_final", "use_bias_at_final")
        kw = {n: as_tuples(d[n]) for n in names if n in d}
        return cls(resblock=str(d.get("resblock", "1")), sample_rate=d.get("sampling_rate", 24000), **kw)


_V2 = dict(num_mels=100, upsample_initial_channel=1536, upsample_rates=(4, 4, 2, 2, 2, 2),
           upsample_kernel_sizes=(8, 8, 4, 4, 4, 4), use_tanh_at_final=False, use_bias_at_final=False)
PRESETS: dict[str, BigVGANConfig] = {
    "tiny": BigVGANConfig(num_mels=20, upsample_initial_channel=32, upsample_rates=(4, 4),
                          upsample_kernel_sizes=(8, 8), resblock_kernel_sizes=(3, 7),
                          resblock_dilation_sizes=((1, 3, 5), (1, 3, 5)), use_tanh_at_final=False,
                          use_bias_at_final=False),
    "tiny-snake2": BigVGANConfig(num_mels=20, upsample_initial_channel=32, upsample_rates=(4, 2),
                                 upsample_kernel_sizes=(8, 4), resblock="2", resblock_kernel_sizes=(3, 5),
                                 resblock_dilation_sizes=((1, 3), (1, 3)), activation="snake"),
    "base-24k-100band": BigVGANConfig(),
    "base-22k-80band": BigVGANConfig(num_mels=80, sample_rate=22050),
    "v2-24k-100band-256x": BigVGANConfig(**_V2),
    "v2-22k-80band-256x": BigVGANConfig(**{**_V2, "num_mels": 80}, sample_rate=22050),
}


def _act(cfg: BigVGANConfig, channels: int) -> Activation1d:
    return Activation1d(channels, ACTIVATIONS[cfg.activation](channels, cfg.snake_logscale))


class AMPBlock1(nn.Module):
    """Per dilation d: x += conv2(act(conv1_d(act(x)))), act = anti-aliased snake. (B, C, T) -> same."""

    def __init__(self, cfg: BigVGANConfig, channels: int, kernel: int, dilations: Sequence[int]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(conv1d(channels, channels, kernel, d) for d in dilations)
        self.convs2 = nn.ModuleList(conv1d(channels, channels, kernel, 1) for _ in dilations)
        self.activations = nn.ModuleList(_act(cfg, channels) for _ in range(2 * len(dilations)))

    def forward(self, x: torch.Tensor, valid=EXACT) -> torch.Tensor:
        acts = self.activations
        for i, (c1, c2, a1, a2) in enumerate(zip(self.convs1, self.convs2, acts[::2], acts[1::2])):
            xt = c1(a1(x, valid), valid)
            x = c2(a2(xt, valid), valid, residual=x, into=i > 0)  # x is shared at i = 0, ours after
        return x

    def reach(self, rate: int = 1) -> Reach:
        return chain([*self.activations, *self.convs1, *self.convs2], rate)


class AMPBlock2(nn.Module):
    """Per dilation d: x += conv_d(act(x)). (B, C, T) -> same."""

    def __init__(self, cfg: BigVGANConfig, channels: int, kernel: int, dilations: Sequence[int]) -> None:
        super().__init__()
        self.convs = nn.ModuleList(conv1d(channels, channels, kernel, d) for d in dilations)
        self.activations = nn.ModuleList(_act(cfg, channels) for _ in dilations)

    def forward(self, x: torch.Tensor, valid=EXACT) -> torch.Tensor:
        for i, (conv, act) in enumerate(zip(self.convs, self.activations)):
            x = conv(act(x, valid), valid, residual=x, into=i > 0)
        return x

    def reach(self, rate: int = 1) -> Reach:
        return chain([*self.activations, *self.convs], rate)


AMP_BLOCKS = {"1": AMPBlock1, "2": AMPBlock2}


class BigVGAN(nn.Module):
    """mel (B, M, T) -> audio (B, N). See the module docstring for the legend."""

    def __init__(self, cfg: BigVGANConfig) -> None:
        super().__init__()
        self.cfg = cfg
        top = cfg.upsample_initial_channel
        self.conv_pre = conv1d(cfg.num_mels, top, 7)
        self.ups = nn.ModuleList(
            nn.ModuleList([conv_transpose1d(top // 2 ** i, cfg.channels(i), k, u)])
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)))
        block = AMP_BLOCKS[cfg.resblock]
        self.resblocks = nn.ModuleList(
            block(cfg, cfg.channels(i), k, d)
            for i in range(len(self.ups))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
        last = cfg.channels(len(self.ups) - 1)
        self.activation_post = _act(cfg, last)
        self.conv_post = conv1d(last, 1, 7, bias=cfg.use_bias_at_final)

    def forward(self, mel: torch.Tensor, valid=EXACT) -> torch.Tensor:
        x = self.conv_pre(to_rows(mel), valid)                              # rows (B, U, 1, T)
        n = len(self.cfg.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up[0](x, valid)                                               # (B, U/2^(i+1), 1, T*r)
            x = mrf(self.resblocks[i * n:(i + 1) * n], x, valid)
        x = self.conv_post(self.activation_post(x, valid), valid)            # (B, 1, 1, N)
        x = torch.tanh(x) if self.cfg.use_tanh_at_final else x.clamp(-1.0, 1.0)
        return x.reshape(x.shape[0], -1)                                      # (B, N)

    def reach(self, rate: int = 1) -> Reach:
        """Composed from the layers' own reaches: a stage's AMP blocks are parallel branches."""
        reach, n = self.conv_pre.reach(rate), len(self.cfg.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            reach = reach + up[0].reach(rate)
            rate *= up[0].stride[0]
            reach = reach + Reach.widest([b.reach(rate) for b in self.resblocks[i * n:(i + 1) * n]])
        return reach + self.activation_post.reach(rate) + self.conv_post.reach(rate)


# ------------------------------------------------------------------------------ family plumbing

@functools.cache
def receptive_field(cfg: BigVGANConfig) -> Reach:
    """How far one output sample reaches into the input frames (left, right): the module's own `reach`
    (built on the meta device: no memory)."""
    return build_on_meta(lambda: BigVGAN(cfg)).reach()


def signature(cfg: BigVGANConfig) -> VocoderSignature:
    left, right = receptive_field(cfg).frames()
    return VocoderSignature((FeatureInput("features", cfg.num_mels),), cfg.hop_length, cfg.sample_rate,
                            context=(left + 1, right + 1))


def weight_map(cfg: BigVGANConfig, checkpoint: Any = ()) -> WeightMap:
    """Strict map; weight norm in either form or plain weights; stored filters ignored."""
    convs = ("convs1", "convs2") if cfg.resblock == "1" else ("convs",)
    params = ("alpha", "beta") if cfg.activation == "snakebeta" else ("alpha",)
    rules: list[Rule] = [*conv_rules("conv_pre", "conv_pre"), *conv_rules("ups.{i}.0", "ups.{i}.0")]
    for name in convs:
        rules += conv_rules(f"resblocks.{{k}}.{name}.{{j}}", f"resblocks.{{k}}.{name}.{{j}}")
    for p in params:
        act = f"resblocks.{{k}}.activations.{{j}}.act.{p}"
        rules += [Rule(act, act), Rule(f"activation_post.act.{p}", f"activation_post.act.{p}")]
    rules += conv_rules("conv_post", "conv_post", bias=cfg.use_bias_at_final)
    ignore = ("*.upsample.filter", "*.downsample.lowpass.filter")
    return WeightMap(rules, ignore).auto_prefix(list(checkpoint), ("", "generator."))


_ACT_KEY = re.compile(r"(^|\.)activations?(_post)?(\.\d+)?\.act\.alpha$")
_PRE_KEY = re.compile(r"(^|\.)conv_pre\.")


def detect(source: CheckpointSource) -> bool:
    """A BigVGAN config.json (snake activation) or snake parameters next to conv_pre/ups keys."""
    cfg = source.config or {}
    if cfg:
        return cfg.get("activation") in ACTIVATIONS and "upsample_rates" in cfg
    keys = source.keys
    return any(_ACT_KEY.search(k) for k in keys) and any(_PRE_KEY.search(k) for k in keys)


FAMILY = register_vocoder(VocoderFamily(
    name="bigvgan", presets=PRESETS, config_from_dict=BigVGANConfig.from_dict, build=BigVGAN,
    weight_map=weight_map, signature=signature, detect=detect, conv="invariant",
    doc="BigVGAN v1/v2 (snake/snakebeta, anti-aliased activations)"))
