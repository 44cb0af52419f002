"""Piper voices by their catalogue names (``en_US-lessac-medium``), found on this machine, never downloaded.

A catalogue name is ``<language>_<REGION>-<dataset>-<quality>`` (quality: x_low, low, medium, high).
Where it is looked up, in this order (`search_path`; the first folder that has it wins):

    1. the folders given: ``voices_dir=`` / ``--voices-dir`` (several allowed, in their order)
    2. piper's default data folder: the working directory (``piper --data-dir`` defaults to it, and
       ``python -m piper.download_voices NAME`` writes there)
    3. the Hugging Face cache of ``rhasspy/piper-voices`` (what ``hf download rhasspy/piper-voices
       --include 'en/en_US/lessac/medium/*'`` leaves there), read from the cache only

In a folder a voice is either flat, ``<folder>/<name>.onnx`` with ``<name>.onnx.json`` beside it (what
piper downloads), or in the catalogue's own tree, ``<folder>/<language>/<language>_<REGION>/<dataset>/
<quality>/<name>.onnx`` (a copy of the rhasspy/piper-voices repository). After the folders come the
installed voice packages (`flashrt.frontends.vits.voice.VOICE_PACKAGES`). A name found nowhere is a
`CheckpointError` listing every place searched.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["CATALOGUE_NAME", "HUB_REPO", "search_path", "layouts", "find_in_folders", "find_in_hub_cache",
           "is_catalogue_name"]

CATALOGUE_NAME = re.compile(
    r"^(?P<language>[a-z]{2,3})_(?P<region>[A-Z]{2})-(?P<dataset>[A-Za-z0-9_]+)-(?P<quality>x_low|low|medium|high)$"
)
HUB_REPO = "rhasspy/piper-voices"


def is_catalogue_name(name: str) -> bool:
    return CATALOGUE_NAME.match(name) is not None


def search_path(voices_dir: str | Path | Sequence[str | Path] | None = None) -> list[Path]:
    """The folders a name is looked up in: the ones given, then piper's default (the working directory)."""
    if voices_dir is None:
        given: Iterable[str | Path] = ()
    elif isinstance(voices_dir, str | Path):
        given = (voices_dir,)
    else:
        given = voices_dir
    folders = [Path(folder).expanduser() for folder in given]
    return [*folders, Path.cwd()]


def layouts(name: str) -> list[str]:
    """The places of `name`'s model file inside a voice folder: flat, then the catalogue's tree."""
    flat = f"{name}.onnx"
    parts = CATALOGUE_NAME.match(name)
    if parts is None:
        return [flat]
    language, region = parts["language"], parts["region"]
    return [flat, f"{language}/{language}_{region}/{parts['dataset']}/{parts['quality']}/{flat}"]


def find_in_folders(name: str, folders: Sequence[Path]) -> tuple[Path, Path] | None:
    """(model, config) of the first folder that holds `name` with its ``.onnx.json``."""
    for folder in folders:
        for place in layouts(name):
            model = folder / place
            config = model.with_name(model.name + ".json")
            if model.is_file() and config.is_file():
                return model, config
    return None


def find_in_hub_cache(name: str) -> tuple[Path, Path] | None:
    """(model, config) of `name` in the local Hugging Face cache of `HUB_REPO` (never downloads)."""
    from flashrt.io.hub import hub_file

    place = layouts(name)[-1]
    if place == layouts(name)[0]:  # not a catalogue name: the repository has no flat voices
        return None
    model, config = hub_file(HUB_REPO, place), hub_file(HUB_REPO, place + ".json")
    return (model, config) if model is not None and config is not None else None
