"""Validation of a Piper voice config (``.onnx.json``) at load: every field flashrt reads is checked for
its type and range, and a bad one is a CheckpointError naming the file and the field, so a malformed
voice fails once at load instead of at every call (or inside `flashrt say`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from flashrt.errors import CheckpointError
from flashrt.frontends.vits.phonemes import PHONEME_TYPES, REFUSED_TYPES

__all__ = ["check_voice_config", "PHONEME_TYPES"]
RATE_RANGE = (1000, 192_000)


def check_voice_config(data: Mapping[str, Any], where: str) -> None:
    """CheckpointError naming ``where`` and the first bad field of a Piper voice config."""

    def bad(field: str, why: str) -> CheckpointError:
        return CheckpointError(f"voice config {where}: {field} {why}")

    audio = _mapping(data, "audio", bad)
    if "sample_rate" in audio:
        _int(audio["sample_rate"], "audio.sample_rate", bad, *RATE_RANGE)
    if "quality" in audio and not isinstance(audio["quality"], str):
        raise bad("audio.quality", f"must be a string, got {audio['quality']!r}")
    symbols = _int(data["num_symbols"], "num_symbols", bad, 1, 1 << 20) if "num_symbols" in data else None
    speakers = _int(data.get("num_speakers", 1), "num_speakers", bad, 1, 1 << 16)
    _phoneme_map(data.get("phoneme_id_map"), symbols, bad)
    _phonemes(data, bad)
    _inference(_mapping(data, "inference", bad), bad)
    for name, sid in _mapping(data, "speaker_id_map", bad).items():
        _int(sid, f"speaker_id_map[{name!r}]", bad, 0, speakers - 1)
    if data.get("default_speaker_id") is not None:
        _int(data["default_speaker_id"], "default_speaker_id", bad, 0, speakers - 1)


def _mapping(data: Mapping[str, Any], field: str, bad) -> Mapping[str, Any]:
    value = data.get(field)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise bad(field, f"must be a mapping, got {type(value).__name__}")
    return value


def _int(value: Any, field: str, bad, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(field, f"must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise bad(field, f"{value} is outside [{lo}, {hi}]")
    return value


def _phoneme_map(table: Any, symbols: int | None, bad) -> None:
    if not isinstance(table, Mapping) or not table:
        raise bad("phoneme_id_map", "must be a non-empty mapping of phoneme -> list of ids")
    for key in ("_", "^", "$"):
        if key not in table:
            raise bad("phoneme_id_map", f"lacks {key!r} (pad, bos, eos)")
    top = (symbols - 1) if symbols is not None else (1 << 20)
    for phoneme, ids in table.items():
        field = f"phoneme_id_map[{phoneme!r}]"
        if not isinstance(phoneme, str) or not phoneme:
            raise bad(field, "keys must be non-empty strings")
        if not isinstance(ids, list) or not ids:
            raise bad(field, f"must be a non-empty list of ids, got {ids!r}")
        for i in ids:
            _int(i, field, bad, 0, top)


def _phonemes(data: Mapping[str, Any], bad) -> None:
    kind = data.get("phoneme_type", "espeak")
    if kind not in PHONEME_TYPES:
        why = f" ({REFUSED_TYPES[kind]})" if kind in REFUSED_TYPES else ""
        raise bad("phoneme_type", f"{kind!r} is not one of {PHONEME_TYPES}{why}")
    if kind == "espeak":
        voice = _mapping(data, "espeak", bad).get("voice")
        if not isinstance(voice, str) or not voice.strip():
            raise bad("espeak.voice", f"must name an espeak-ng voice, got {voice!r}")
    clusters = data.get("vowel_clusters") or []
    if not isinstance(clusters, list) or not all(
            isinstance(c, list | str) and all(isinstance(p, str) for p in c) for c in clusters):
        raise bad("vowel_clusters", "must be a list of phoneme sequences")


def _inference(inference: Mapping[str, Any], bad) -> None:
    for name, lo in (("noise_scale", 0.0), ("noise_w", 0.0), ("length_scale", 1e-3)):
        if name not in inference:
            continue
        value = inference[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise bad(f"inference.{name}", f"must be a finite number, got {value!r}")
        if not lo <= value <= 100:
            raise bad(f"inference.{name}", f"{value} is outside [{lo:g}, 100]")
