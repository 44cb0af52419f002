"""Vocos (Siuzdak 2023): ConvNeXt backbone + ISTFT head, from mel spectrograms or EnCodec codes.

Two released layouts, one module:

* ``mel`` (charactr/vocos-mel-24khz): log-mel features (B, n_mels, T) -> audio, "center" ISTFT padding,
  plain LayerNorms. Audio has (T - 1) * hop samples, as ``torch.istft(center=True)`` gives.
* ``encodec`` (charactr/vocos-encodec-24khz): EnCodec codes -> features through the checkpoint's own
  codebook table ``feature_extractor.codebook_weights`` (the K used codebooks' rows, offset by k * bins,
  summed: Vocos' ``codes_to_features``), AdaLayerNorm conditioned on the bandwidth id, "same" padding
  (T * hop samples). The bandwidth is a deployment choice (``bandwidth_id`` in the config, default the
  highest), which fixes the number of codebooks K; ``input="features"`` takes (B, 128, T) features
  instead of codes.

Checkpoints: ``config.yaml`` (Vocos' ``class_path``/``init_args`` file; `VocosConfig.from_yaml`) and
``pytorch_model.bin`` (opened with ``weights_only=True``) or a safetensors file. Load-time folds done by
the weight map (nothing is recomputed per call):

* each plain LayerNorm's affine into the following linear (``pwconv1``; the final norm into ``head.out``);
* the layer scale ``gamma`` into ``pwconv2``;
* depthwise conv weights (D, 1, 7) -> (7, D) for the channels-last backbone.

Unused keys, ignored on purpose: ``head.istft.window`` (recomputed), ``feature_extractor.mel_spec.*``
(the mel front-end is not part of synthesis), ``feature_extractor.encodec.*``. Checked against the
``vocos`` package (tiny random mel and EnCodec configs, identical weights; tests/frontends/vocoders/
test_vocos.py).

Shape legend:
    B batch, C input channels (mel bins or 128 EnCodec dims), T frames, D width, I intermediate width,
    K codebooks, V codebook bins (1024), N samples (T - 1) * hop ("center") or T * hop ("same").
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.vocoders import register_vocoder
from flashrt.frontends.vocoders.base import (
    CheckpointSource,
    FeatureInput,
    VocoderFamily,
    VocoderSignature,
    check_field_types,
)
from flashrt.io import build_on_meta
from flashrt.io.weightmap import Rule, WeightMap
from flashrt.nn.audio import EXACT, Reach
from flashrt.nn.convnext import (
    AdaLayerNorm,
    ConvNeXtBlock,
    FusedLinear,
    channels_last,
    fold_norm_bias,
    fold_norm_weight,
    fold_scale,
    fold_scale_bias,
    taps_last,
    zero_padding_cl_,
)
from flashrt.nn.istft import PADDINGS, ISTFTHead
from flashrt.nn.reach import chain

__all__ = ["VocosConfig", "Vocos", "PRESETS", "ENCODEC_MODELS", "weight_map", "signature", "detect",
           "load_config", "FAMILY"]

VARIANTS = ("mel", "encodec")
INPUTS = ("features", "codes")


@dataclass(frozen=True)
class EncodecSpec:
    """What the EnCodec quantizer of one model contributes: frame rate, bins per codebook, dims."""

    sample_rate: int
    frame_rate: int
    bins: int = 1024
    dim: int = 128

    def codebooks(self, kbps: float) -> int:
        """Codebooks EnCodec uses at a bandwidth (its get_num_quantizers_for_bandwidth)."""
        return max(1, math.floor(kbps * 1000 / (self.frame_rate * math.log2(self.bins))))


ENCODEC_MODELS = {"encodec_24khz": EncodecSpec(24000, 75), "encodec_48khz": EncodecSpec(48000, 150)}


@dataclass(frozen=True)
class VocosConfig:
    """Vocos hyper-parameters (names follow the backbone/head ``init_args`` of config.yaml)."""

    variant: str = "mel"
    sample_rate: int = 24000
    input_channels: int = 100
    dim: int = 512
    intermediate_dim: int = 1536
    num_layers: int = 8
    layer_scale: bool = True
    adanorm_num_embeddings: int | None = None
    n_fft: int = 1024
    hop_length: int = 256
    padding: str = "center"
    encodec_model: str = "encodec_24khz"
    bandwidths: tuple[float, ...] = ()
    bandwidth_id: int | None = None
    input: str = "codes"

    def __post_init__(self) -> None:
        check_field_types(self, "vocos", zero_ok=("bandwidth_id",))
        if self.variant not in VARIANTS or self.padding not in PADDINGS or self.input not in INPUTS:
            raise ConfigError(f"vocos: variant {self.variant!r} {VARIANTS}, padding {self.padding!r} "
                              f"{PADDINGS}, input {self.input!r} {INPUTS}")
        if self.variant == "encodec":
            self._check_encodec()

    def _check_encodec(self) -> None:
        if self.encodec_model not in ENCODEC_MODELS or not self.bandwidths:
            raise ConfigError(f"vocos encodec: encodec_model {self.encodec_model!r} (one of "
                              f"{sorted(ENCODEC_MODELS)}) and a non-empty bandwidths list are required")
        if not self.adanorm_num_embeddings or not 0 <= self.bandwidth_index < self.adanorm_num_embeddings:
            raise ConfigError(f"vocos encodec: bandwidth_id {self.bandwidth_index} must index the "
                              f"{self.adanorm_num_embeddings} AdaLayerNorm embeddings")

    @property
    def uses_codes(self) -> bool:
        return self.variant == "encodec" and self.input == "codes"

    @property
    def encodec(self) -> EncodecSpec:
        return ENCODEC_MODELS[self.encodec_model]

    @property
    def bandwidth_index(self) -> int:
        return len(self.bandwidths) - 1 if self.bandwidth_id is None else self.bandwidth_id

    @property
    def n_codebooks(self) -> int:
        """K: codebooks consumed at the configured bandwidth."""
        return self.encodec.codebooks(self.bandwidths[self.bandwidth_index])

    @property
    def table_codebooks(self) -> int:
        """Codebooks in the checkpoint's table (for the highest bandwidth)."""
        return self.encodec.codebooks(max(self.bandwidths))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> VocosConfig:
        """From the parsed config.yaml (``feature_extractor``/``backbone``/``head`` with ``init_args``)."""
        try:
            fe, bb, hd = (d[k].get("init_args", {}) for k in ("feature_extractor", "backbone", "head"))
            kind = d["feature_extractor"]["class_path"].rsplit(".", 1)[-1]
            base = dict(input_channels=bb["input_channels"], dim=bb["dim"],
                        intermediate_dim=bb["intermediate_dim"], num_layers=bb["num_layers"],
                        adanorm_num_embeddings=bb.get("adanorm_num_embeddings"),
                        layer_scale=(bb.get("layer_scale_init_value") or 1 / bb["num_layers"]) > 0,
                        n_fft=hd["n_fft"], hop_length=hd["hop_length"], padding=hd.get("padding", "same"))
        except (KeyError, AttributeError, TypeError) as exc:
            raise ConfigError(f"vocos: config.yaml lacks {exc}; expected feature_extractor/backbone/head "
                              "sections with init_args") from None
        if kind == "EncodecFeatures":
            model = fe.get("encodec_model", "encodec_24khz")
            return cls(variant="encodec", encodec_model=model, sample_rate=ENCODEC_MODELS[model].sample_rate,
                       bandwidths=tuple(fe.get("bandwidths", (1.5, 3.0, 6.0, 12.0))), **base)
        if kind != "MelSpectrogramFeatures":
            raise ConfigError(f"vocos: unsupported feature extractor {kind!r}")
        return cls(variant="mel", sample_rate=fe.get("sample_rate", 24000), **base)

    @classmethod
    def from_yaml(cls, path: str | Path) -> VocosConfig:
        """From a config.yaml: a regular, size-capped file (`flashrt.io.files.read_yaml`)."""
        from flashrt.io.files import read_yaml

        return cls.from_dict(read_yaml(path, "vocos config.yaml"))


def load_config(path: str | Path) -> VocosConfig:
    """The config of a Vocos checkpoint folder (its config.yaml) or of a config.yaml path."""
    path = Path(path)
    found = path if path.suffix == ".yaml" else (path if path.is_dir() else path.parent) / "config.yaml"
    if not os.path.lexists(found):  # there but not a regular file: read_yaml says what it is
        raise CheckpointError(f"vocos: no config.yaml at {found}")
    return VocosConfig.from_yaml(found)


PRESETS: dict[str, VocosConfig] = {
    "tiny": VocosConfig(input_channels=20, dim=32, intermediate_dim=64, num_layers=2, n_fft=256,
                        hop_length=64),
    "tiny-encodec": VocosConfig(variant="encodec", input_channels=128, dim=32, intermediate_dim=64,
                                num_layers=2, adanorm_num_embeddings=2, n_fft=160, hop_length=40,
                                padding="same", bandwidths=(0.75, 1.5)),
    "mel-24khz": VocosConfig(),
    "encodec-24khz": VocosConfig(variant="encodec", input_channels=128, dim=384, intermediate_dim=1152,
                                 adanorm_num_embeddings=4, n_fft=1280, hop_length=320, padding="same",
                                 bandwidths=(1.5, 3.0, 6.0, 12.0)),
}


class Vocos(nn.Module):
    """features (B, C, T) [mel / encodec features] or K code tensors (B, T) -> audio (B, N)."""

    def __init__(self, cfg: VocosConfig) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.uses_codes:
            rows = cfg.table_codebooks * cfg.encodec.bins
            self.codebooks = nn.Parameter(torch.empty(rows, cfg.encodec.dim))
        self.embed_kernel = 7
        self.embed = FusedLinear(cfg.input_channels * self.embed_kernel, cfg.dim)  # the input conv, one GEMM
        ada = cfg.adanorm_num_embeddings
        self.norm = AdaLayerNorm(ada, cfg.dim) if ada else nn.LayerNorm(cfg.dim, eps=1e-6)
        self.blocks = nn.ModuleList(ConvNeXtBlock(cfg.dim, cfg.intermediate_dim, ada)
                                    for _ in range(cfg.num_layers))
        self.head = ISTFTHead(cfg.dim, cfg.n_fft, cfg.hop_length, cfg.padding)
        self.register_buffer("cond", torch.empty(1, dtype=torch.int64), persistent=False)

    def reset_derived(self) -> None:
        self.cond = torch.full((1,), self.cfg.bandwidth_index if self.cfg.adanorm_num_embeddings else 0)

    def codes_to_features(self, codes: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
        """K code tensors (B, T) -> features (B, T, C): sum_k table[k * V + codes[k]]."""
        bins = self.cfg.encodec.bins
        idx = torch.stack([c + k * bins for k, c in enumerate(codes)])  # (K, B, T)
        return F.embedding(idx, self.codebooks).sum(dim=0)

    def forward(self, *inputs: torch.Tensor, valid=EXACT) -> torch.Tensor:
        if self.cfg.uses_codes:
            x = self.codes_to_features(inputs).transpose(1, 2)  # (B, C, T)
        else:
            (x,) = inputs
        x = self.embed(_im2col(valid.zero(x), self.embed_kernel))  # (B, T, D)
        cond = self.cond if self.cfg.adanorm_num_embeddings else None
        x = self.norm(x, cond) if cond is not None else self.norm(x)
        cl_valid = channels_last(valid)
        x = zero_padding_cl_(x, cl_valid)  # blocks keep the padding zero from here on
        for block in self.blocks:
            x = block(x, cond, cl_valid)
        x = F.layer_norm(x, x.shape[-1:], eps=1e-6)  # affine folded into head.out
        return self.head(x, valid)

    def reach(self, rate: int = 1) -> Reach:
        """The input conv, the blocks' depthwise convs, the ISTFT's overlapping frames."""
        return Reach.conv(self.embed_kernel, 1, rate) + chain(self.blocks, rate) + self.head.reach(rate)


def _im2col(x: torch.Tensor, kernel: int) -> torch.Tensor:
    """(B, C, T) -> (B, T, C * k): the zero-padded "same" windows of a k-tap conv, ordered (c, tap)."""
    pad = (kernel - 1) // 2
    cols = F.pad(x, (pad, kernel - 1 - pad)).unfold(2, kernel, 1)  # (B, C, T, k)
    return cols.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)


def _conv_as_gemm(weight: torch.Tensor) -> torch.Tensor:
    """Conv1d weight (D, C, k) -> the (D, C * k) matrix applied to `_im2col` windows."""
    return weight.reshape(weight.shape[0], -1)


# ------------------------------------------------------------------------------ family plumbing

@functools.cache
def receptive_field(cfg: VocosConfig) -> Reach:
    """Frames one output sample depends on: the module's own `reach` (built on the meta device)."""
    return build_on_meta(lambda: Vocos(cfg)).reach()


def signature(cfg: VocosConfig) -> VocoderSignature:
    if cfg.uses_codes:
        high = cfg.encodec.bins - 1
        inputs = tuple(FeatureInput(f"codes.{k}", None, 1, high) for k in range(cfg.n_codebooks))
    else:
        inputs = (FeatureInput("features", cfg.input_channels),)
    trim = cfg.hop_length if cfg.padding == "center" else 0
    return VocoderSignature(inputs, cfg.hop_length, cfg.sample_rate, receptive_field(cfg).frames(), trim)


def weight_map(cfg: VocosConfig, checkpoint: Any = ()) -> WeightMap:
    """Strict map from the Vocos state dict (see the module docstring for every fold)."""
    b = "backbone.convnext.{i}"
    rules = [Rule("backbone.embed.weight", "embed.weight", _conv_as_gemm),
             Rule("backbone.embed.bias", "embed.bias"),
             Rule(f"{b}.dwconv.weight", "blocks.{i}.dwconv.weight", taps_last),
             Rule(f"{b}.dwconv.bias", "blocks.{i}.dwconv.bias"),
             Rule(("head.out.weight", "backbone.final_layer_norm.weight"), "head.out.weight",
                  fold_norm_weight),
             Rule(("head.out.weight", "head.out.bias", "backbone.final_layer_norm.bias"), "head.out.bias",
                  fold_norm_bias)]
    rules += _norm_rules(cfg) + _pointwise_rules(cfg)
    ignore = ["head.istft.window", "feature_extractor.mel_spec.*", "feature_extractor.encodec.*"]
    if cfg.uses_codes:
        rules.append(Rule("feature_extractor.codebook_weights", "codebooks"))
    else:
        ignore.append("feature_extractor.codebook_weights")
    return WeightMap(rules, ignore)


def _norm_rules(cfg: VocosConfig) -> list[Rule]:
    if cfg.adanorm_num_embeddings:
        return [Rule(f"{src}.norm.{p}.weight", f"{dst}norm.{p}.weight")
                for src, dst in (("backbone", ""), ("backbone.convnext.{i}", "blocks.{i}."))
                for p in ("scale", "shift")]
    return [Rule("backbone.norm.weight", "norm.weight"), Rule("backbone.norm.bias", "norm.bias")]


def _pointwise_rules(cfg: VocosConfig) -> list[Rule]:
    b, t = "backbone.convnext.{i}", "blocks.{i}"
    if cfg.adanorm_num_embeddings:  # the norm's scale/shift depend on the id: nothing to fold
        rules = [Rule(f"{b}.pwconv1.weight", f"{t}.pw1.weight"), Rule(f"{b}.pwconv1.bias", f"{t}.pw1.bias")]
    else:
        rules = [Rule((f"{b}.pwconv1.weight", f"{b}.norm.weight"), f"{t}.pw1.weight", fold_norm_weight),
                 Rule((f"{b}.pwconv1.weight", f"{b}.pwconv1.bias", f"{b}.norm.bias"), f"{t}.pw1.bias",
                      fold_norm_bias)]
    if cfg.layer_scale:
        return rules + [Rule((f"{b}.pwconv2.weight", f"{b}.gamma"), f"{t}.pw2.weight", fold_scale),
                        Rule((f"{b}.pwconv2.bias", f"{b}.gamma"), f"{t}.pw2.bias", fold_scale_bias)]
    return rules + [Rule(f"{b}.pwconv2.weight", f"{t}.pw2.weight"),
                    Rule(f"{b}.pwconv2.bias", f"{t}.pw2.bias")]


def detect(source: CheckpointSource) -> bool:
    """Vocos keys (ConvNeXt backbone + ISTFT head), or a config naming Vocos classes."""
    cfg = source.config or {}
    if cfg:
        return "vocos" in str(cfg.get("backbone", {}).get("class_path", "")).lower()
    return "backbone.convnext.0.pwconv1.weight" in source.keys and "head.out.weight" in source.keys


FAMILY = register_vocoder(VocoderFamily(
    name="vocos", presets=PRESETS, config_from_dict=VocosConfig.from_dict, build=Vocos,
    weight_map=weight_map, signature=signature, detect=detect,
    doc="Vocos mel (24 kHz) and EnCodec-features vocoders: ConvNeXt backbone + ISTFT head"))
