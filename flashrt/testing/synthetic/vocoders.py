"""Synthetic (random-weight, seeded) vocoders: one checkpoint writer per family in its release layout,
and flashrt's own module filled directly. Used by the vocoder bench adapters (bench/adapters/vocoders.py),
bench/vocoders.py and the tests; never by `load_vocoder` (flashrt never decodes random weights unasked).

Writers ``WRITERS[family](cfg, folder, seed)`` build the family's reference package model at ``cfg``'s
sizes, randomize it (`randomize_`) and save it exactly as the releases ship it, so `load_vocoder`
reads the folder like a downloaded checkpoint and the package can load the same folder:

    hifigan   transformers SpeechT5HifiGan ``save_pretrained`` (config.json + model.safetensors)
    bigvgan   bigvgan ``_save_pretrained`` (config.json + bigvgan_generator.pt, weight_g / weight_v)
    vocos     vocos (config.yaml + pytorch_model.bin), mel features only
    snac      snac (config.json + pytorch_model.bin), noise blocks off

A writer raises ImportError where its package is missing and ConfigError for sizes the package
cannot express. `random_module` needs no package: flashrt's module with seeded random tensors in its
own layout (weights N(0, 1/fan_in), vectors 0.05 N(0, 1), snake alpha/beta 0.2 N(0, 1)).
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flashrt.errors import ConfigError
from flashrt.io import build_on_meta, expected_slots, meta_tensors, reset_derived

__all__ = ["WRITERS", "randomize_", "random_module", "save_vocos", "write_hifigan", "write_bigvgan",
           "write_vocos", "write_snac"]


def randomize_(module: torch.nn.Module, seed: int, gain: float = 1.0) -> None:
    """Weights ~ gain / sqrt(fan_in) (outputs in a normal range), biases ~ 0.05, snake params ~ 0.2 N(0,1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith(("alpha", "beta")):
                p.copy_(0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.05 * noise)
            else:
                p.copy_(gain * noise / (p[0].numel() ** 0.5))


def _lists(values: Any) -> Any:
    return [_lists(v) for v in values] if isinstance(values, tuple | list) else values


def write_hifigan(cfg: Any, folder: Path, seed: int) -> None:
    from transformers import SpeechT5HifiGan, SpeechT5HifiGanConfig

    if cfg.resblock != "1" or not cfg.conv_post_bias or cfg.normalize_before:
        raise ConfigError("transformers SpeechT5HifiGan is written with ResBlock1, a biased conv_post and "
                          "no input normalization; this preset differs")
    ref = SpeechT5HifiGan(SpeechT5HifiGanConfig(
        model_in_dim=cfg.in_channels, upsample_initial_channel=cfg.upsample_initial_channel,
        upsample_rates=_lists(cfg.upsample_rates), upsample_kernel_sizes=_lists(cfg.upsample_kernel_sizes),
        resblock_kernel_sizes=_lists(cfg.resblock_kernel_sizes),
        resblock_dilation_sizes=_lists(cfg.resblock_dilation_sizes), leaky_relu_slope=cfg.leaky_relu_slope,
        sampling_rate=cfg.sample_rate, normalize_before=False)).eval()
    randomize_(ref, seed)
    ref.save_pretrained(folder)


BIGVGAN_KEYS = ("num_mels", "upsample_initial_channel", "upsample_rates", "upsample_kernel_sizes",
                "resblock", "resblock_kernel_sizes", "resblock_dilation_sizes", "activation",
                "snake_logscale", "use_tanh_at_final", "use_bias_at_final")


def write_bigvgan(cfg: Any, folder: Path, seed: int) -> None:
    from bigvgan.bigvgan import BigVGAN
    from bigvgan.env import AttrDict

    h = {k: _lists(getattr(cfg, k)) for k in BIGVGAN_KEYS} | {"sampling_rate": cfg.sample_rate}
    ref = BigVGAN(AttrDict(h), use_cuda_kernel=False).eval()
    randomize_(ref, seed)
    folder.mkdir(parents=True, exist_ok=True)
    ref._save_pretrained(folder)  # {"generator": state dict with weight_g / weight_v} + config.json


def vocos_yaml(cfg: Any) -> dict[str, Any]:
    """The config.yaml of a mel Vocos at ``cfg``'s sizes."""
    if cfg.variant != "mel":
        raise ConfigError("the vocos writer builds mel Vocos only (EnCodec features would need the EnCodec "
                          "weights)")
    return {"feature_extractor": {"class_path": "vocos.feature_extractors.MelSpectrogramFeatures",
                                  "init_args": {"sample_rate": cfg.sample_rate, "n_fft": cfg.n_fft,
                                                "hop_length": cfg.hop_length, "n_mels": cfg.input_channels,
                                                "padding": cfg.padding}},
            "backbone": {"class_path": "vocos.models.VocosBackbone",
                         "init_args": {"input_channels": cfg.input_channels, "dim": cfg.dim,
                                       "intermediate_dim": cfg.intermediate_dim,
                                       "num_layers": cfg.num_layers}},
            "head": {"class_path": "vocos.heads.ISTFTHead",
                     "init_args": {"dim": cfg.dim, "n_fft": cfg.n_fft, "hop_length": cfg.hop_length,
                                   "padding": cfg.padding}}}


def save_vocos(ref: torch.nn.Module, config: dict, folder: Path) -> None:
    """A `vocos.Vocos` saved as the releases ship it: config.yaml + pytorch_model.bin."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    sd = {k: v for k, v in ref.state_dict().items() if not k.startswith("feature_extractor.encodec.")}
    torch.save(sd, folder / "pytorch_model.bin")


def write_vocos(cfg: Any, folder: Path, seed: int) -> None:
    import yaml
    from vocos import Vocos

    config = vocos_yaml(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "c.yaml").write_text(yaml.safe_dump(config))
        ref = Vocos.from_hparams(str(Path(tmp) / "c.yaml")).eval()
    randomize_(ref, seed)
    save_vocos(ref, config, folder)


SNAC_KEYS = ("sampling_rate", "encoder_dim", "encoder_rates", "latent_dim", "decoder_dim", "decoder_rates",
             "attn_window_size", "codebook_size", "codebook_dim", "vq_strides", "noise", "depthwise")


def write_snac(cfg: Any, folder: Path, seed: int) -> None:
    from snac import SNAC

    if cfg.noise:
        raise ConfigError("SNAC's noise blocks draw random numbers; the writer writes noise off")
    config = {k: _lists(getattr(cfg, k)) for k in SNAC_KEYS}
    torch.manual_seed(seed)
    ref = SNAC(**config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(ref.state_dict(), folder / "pytorch_model.bin")


WRITERS: dict[str, Callable[[Any, Path, int], None]] = {
    "hifigan": write_hifigan, "bigvgan": write_bigvgan, "vocos": write_vocos, "snac": write_snac}


# Per-family gain on the random weight matrices. SNAC: torch's default init variance, 1 / (3 fan_in), as
# the snac package's own random model has; with 1 / fan_in its residual stacks carry activations ~2,000,
# where an unfused linear + add (the onnxrt export) rounds 3e-4 off the fused one (1.8e-7 with the gain).
WEIGHT_GAIN = {"snac": 1 / math.sqrt(3.0)}


def random_module(family: Any, cfg: Any, seed: int, device: str, dtype: torch.dtype,
                  gain: float | None = None) -> torch.nn.Module:
    """flashrt's module for `cfg` with seeded random weights in its own layout (built on meta, filled,
    derived buffers computed): weights N(0, 1/fan_in) times ``gain`` (default: the family's
    `WEIGHT_GAIN`), vectors 0.05 N(0, 1), snake alpha/beta 0.2 N(0, 1)."""
    module = build_on_meta(lambda: family.build(cfg))
    g = torch.Generator().manual_seed(seed)
    slots = expected_slots(module, dtype)
    gain = WEIGHT_GAIN.get(family.name, 1.0) if gain is None else gain
    tensors = {name: _random_like(name, slot, g, gain).to(device) for name, slot in slots.items()}
    module.load_state_dict(tensors, strict=True, assign=True)
    reset_derived(module, device)
    if meta_tensors(module):
        raise ConfigError(f"{family.name}: tensors left on meta: {meta_tensors(module)[:5]}")
    return module.eval().requires_grad_(False)


def _random_like(name: str, slot: torch.Tensor, g: torch.Generator, gain: float = 1.0) -> torch.Tensor:
    if not slot.dtype.is_floating_point:
        return torch.zeros(slot.shape, dtype=slot.dtype)
    noise = torch.randn(slot.shape, generator=g)
    if name.endswith(("alpha", "beta")):
        noise = 0.2 * noise
    elif slot.dim() <= 1:
        noise = 0.05 * noise
    else:
        noise = noise * (gain / math.sqrt(max(slot[0].numel(), 1)))
    return noise.to(slot.dtype)
