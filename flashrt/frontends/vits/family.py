"""The "vits" TTS family: Piper voices (an .onnx with its .onnx.json, a folder, or a voice package)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flashrt.errors import CheckpointError
from flashrt.frontends.registry import TtsFamily

__all__ = ["FAMILY", "detect", "load"]


def detect(source: str | Path) -> None:
    """None when `source` names a Piper/VITS voice; CheckpointError saying why not otherwise."""
    from flashrt.frontends.vits.voice import find_voice
    from flashrt.io.files import read_json

    files = find_voice(source)
    config = read_json(files.config, "voice config")
    if "phoneme_id_map" not in config:
        raise CheckpointError(f"{files.config}: no phoneme_id_map, not a Piper voice config")


def load(source: str | Path, **options: Any) -> Any:
    from flashrt.frontends.vits.voice import load_voice

    return load_voice(source, **options)


FAMILY = TtsFamily(
    name="vits",
    detect=detect,
    load=load,
    options=("config", "conv", "phoneme_buckets", "frame_buckets", "capture", "threads", "slots", "g2pw_dir",
             "decoder_precision"),
    doc="Piper / VITS voices (espeak-ng phonemes, VITS prior, HiFi-GAN decoder)",
)
