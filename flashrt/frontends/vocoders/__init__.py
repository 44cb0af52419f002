"""Vocoder families: their registry, model cards, checkpoint detection, and the module loader.

The user-facing loader is `flashrt.load_vocoder` (runner/vocoder.py: this package's
`load_vocoder_module` + a `VocoderFrontend` + the stream runner); here is what it resolves:

* ``path_or_card``: a checkpoint folder or file as the releases ship them, its config read from the same
  folder: transformers ``save_pretrained`` (config.json + model.safetensors: SpeechT5HifiGan), jik876 /
  BigVGAN (config.json + ``{"generator": state_dict}`` .pt: ``generator.pt``, ``bigvgan_generator.pt``),
  Vocos (config.yaml + pytorch_model.bin), SNAC (config.json + pytorch_model.bin); or a card name from
  ``models/`` or a ``.toml`` path; or an in-memory mapping of tensors; or a Hugging Face hub id
  (``hubertsiuzdak/snac_24khz``, also as a card's ``checkpoint=``) found in the local hub cache
  (`flashrt.io.hub`; ``allow_download=True`` to fetch it, ``HF_HUB_OFFLINE`` honoured).
* Family: ``family=`` if given (and the checkpoint must not look like another family: CheckpointError),
  else the card's ``family``, else the one registered family whose ``detect`` accepts the checkpoint
  (its config.json / config.yaml, else its keys); none or several: CheckpointError.
* Config: ``config=`` (a preset name or a config object) > the card (``preset`` + ``[config]``
  overrides) > the checkpoint's config.json / config.yaml (``family.config_from_dict``); weights with
  neither (e.g. a bare VITS ``dec.*`` state dict): CheckpointError asking for ``config=``. Then
  ``overrides=`` replaces fields of whichever was picked (unknown field: ConfigError), e.g. SNAC's
  ``{"noise_mode": "seeded"}``.
* Cards name sizes, never weights: a card is loaded with ``checkpoint=<folder or file>`` (or a card
  whose ``[weights] path`` names one); without either it is a CheckpointError. flashrt never decodes
  with random or uninitialised weights (the benchmarks make their random weights explicitly).
* Weights: always mapped strictly through the family's WeightMap (missing/unexpected/mis-shaped keys in
  one CheckpointError), weight norm folded once, PyTorch files opened with ``weights_only=True``.
* precision: the one vocabulary of `flashrt.quant.precision.compute_dtype` ("fp32" / "float32",
  "bf16" / "bfloat16", "fp16" / "float16" / "half", or a torch dtype): module and activations; audio
  comes back float32.
* conv: how the convolutions run on the CPU, a `flashrt.nn.conv_policy` name; None takes the family's
  default (``VocoderFamily.conv``). ``"auto"`` (HiFi-GAN, Vocos, SNAC) runs the wide float32 convs as
  block-spectral convs where that measured faster (`flashrt.nn.spectral_conv.MEASURED_RULES`: kernels
  >= 7 at 64, 128 or 256 channels, calls of at least 24 block rows, a second short-call plan at 256
  channels; up to 2.2x per conv; the kernel
  spectra cost memory, ``describe()`` says how much); ``"invariant"`` (BigVGAN) computes every
  sample in an order independent of the sequence's length and start, so ``stream()`` equals the
  one-shot call bit for bit; ``"direct"`` keeps oneDNN everywhere; ``"spectral"`` forces every
  eligible float32 conv spectral. No effect on a GPU.
* Snake sines (BigVGAN): a float32 CPU module's snakes take the sine measured faster on this CPU at
  load (`flashrt.nn.alias_free.pick_sine`: NumPy's or ATen's; plain eager calls only, a recorded graph
  holds ATen's; the op `flashrt.nn.alias_free.SNAKE_SINE`); ``flashrt.ops.select(voc.module, "cpu",
  prefer={"snake_sine": "aten"})`` sets it back.
* Anti-aliased activations (BigVGAN): a float32 CPU module runs each one (2x up, snake, 2x down) as
  one pass of a C kernel built with this machine's compiler on first use (`flashrt.ops.csrc_cpu`;
  several times faster than the torch form per activation; the op `flashrt.nn.alias_free.AA_SNAKE`);
  without a compiler, the torch form. ``prefer={"aa_snake": "torch"}`` sets it back.

Registering a family (how vocos.py / snac.py plug in; import-time, no other side effects)::

    from flashrt.frontends.vocoders import register_vocoder
    from flashrt.frontends.vocoders.base import VocoderFamily, VocoderSignature, FeatureInput

    register_vocoder(VocoderFamily(
        name="vocos",
        presets=PRESETS,                       # name -> frozen config dataclass (include "tiny")
        config_from_dict=VocosConfig.from_dict,
        build=lambda cfg: Vocos(cfg),          # run under the meta device by load_module
        weight_map=weight_map,                 # (cfg, checkpoint) -> flashrt.io.WeightMap
        signature=signature,                   # cfg -> VocoderSignature(inputs, hop, sr, context, trim)
        detect=detect,                         # CheckpointSource(path, config, keys) -> bool
    ))

and add the module path to `_FAMILY_MODULES` below so the loader imports it on demand. The module's
forward is ``forward(*inputs, valid=EXACT[, offset]) -> (B, N)``; see `flashrt.frontends.vocoders.base`
for the full contract and `flashrt.nn.audio.ValidLength` for what ``valid`` must do.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from flashrt import ops
from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.vocoders.base import CheckpointSource, VocoderFamily
from flashrt.frontends.vocoders.frontend import VocoderFrontend
from flashrt.io import Checkpoint, load_module, open_checkpoint
from flashrt.io.hub import resolve_checkpoint
from flashrt.nn.conv_policy import POLICIES as CONV_POLICIES
from flashrt.nn.conv_policy import apply_conv_policy
from flashrt.quant.precision import compute_dtype
from flashrt.resources import list_data, read_data

__all__ = ["load_vocoder_module", "prepare_module", "load_vocoder_frontend", "LoadedVocoder",
           "register_vocoder", "get_family", "families", "read_card", "checkpoint_config", "VocoderFamily",
           "VocoderFrontend"]

_FAMILY_MODULES = {
    "hifigan": "flashrt.frontends.vocoders.hifigan",
    "bigvgan": "flashrt.frontends.vocoders.bigvgan",
    "vocos": "flashrt.frontends.vocoders.vocos",
    "snac": "flashrt.frontends.vocoders.snac",
}
_REGISTRY: dict[str, VocoderFamily] = {}
CARD_KEYS = {"family", "preset", "description", "config", "source", "weights", "runtime", "reference"}


def register_vocoder(family: VocoderFamily, replace: bool = False) -> VocoderFamily:
    """Add a family under ``family.name`` (ConfigError if taken, unless replace=True)."""
    if family.name in _REGISTRY and not replace and _REGISTRY[family.name] is not family:
        raise ConfigError(f"vocoder family {family.name!r} is already registered")
    _REGISTRY[family.name] = family
    return family


def _import_families() -> None:
    for name, module in _FAMILY_MODULES.items():
        if name in _REGISTRY:
            continue
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:  # a family not written yet is simply not available
            if exc.name != module:
                raise


def families() -> dict[str, VocoderFamily]:
    """Every available family, by name."""
    _import_families()
    return dict(_REGISTRY)


def get_family(name: str) -> VocoderFamily:
    known = families()
    if name not in known:
        raise ConfigError(f"unknown vocoder family {name!r}; known: {sorted(known)}")
    return known[name]


# ------------------------------------------------------------------------------------------ cards

def read_card(name_or_path: str | Path) -> dict[str, Any]:
    """A model card as a dict: ``family``, ``preset``, optional ``[config]``/``[weights]``/``[runtime]``."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        cards = list_data("models")
        if str(name_or_path) not in cards:
            raise ConfigError(f"no model card {name_or_path!r}; vocoder cards: "
                              f"{sorted(c for c in cards if _is_vocoder_card(cards[c]))}")
    card = read_data("models", name_or_path)  # regular files only, size-capped: ConfigError naming it
    unknown = set(card) - CARD_KEYS
    if unknown or "family" not in card:
        raise ConfigError(f"card {name_or_path}: needs 'family'; unknown keys {sorted(unknown)}")
    return card


def _is_vocoder_card(path: Path) -> bool:
    try:
        return read_data("models", path).get("family") in _FAMILY_MODULES
    except ConfigError:
        return False


def _looks_like_card(source: Any) -> bool:
    if not isinstance(source, (str, Path)):
        return False
    path = Path(source)
    return path.suffix == ".toml" or (not path.exists() and str(source) in list_data("models"))


def config_for(family: VocoderFamily, preset: Any = None, overrides: Mapping[str, Any] | None = None) -> Any:
    """A family config from a preset name (or config object) plus field overrides (unknown: ConfigError)."""
    if preset is None or isinstance(preset, str):
        if preset not in family.presets:
            raise ConfigError(f"{family.name}: unknown preset {preset!r}; presets: {sorted(family.presets)}")
        preset = family.presets[preset]
    overrides = dict(overrides or {})
    fields = {f.name for f in dataclasses.fields(preset)}
    if set(overrides) - fields:
        raise ConfigError(f"{family.name}: unknown config keys {sorted(set(overrides) - fields)}")
    return dataclasses.replace(preset, **_tuplify(overrides))


def _tuplify(d: Mapping[str, Any]) -> dict[str, Any]:
    fix = lambda v: tuple(fix(x) for x in v) if isinstance(v, list) else v
    return {k: fix(v) for k, v in d.items()}


# --------------------------------------------------------------------------------- checkpoints

CONFIG_FILES = ("config.json", "config.yaml")


def checkpoint_config(path: str | Path) -> dict[str, Any] | None:
    """The config stored next to a checkpoint (a folder, or a file in it): ``config.json``, else
    ``config.yaml`` (Vocos' release form), parsed; None when there is neither. Unparsable: CheckpointError."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    for name in CONFIG_FILES:
        found = folder / name
        if os.path.lexists(found):  # a config that is there but not a regular file is refused, not skipped
            return _parse_config(found)
    return None


def _parse_config(path: Path) -> dict[str, Any]:
    from flashrt.io.files import read_json, read_yaml

    read = read_json if path.suffix == ".json" else read_yaml
    return read(path, f"vocoder {path.suffix[1:]} config")


def _open(source: Any, allow_download: bool = False) -> tuple[Checkpoint, Mapping[str, Any] | None, Any]:
    """(checkpoint, its config.json / config.yaml or None, path or None). A hub id that is not a local
    path (``hubertsiuzdak/snac_24khz``) is its snapshot in the Hugging Face cache (`flashrt.io.hub`)."""
    if isinstance(source, Checkpoint):
        return source, None, None
    if isinstance(source, Mapping):
        return Checkpoint.from_tensors(source), None, None
    path = resolve_checkpoint(source, allow_download) if isinstance(source, str) else Path(source)
    config = checkpoint_config(path) if path.exists() else None
    return open_checkpoint(path), config, path


def detect_family(source: CheckpointSource) -> list[str]:
    """Names of the families whose detector accepts this checkpoint."""
    return [name for name, fam in families().items() if fam.detect(source)]


def _resolve_family(requested: str | None, source: CheckpointSource) -> VocoderFamily:
    found = detect_family(source)
    where = source.path or "the given weights"
    if requested is not None:
        if found and requested not in found:
            raise CheckpointError(f"{where} looks like a {'/'.join(found)} checkpoint, not {requested!r}")
        return get_family(requested)
    if len(found) != 1:
        what = "no known vocoder family" if not found else f"several families ({found})"
        raise CheckpointError(f"{where}: matches {what}; pass family= (known: {sorted(families())})")
    return get_family(found[0])


# -------------------------------------------------------------------------------------- loading

@dataclasses.dataclass(frozen=True)
class LoadedVocoder:
    """A family's module with its weights mapped and assigned: what a frontend is built from.
    ``runtime`` is the card's ``[runtime]`` table (buckets, stream_chunk), empty without a card."""

    family: VocoderFamily
    config: Any
    module: torch.nn.Module
    dtype: torch.dtype
    runtime: Mapping[str, Any]


def load_vocoder_module(
    path_or_card: Any,
    device: str | torch.device = "cpu",
    precision: str | torch.dtype = "fp32",
    *,
    family: str | None = None,
    config: Any = None,
    checkpoint: Any = None,
    conv: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    allow_download: bool = False,
) -> LoadedVocoder:
    """Resolve the family and config, map the weights strictly, apply the conv policy (module docstring).
    A hub id is read from the local Hugging Face cache; ``allow_download=True`` lets `huggingface_hub`
    fetch it (it still honours ``HF_HUB_OFFLINE``)."""
    dtype = compute_dtype(precision)
    if conv is not None and conv not in CONV_POLICIES:
        raise ConfigError(f"conv {conv!r}; choose one of {sorted(CONV_POLICIES)}")
    card: dict[str, Any] = {}
    if _looks_like_card(path_or_card):
        card = read_card(path_or_card)
        family = family or card["family"]
        path_or_card = checkpoint or card.get("weights", {}).get("path")
        if path_or_card is None:
            raise CheckpointError(f"card {card.get('preset')!r} of {family} names no weight file; "
                                  "pass checkpoint=<dir or file>")
    ckpt, ckpt_config, path = _open(path_or_card, allow_download)
    fam = _resolve_family(family, CheckpointSource(path, ckpt_config, frozenset(ckpt.keys())))
    cfg = _pick_config(fam, config, card, ckpt_config)
    cfg = config_for(fam, cfg, overrides) if overrides else cfg
    module = load_module(lambda: fam.build(cfg), ckpt, fam.weight_map(cfg, ckpt), device=device, dtype=dtype)
    prepare_module(fam, module, device, dtype, conv)
    return LoadedVocoder(fam, cfg, module, dtype, card.get("runtime", {}))


def prepare_module(fam: VocoderFamily, module: torch.nn.Module, device: str | torch.device,
                   dtype: torch.dtype, conv: str | None = None) -> torch.nn.Module:
    """The load-time choices every vocoder module gets, however its weights came (a checkpoint, or
    `flashrt.testing.synthetic.vocoders.random_module`): the conv policy (``conv``, else the family's
    default) and, for CPU float32, the measured snake sine and the native anti-aliased activation
    kernel where the machine builds it, both picked by the one `flashrt.ops.select` pass (the ops
    `flashrt.nn.alias_free.SNAKE_SINE`, `AA_SNAKE`). Returns ``module``."""
    apply_conv_policy(module, CONV_POLICIES[conv or fam.conv])
    ops.select(module, device, dtype)
    return module


def load_vocoder_frontend(
    path_or_card: Any,
    device: str | torch.device = "cpu",
    precision: str | torch.dtype = "fp32",
    backend: str | None = None,
    buckets: Sequence[int] | None = None,
    *,
    batch: int = 1,
    strict: bool = False,
    capture: bool = True,
    **options: Any,
) -> VocoderFrontend:
    """A `VocoderFrontend` (no runner): `load_vocoder_module` (``options``: family, config, checkpoint,
    conv, overrides) with these buckets (None: the card's, else the family's), captured unless
    ``capture=False``."""
    loaded = load_vocoder_module(path_or_card, device, precision, **options)
    fe = VocoderFrontend(loaded.family, loaded.config, loaded.module, device=device, backend=backend,
                         buckets=buckets or loaded.runtime.get("buckets"), batch=batch, strict=strict,
                         dtype=loaded.dtype)
    return fe.capture() if capture else fe


def _pick_config(fam: VocoderFamily, config: Any, card: Mapping[str, Any], ckpt_config: Any) -> Any:
    if config is not None and not isinstance(config, str):
        return config
    if config is not None or card:
        return config_for(fam, config or card.get("preset"), None if config else card.get("config"))
    if ckpt_config is None:
        raise CheckpointError(f"{fam.name}: the checkpoint has no config.json / config.yaml; pass "
                              f"config=<preset or config> (presets: {sorted(fam.presets)}) or a model card")
    return fam.config_from_dict(ckpt_config)
