"""What every vocoder family declares: its module contract, `VocoderSignature`, registry entry, input checks.

A family (see `flashrt.frontends.vocoders` for the registry) supplies a module whose forward is

    module(*inputs, valid=EXACT[, offset=...]) -> (B, N) audio, N = frames * hop_length - trim_samples

with one tensor per `FeatureInput` of its `VocoderSignature` (float features (B, C, T*rate) or integer
codes (B, T*rate)), and ``valid`` a `flashrt.nn.audio.ValidLength` saying how many of the padded frames
are real (blocks mask or hold the padding so the real part equals an unpadded run), or `EXACT` when
nothing is padded. A module whose forward takes ``offset`` also gets the static ``offset`` buffer: the
absolute frame index of the first frame it decodes (0 for one-shot, the window start when streaming),
so position-dependent parts (SNAC's seeded noise) see the positions of the whole signal.

Shape legend: B batch, C feature channels, K codebooks, T frames, N audio samples.

Codes: an integer input is (B, T*rate) (or (T*rate,)); a family with K code inputs of one rate (Vocos
EnCodec: one per codebook) also takes them stacked as ONE (B, K, T) integer tensor (EnCodec's layout).

The loaded model's buffers, buckets and hot-path verbs are `flashrt.frontends.vocoders.frontend`
(`VocoderFrontend`); one-shot and streaming decode (windows, held partial frames, summation order,
``exact_stream``) are the stream runner's (runner/stream.py), and `flashrt.load_vocoder`
(runner/vocoder.py) joins the two.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from flashrt.errors import ConfigError, InputError

__all__ = ["FeatureInput", "VocoderSignature", "VocoderFamily", "CheckpointSource", "DEFAULT_BUCKETS",
           "DEFAULT_STREAM_CHUNK", "check_inputs"]

DEFAULT_BUCKETS = (64, 256, 1024)
DEFAULT_STREAM_CHUNK = 32


@dataclass(frozen=True)
class FeatureInput:
    """One model input. Float features are (B, channels, T*rate); integer codes (channels=None) (B, T*rate).

    ``rate`` is the number of steps of this input per frame (SNAC's finer code levels have 2, 4);
    ``high`` bounds integer codes (codebook size - 1).
    """

    name: str = "features"
    channels: int | None = 80
    rate: int = 1
    high: int | None = None

    @property
    def is_codes(self) -> bool:
        return self.channels is None


@dataclass(frozen=True)
class VocoderSignature:
    """What a family's module consumes and produces, and how far its outputs look around."""

    inputs: tuple[FeatureInput, ...]
    hop_length: int
    sample_rate: int
    context: tuple[int, int]          # (left, right) receptive field in whole frames
    trim_samples: int = 0             # audio samples = frames * hop_length - trim_samples

    def samples(self, frames: int) -> int:
        return frames * self.hop_length - self.trim_samples


@dataclass(frozen=True)
class CheckpointSource:
    """What detection sees: the path (None for in-memory weights), its config.json, the checkpoint keys."""

    path: Any
    config: Mapping[str, Any] | None
    keys: frozenset[str]


@dataclass(frozen=True)
class VocoderFamily:
    """A registry entry (see `flashrt.frontends.vocoders.register_vocoder`)."""

    name: str
    presets: Mapping[str, Any]
    config_from_dict: Callable[[Mapping[str, Any]], Any]
    build: Callable[[Any], nn.Module]
    weight_map: Callable[[Any, Mapping[str, torch.Tensor]], Any]
    signature: Callable[[Any], VocoderSignature]
    detect: Callable[[CheckpointSource], bool]
    default_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    default_stream_chunk: int = DEFAULT_STREAM_CHUNK
    doc: str = ""
    conv: str = "auto"                      # default `flashrt.nn.conv_policy` name on the CPU
    notes: Callable[[Any], list[str]] = lambda config: []   # what `describe()` should say about a config


# ------------------------------------------------------------------------------------------- input

def _as_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray) and value.dtype != object:
        return torch.from_numpy(np.ascontiguousarray(value))
    raise InputError(f"{name}: expected a tensor or numpy array, got {type(value).__name__}")


def _check_one(spec: FeatureInput, value: Any, partial: bool = False) -> torch.Tensor:
    """One input as (B, C, T) / (B, T), checked for layout, dtype, size and finiteness (``partial``: a
    stream chunk, which may hold no step of this input)."""
    t = _as_tensor(spec.name, value)
    want = 2 if spec.is_codes else 3
    if t.dim() == want - 1:
        t = t.unsqueeze(0)
    layout = "(B, T) codes" if spec.is_codes else f"(B, {spec.channels}, T) features"
    if t.dim() != want:
        raise InputError(f"{spec.name}: expected {layout}, got shape {tuple(t.shape)}")
    if not spec.is_codes and t.shape[1] != spec.channels:
        raise InputError(f"{spec.name}: expected {spec.channels} channels (mel bins) in dim 1, "
                         f"got {t.shape[1]} (shape {tuple(t.shape)})")
    if t.shape[0] == 0 or (t.shape[-1] == 0 and not partial):
        raise InputError(f"{spec.name}: empty input (shape {tuple(t.shape)})")
    return _check_values(spec, t) if t.shape[-1] else t


def _check_values(spec: FeatureInput, t: torch.Tensor) -> torch.Tensor:
    if spec.is_codes:
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise InputError(f"{spec.name}: codes must be integers, got {t.dtype}")
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or (spec.high is not None and hi > spec.high):
            raise InputError(f"{spec.name}: codes must lie in [0, {spec.high}], got [{lo}, {hi}]")
        return t
    if not t.is_floating_point():
        raise InputError(f"{spec.name}: features must be floating point, got {t.dtype}")
    if not bool(torch.isfinite(t).all()):
        raise InputError(f"{spec.name}: contains NaN or inf")
    return t


def as_tuples(value: Any) -> Any:
    """JSON lists (nested too) as tuples, for frozen config dataclasses read from config files."""
    return tuple(as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


CONFIG_INT_LIMIT = 1 << 24  # no size, rate or kernel of a vocoder comes near this


def check_field_types(cfg: Any, family: str, zero_ok: Sequence[str] = ()) -> None:
    """ConfigError naming the first field of the config dataclass ``cfg`` whose value does not match its
    annotation: ints (not bools) in [1, CONFIG_INT_LIMIT] (0 allowed for the ``zero_ok`` fields), finite
    numbers for floats, true/false for bools, strings, tuples of those, ``None`` where the type allows.
    Run first in each family config's ``__post_init__``, so a config.json / config.yaml value of the
    wrong type or an absurd size fails at load, naming the field, not deep inside module construction."""
    hints = _type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        problem = _type_problem(value, hints[f.name], f.name in zero_ok)
        if problem:
            raise ConfigError(f"{family}: {f.name}: expected {problem}, got {value!r}")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_problem(value: Any, hint: Any, zero_ok: bool = False) -> str | None:
    """What ``value`` should have been for annotation ``hint`` (None when it matches)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _type_problem(value, inner, zero_ok)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        ok = isinstance(value, tuple) and not any(_type_problem(v, args[0]) for v in value)
        return None if ok else f"a list, each entry {_describe(args[0])}"
    return _scalar_problem(value, hint, zero_ok)


def _scalar_problem(value: Any, hint: Any, zero_ok: bool) -> str | None:
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        lo = 0 if zero_ok else 1
        ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= CONFIG_INT_LIMIT
        return None if ok else f"an integer in [{lo}, {CONFIG_INT_LIMIT}]"
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok else "a finite number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    return None  # nested configs and other types check themselves


def _describe(hint: Any) -> str:
    return _type_problem(object(), hint) or str(hint)


def check_upsampler_pairs(family: str, cfg: Any) -> None:
    """HiFi-GAN-style generators: upsample rates/kernels and resblock kernels/dilations come in pairs."""
    if len(cfg.upsample_rates) != len(cfg.upsample_kernel_sizes) or \
            len(cfg.resblock_kernel_sizes) != len(cfg.resblock_dilation_sizes):
        raise ConfigError(f"{family}: upsample rates/kernels and resblock kernels/dilations must pair up")


def check_inputs(signature: VocoderSignature, values: Sequence[Any],
                 partial: bool = False) -> tuple[list[torch.Tensor], int]:
    """All inputs checked (nothing touched); returns them and the number of frames they span.

    ``partial`` (a stream chunk): the inputs need not be whole frames nor span the same frames (a
    caller may hand over a coarse code before the finer ones of its frame); the count returned is
    then the whole frames every input covers."""
    if len(values) == 1 and isinstance(values[0], (list, tuple)):
        values = values[0]
    values = _ungroup(signature, values)
    if len(values) != len(signature.inputs):
        names = [s.name for s in signature.inputs]
        raise InputError(f"expected {len(names)} input(s) {names}, got {len(values)}")
    tensors = [_check_one(spec, v, partial) for spec, v in zip(signature.inputs, values)]
    if partial:
        _same_batch(signature, tensors)
        return tensors, min(t.shape[-1] // s.rate for s, t in zip(signature.inputs, tensors))
    return tensors, _frames(signature, tensors)


def _groupable(signature: VocoderSignature) -> bool:
    """K > 1 code inputs of one rate and range (e.g. one per EnCodec codebook) can come stacked."""
    specs = signature.inputs
    return len(specs) > 1 and all(s.is_codes and (s.rate, s.high) == (specs[0].rate, specs[0].high)
                                  for s in specs)


def _ungroup(signature: VocoderSignature, values: Sequence[Any]) -> Sequence[Any]:
    """One stacked (B, K, T) integer tensor -> its K rows (B, T); anything else unchanged. (An unbatched
    (K, T) would read as K separate inputs' batch, so the stacked form always carries B.)"""
    stacked = len(values) == 1 and isinstance(values[0], (torch.Tensor, np.ndarray)) and values[0].ndim == 3
    if not stacked or not _groupable(signature):
        return values
    k, t = len(signature.inputs), _as_tensor("codes", values[0])
    if t.shape[1] != k:
        raise InputError(f"codes: expected (B, {k}, T) stacked codes (one row per codebook "
                         f"{[s.name for s in signature.inputs]}), got shape {tuple(t.shape)}")
    return t.unbind(1)


def _frames(signature: VocoderSignature, tensors: list[torch.Tensor]) -> int:
    frames, rem = divmod(tensors[0].shape[-1], signature.inputs[0].rate)
    for spec, t in zip(signature.inputs, tensors):
        if t.shape[-1] != frames * spec.rate or rem:
            raise InputError(f"input lengths {steps(signature, tensors)} do not match the rates "
                             f"{[s.rate for s in signature.inputs]} of one whole number of frames")
    _same_batch(signature, tensors)
    return frames


def steps(signature: VocoderSignature, tensors: Sequence[torch.Tensor]) -> dict[str, int]:
    """Steps (last axis) of each input, by name (for messages)."""
    return {s.name: t.shape[-1] for s, t in zip(signature.inputs, tensors)}


def _same_batch(signature: VocoderSignature, tensors: list[torch.Tensor]) -> None:
    first, batch = signature.inputs[0], tensors[0].shape[0]
    for spec, t in zip(signature.inputs, tensors):
        if t.shape[0] != batch:
            raise InputError(f"{spec.name}: batch {t.shape[0]} differs from {first.name}'s {batch}")
