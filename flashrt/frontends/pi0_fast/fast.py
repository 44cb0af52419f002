"""The FAST detokenizer: PaliGemma token ids -> FAST ids -> BPE decode -> DCT coefficients -> inverse DCT.

FAST (Physical Intelligence's action tokenizer) encodes a normalized chunk (H, A) as
``round(DCT-II_ortho(chunk, time axis) * scale) - min_token``, one character per coefficient, then
byte-level BPE. Its files are read locally (never from a hub), from a folder holding

    processor_config.json   scale, min_token (and vocab_size, time_horizon, action_dim, for the record)
    tokenizer.json          the byte-level BPE (decoded with the `tokenizers` package)

as `save_pretrained` of lerobot's FAST processor writes them (the hub repo lerobot/fast-action-tokenizer
has the same two files). A missing or unreadable file is a CheckpointError naming it; there is no
fallback to zeros.

`decode(ids)` follows lerobot 0.6.1 ``PI0FastPolicy.detokenize_actions`` + ``decode_actions_with_fast``
(relaxed decoding), with the token stream already cut at the end marker "|" by the decode loop:

1. every occurrence of the id sequence of "Action: " is removed (and, when the checkpoint asks for it,
   the stream must start with "Action", ":");
2. FAST id = ``vocab - 1 - fast_skip_tokens - id``; ids beyond the FAST vocabulary decode to nothing
   (as the tokenizers package skips unknown ids);
3. BPE decode, ``ord`` of each character + ``min_token``; too few coefficients are padded with 0, too
   many are cut (H * A of them), reshaped (H, A);
4. inverse DCT (DCT-III, orthonormal, time axis) of ``coefficients / scale``, float64 -> float32.

Where the reference returns an all-zero chunk (a PaliGemma id in the skipped range, i.e. a negative
FAST id, makes its decode raise; an empty stream decodes to zeros) flashrt raises `NumericalError`
instead: a chunk of zeros would un-normalize to the mean action, which a robot would execute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flashrt.errors import CheckpointError, NumericalError
from flashrt.io.files import read_bytes_capped, read_json

__all__ = ["FastTokenizer", "TextIds", "Detokenizer", "idct_ortho", "FAST_FILES"]

FAST_FILES = ("processor_config.json", "tokenizer.json")
FAST_HELP = ("Pi0-FAST needs the FAST action tokenizer's processor_config.json and tokenizer.json (the "
             "Hugging Face repo lerobot/fast-action-tokenizer, or the processor the policy was trained "
             "with): put them in <checkpoint>/fast_tokenizer/ or pass action_tokenizer=<folder>")


def find_fast_folder(explicit: str | Path | None, checkpoint: Path) -> Path:
    """`explicit`, else ``checkpoint/fast_tokenizer``, else the checkpoint folder itself, whichever holds
    both files; CheckpointError naming the missing file(s) otherwise."""
    candidates = [Path(explicit)] if explicit is not None else [checkpoint / "fast_tokenizer", checkpoint]
    for folder in candidates:
        if all((folder / name).is_file() for name in FAST_FILES):
            return folder
    folder = candidates[0]
    missing = [str(folder / n) for n in FAST_FILES if not (folder / n).is_file()]
    raise CheckpointError(f"FAST action tokenizer file(s) missing: {', '.join(missing)}. {FAST_HELP}")


def _number(table: dict[str, Any], name: str, where: Path, kind: type) -> Any:
    value = table.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or (kind is int and not float(value).is_integer()):
        raise CheckpointError(f"{where}: field {name!r} must be a finite {kind.__name__}, got {value!r}")
    return kind(value)


@dataclass(frozen=True)
class FastTokenizer:
    """The FAST processor's numbers and its BPE (a `tokenizers.Tokenizer`)."""

    path: Path
    scale: float
    min_token: int
    bpe: Any

    @classmethod
    def load(cls, folder: Path) -> FastTokenizer:
        config_path, bpe_path = (folder / n for n in FAST_FILES)
        config = read_json(config_path, "FAST processor config")
        scale = _number(config, "scale", config_path, float)
        if scale <= 0:
            raise CheckpointError(f"{config_path}: scale must be positive, got {scale}")
        min_token = _number(config, "min_token", config_path, int)
        try:
            from tokenizers import Tokenizer

            text = read_bytes_capped(bpe_path, "FAST tokenizer", limit=64 << 20).decode("utf-8")
            bpe = Tokenizer.from_str(text)
        except ImportError:
            raise CheckpointError("the `tokenizers` package is needed to decode FAST action tokens "
                                  "(pip install 'flashrt[tokenizers]')") from None
        except (UnicodeDecodeError, Exception) as exc:  # tokenizers raises a bare Exception on bad JSON
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{bpe_path}: not a tokenizers JSON file ({exc}). {FAST_HELP}") from None
        return cls(folder, scale, min_token, bpe)

    @property
    def vocab_size(self) -> int:
        return self.bpe.get_vocab_size()


@dataclass(frozen=True)
class TextIds:
    """What the detokenizer needs from the PaliGemma text tokenizer (ids, never strings)."""

    vocab_size: int
    end: int                      # "|"
    action_prefix: tuple[int, ...]  # encode("Action: ")
    action_start: tuple[int, ...]   # ids of "Action", ":" (the optional prefix check)


def idct_ortho(coeff: np.ndarray) -> np.ndarray:
    """Inverse of the orthonormal DCT-II along axis 0 (= scipy.fftpack.idct(x, axis=0, norm="ortho"))."""
    n = coeff.shape[0]
    k, t = np.arange(n)[None, :], np.arange(n)[:, None]
    basis = np.cos(np.pi * k * (2 * t + 1) / (2 * n)) * np.sqrt(2.0 / n)
    basis[:, 0] = np.sqrt(1.0 / n)
    return basis @ coeff


def _remove_sequence(ids: list[int], seq: tuple[int, ...]) -> list[int]:
    """Every occurrence of ``seq`` removed, scanning as lerobot does (after a removal, the same index
    is tested again)."""
    if not seq:
        return ids
    i = 0
    while i <= len(ids) - len(seq):
        if tuple(ids[i:i + len(seq)]) == seq:
            ids = ids[:i] + ids[i + len(seq):]
        else:
            i += 1
    return ids


@dataclass(frozen=True)
class Detokenizer:
    """PaliGemma ids (already cut at "|") -> normalized actions (horizon, action_dim) float32."""

    fast: FastTokenizer
    text: TextIds
    skip: int
    horizon: int
    action_dim: int
    check_prefix: bool = False

    def decode(self, ids: list[int]) -> np.ndarray:
        if self.check_prefix and tuple(ids[:2]) != self.text.action_start:
            raise NumericalError(f"the decoded tokens do not start with 'Action', ':' ({ids[:8]}...); the "
                                 "checkpoint asks for that prefix (validate_action_token_prefix)")
        ids = _remove_sequence(list(ids), self.text.action_prefix)
        fast = self.text.vocab_size - 1 - self.skip - np.asarray(ids, dtype=np.int64)
        if (fast < 0).any():
            bad = [i for i, f in zip(ids, fast.tolist()) if f < 0][:8]
            raise NumericalError(f"the model emitted PaliGemma id(s) {bad} from the {self.skip} skipped ids "
                                 "above the FAST range: not action tokens (lerobot would return a chunk of "
                                 "zeros)")
        chars = self.fast.bpe.decode(fast.tolist())
        if not chars:
            raise NumericalError(f"no FAST action tokens in the decoded stream ({ids[:8]}); lerobot would "
                                 "return a chunk of zeros")
        coeff = np.array([ord(c) for c in chars], dtype=np.int64) + self.fast.min_token
        n = self.horizon * self.action_dim
        coeff = np.pad(coeff[:n], (0, max(0, n - len(coeff))))  # relaxed decoding: cut or zero-pad
        return idct_ortho(coeff.reshape(self.horizon, self.action_dim) / self.fast.scale).astype(np.float32)
