"""An Orpheus-style folder: whether a folder is one (`detect`, the "orpheus" entry of
`flashrt.frontends.registry.TTS_FAMILIES`), where its SNAC decoder is, and its token layout checked
against its LM's vocabulary. `flashrt.runner.orpheus.load_orpheus` loads what these find."""

from __future__ import annotations

from pathlib import Path

from flashrt.errors import CheckpointError
from flashrt.frontends.lm.frontend import read_config
from flashrt.frontends.orpheus.layout import OrpheusLayout, read_layout
from flashrt.io.files import read_json

__all__ = ["detect", "folder_layout", "snac_codebook", "snac_folder"]


def snac_folder(folder: Path, given: str | Path | None) -> Path:
    snac = Path(given) if given else folder / "snac"
    if not (snac / "config.json").is_file():
        raise CheckpointError(f"no SNAC decoder at {snac} (put it in <model>/snac/ or pass snac=<folder>)")
    return snac


def snac_codebook(snac: Path) -> tuple[int, int]:
    """(codebook size, sampling rate) of a SNAC config.json."""
    cfg = read_json(snac / "config.json", "SNAC config")
    try:
        return int(cfg.get("codebook_size", 4096)), int(cfg.get("sampling_rate", 24000))
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{snac}/config.json: not a readable SNAC config ({exc})") from None


def detect(source: str | Path) -> None:
    """None for an Orpheus-style folder: a transformers causal LM whose vocabulary holds Orpheus' audio
    codes (the codebook of its snac/ decoder if there is one, else SNAC 24 kHz's 4096)."""
    folder = Path(source)
    if not folder.is_dir():
        raise CheckpointError(f"{source}: not a folder")
    snac = folder / "snac"
    folder_layout(folder, snac_codebook(snac)[0] if (snac / "config.json").is_file() else 4096)


def folder_layout(folder: Path, codebook: int) -> OrpheusLayout:
    """The folder's token layout, checked against its LM's vocabulary."""
    vocab, layout = read_config(folder).vocab_size, read_layout(folder, codebook)
    if vocab < layout.vocab_needed:
        raise CheckpointError(f"{folder}: vocabulary {vocab} has no room for Orpheus' audio codes (needs "
                              f"{layout.vocab_needed}: ids from {layout.audio_base}, 7 x {codebook})")
    return layout
