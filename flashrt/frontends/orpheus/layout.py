"""Orpheus TTS conventions: the token layout, the prompt template, and audio tokens -> SNAC frames.

Orpheus (canopyai/Orpheus-TTS) is a Llama-3.2-3B fine-tune whose output tokens are SNAC 24 kHz codes.
The facts below were read from its source (``orpheus_tts_pypi/orpheus_tts/engine_class.py``,
``orpheus_tts_pypi/orpheus_tts/decoder.py``, ``pretrain/train.py``, ``realtime_streaming_example/main.py``,
``additional_inference_options/baseten_inference_example/call_orpheus.py``); this file re-states them:

* Vocabulary: Llama-3's 128,256 text tokens, then ``7 * 4096 + 10 + 1`` added tokens
  ``<custom_token_N>`` = id ``128256 + N`` (``train.py``). In those: N = 1 start of speech (128257),
  2 end of speech (128258), 3 start of human (128259), 4 end of human (128260), 5 start of AI (128261).
* Prompt (``_format_prompt``, the "larger" models): ``[128259] + tokenizer(f"{voice}: {text}")`` (the
  Llama-3 tokenizer adds BOS 128000) ``+ [128009 (end of turn), 128260, 128261, 128257]``; without a
  voice the text alone. Voices of the English fine-tune: tara, leah, jess, leo, dan, mia, zac, zoe.
* Output: audio tokens until end of speech 128258 (the streaming example's stop id; the Baseten example
  also stops on 128009). The k-th audio token (k counted from the first, so k % 7 is its place in a
  frame) carries SNAC code ``id - 128266 - (k % 7) * 4096`` (``turn_token_into_id``: ``N - 10 -
  (k % 7) * 4096``).
* Frame interleave (``convert_to_audio``): 7 tokens = one coarse SNAC frame (~85 ms at 24 kHz):
  level 0 (1 code/frame) <- place 0; level 1 (2 codes) <- places 1, 4; level 2 (4 codes) <- places 2, 3,
  5, 6. Codes must lie in [0, 4096).
* Sampling defaults of the engine: temperature 0.6, top_p 0.8, repetition_penalty 1.3 (the README: a
  penalty >= 1.1 is needed for stable speech), max_tokens 1200.

Differences from the reference on purpose: a token that is not the audio code of its place (a text
token, a code of another place, an out-of-range id) ends the stream with `AudioTokenError` naming it,
where the reference skips it or returns nothing for the window; a code of 0 is a valid code (the
reference's ``if token > 0`` drops it). Decoding is exact windowed streaming (`load_vocoder`'s stream),
where the reference re-decodes a sliding 4-frame window and keeps its second frame.

`OrpheusLayout` holds the ids so a miniature model (tests/fixtures/tts) can use the same rules with
smaller offsets; ``orpheus.json`` next to the checkpoint may override them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import torch

from flashrt.errors import CheckpointError, ConfigError, FlashRTError, InputError
from flashrt.io.fields import Fields
from flashrt.io.files import TOKENIZER_LIMIT, read_json, read_tokenizer_json
from flashrt.io.inputs import check_text_chars

__all__ = ["OrpheusLayout", "AudioTokenError", "FrameDecoder", "ByteTokenizer", "load_text_tokenizer",
           "read_layout", "format_prompt", "FRAME", "FRAME_PLACES", "VOICES"]

FRAME = 7
FRAME_PLACES = ((0,), (1, 4), (2, 3, 5, 6))  # SNAC level -> places in a 7-token frame
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
LAYOUT_FILE = "orpheus.json"


class AudioTokenError(FlashRTError):
    """The LM emitted a token that is not the SNAC code expected at its place in the frame."""


@dataclass(frozen=True)
class OrpheusLayout:
    """Token ids of one Orpheus-style checkpoint (defaults: the released Llama-3 based models)."""

    base_vocab: int = 128256          # first added token, <custom_token_0>
    bos_token_id: int = 128000
    eot_token_id: int = 128009
    codebook_size: int = 4096
    text_tokenizer: str = "tokenizer.json"   # or "bytes" (UTF-8 bytes; miniature test models)

    @property
    def start_of_speech(self) -> int:
        return self.base_vocab + 1

    @property
    def end_of_speech(self) -> int:
        return self.base_vocab + 2

    @property
    def start_of_human(self) -> int:
        return self.base_vocab + 3

    @property
    def end_of_human(self) -> int:
        return self.base_vocab + 4

    @property
    def start_of_ai(self) -> int:
        return self.base_vocab + 5

    @property
    def audio_base(self) -> int:
        return self.base_vocab + 10

    @property
    def vocab_needed(self) -> int:
        return self.audio_base + FRAME * self.codebook_size

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        return (self.end_of_speech, self.eot_token_id)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = LAYOUT_FILE) -> OrpheusLayout:
        """From ``orpheus.json`` over the defaults; every field is checked (CheckpointError naming it):
        ids are ints, the two text ids lie below ``base_vocab`` (they are text tokens), and
        ``text_tokenizer`` is ``"bytes"`` or a file name (kept inside the folder by `load_text_tokenizer`)."""
        f = Fields(d, where)
        f.unknown([x.name for x in fields(cls)])
        base = f.int("base_vocab", cls.base_vocab, lo=1, hi=MAX_ID)
        layout = cls(base_vocab=base, bos_token_id=f.int("bos_token_id", cls.bos_token_id, lo=0, hi=base - 1),
                     eot_token_id=f.int("eot_token_id", cls.eot_token_id, lo=0, hi=base - 1),
                     codebook_size=f.int("codebook_size", cls.codebook_size, lo=1, hi=MAX_CODEBOOK),
                     text_tokenizer=f.str("text_tokenizer", cls.text_tokenizer))
        if not layout.text_tokenizer.strip():
            raise CheckpointError(f"{where}: text_tokenizer: expected 'bytes' or a file name, got ''")
        return layout


MAX_ID, MAX_CODEBOOK = 1 << 24, 1 << 16  # far above Orpheus' 128,256 + 28,682 ids and SNAC's 4096 codes


def read_layout(folder: Path, codebook_size: int) -> OrpheusLayout:
    """The layout of a checkpoint folder: ``orpheus.json`` if present over the defaults; the codebook
    size comes from the SNAC decoder's config. A layout file that is there but not a readable regular
    JSON file is a CheckpointError (never silently replaced by the defaults)."""
    path = folder / LAYOUT_FILE
    data: dict[str, Any] = {}
    if os.path.lexists(path):
        data = read_json(path, "Orpheus layout")
    if data.get("codebook_size", codebook_size) != codebook_size:
        raise CheckpointError(f"{path}: codebook_size {data['codebook_size']!r} differs from the SNAC "
                              f"decoder's {codebook_size}")
    return OrpheusLayout.from_dict({**data, "codebook_size": codebook_size}, str(path))


# ------------------------------------------------------------------------------------------ text

class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids, after BOS (the miniature checkpoints' stand-in for Llama-3's BPE)."""

    def __init__(self, bos: int) -> None:
        self.bos = bos

    def encode(self, text: str) -> list[int]:
        return [self.bos, *text.encode("utf-8")]


class JSONTokenizer:
    """A Hugging Face ``tokenizer.json`` read by the ``tokenizers`` package (its post-processor adds
    Llama-3's BOS, as ``AutoTokenizer`` does). The file is read through `flashrt.io.files` (a regular
    file of at most `TOKENIZER_LIMIT` bytes); one that does not parse is a CheckpointError naming it."""

    def __init__(self, path: Path) -> None:
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            raise ConfigError(f"{path}: reading tokenizer.json needs the 'tokenizers' package "
                              "(pip install tokenizers)") from None
        self.tokenizer = read_tokenizer_json(path, "text tokenizer", limit=TOKENIZER_LIMIT)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)


def load_text_tokenizer(folder: Path, layout: OrpheusLayout) -> TextTokenizer:
    """The layout's text tokenizer: UTF-8 bytes, or a file of ``folder`` named by a plain file name (no
    folder part, so a layout cannot point it elsewhere; the file itself may be a link to a regular file)."""
    name = layout.text_tokenizer
    if name == "bytes":
        return ByteTokenizer(layout.bos_token_id)
    if "\0" in name or name in (".", "..") or Path(name).name != name or "\\" in name:
        raise CheckpointError(f"{folder / LAYOUT_FILE}: text_tokenizer: {name!r} must be 'bytes' or a plain "
                              "file name in the model folder (no folder part)")
    path = folder / name
    if not os.path.lexists(path):
        raise CheckpointError(f"{folder}: no {layout.text_tokenizer} (the text tokenizer of the LM)")
    return JSONTokenizer(path)


def format_prompt(layout: OrpheusLayout, tokenizer: TextTokenizer, text: str, voice: str | None) -> list[int]:
    """Orpheus' prompt ids for ``text`` in ``voice`` (module docstring)."""
    if not isinstance(text, str) or not text.strip():
        raise InputError("text: expected a non-empty string")
    if voice is not None and (not isinstance(voice, str) or not voice.strip()):
        raise InputError(f"voice: expected a non-empty name or None, got {voice!r}")
    check_text_chars(text)
    if voice is not None:
        check_text_chars(voice, "voice")
    spoken = f"{voice}: {text}" if voice else text
    return [layout.start_of_human, *tokenizer.encode(spoken), layout.eot_token_id, layout.end_of_human,
            layout.start_of_ai, layout.start_of_speech]


# ------------------------------------------------------------------------------------------ frames

class FrameDecoder:
    """Audio tokens -> SNAC frames, validating each token against its place (module docstring).

    ``push(token)`` returns a frame (3 lists of 1, 2, 4 codes) every 7th token, else None; a token that
    is not the code of its place raises `AudioTokenError`. ``pending`` counts tokens of an unfinished
    frame (dropped at the end, like the reference)."""

    def __init__(self, layout: OrpheusLayout) -> None:
        self.layout = layout
        self.count = 0
        self._frame: list[int] = []

    def push(self, token: int) -> list[list[int]] | None:
        place = self.count % FRAME
        lo = self.layout.audio_base + place * self.layout.codebook_size
        if not lo <= token < lo + self.layout.codebook_size:
            raise AudioTokenError(
                f"token {token} at audio position {self.count} (frame {self.count // FRAME}, place {place}) "
                f"is not a SNAC code of that place (ids {lo}..{lo + self.layout.codebook_size - 1}); "
                "the stream ends here rather than decode garbage")
        self._frame.append(token - lo)
        self.count += 1
        if len(self._frame) < FRAME:
            return None
        frame, self._frame = self._frame, []
        return [[frame[p] for p in places] for places in FRAME_PLACES]

    @property
    def pending(self) -> int:
        return len(self._frame)


def stack_frames(frames: list[list[list[int]]]) -> tuple[torch.Tensor, ...]:
    """Frames -> one int64 tensor (1, k * rate) per SNAC level."""
    return tuple(torch.tensor([[c for f in frames for c in f[level]]], dtype=torch.int64)
                 for level in range(len(FRAME_PLACES)))
