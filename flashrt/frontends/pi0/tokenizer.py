"""PaliGemma prompt tokenization for Pi0 / Pi0.5, exactly as the reference processors build prompts.

The tokenizer is PaliGemma's SentencePiece model (`tokenizer.model`: pad 0, eos 1, bos 2, unk 3, byte
fallback), read from a local file with the `sentencepiece` package. Real checkpoints do not ship it: it
comes from the Hugging Face repo google/paligemma-3b-pt-224 (`tokenizer.model`) or openpi's
gs://big_vision/paligemma_tokenizer.model; pass its path as ``tokenizer=`` or place it in the
checkpoint directory.

Prompt formats (registry `PROMPT_FORMATS`; ids always start with bos, no eos, right padding with pad 0):

    lerobot_pi0   lerobot 0.6.1 `Pi0NewLineProcessor` + `TokenizerProcessorStep`:
                  ``task`` gets a trailing "\\n" unless it has one, then [bos] + encode(task)
    lerobot_plain a lerobot pipeline without the newline step: [bos] + encode(task)
    openpi_pi0    openpi `PaligemmaTokenizer.tokenize` without state: cleaned = task.strip() with "_" and
                  "\\n" replaced by " "; encode(cleaned, bos) + encode("\\n")
    pi05          lerobot `Pi05PrepareStateTokenizerProcessorStep` = openpi with state: the normalized state
                  (quantiles, expected in [-1, 1]) is discretized into 256 bins,
                  ``np.digitize(s, np.linspace(-1, 1, 257)[:-1]) - 1`` (so values < -1 give -1 and values
                  >= 1 give 255), and the prompt is
                  ``f"Task: {cleaned}, State: {' '.join(bins)};\\nAction: "`` encoded with bos

Where the references truncate a prompt longer than the maximum length, flashrt refuses it
(InputError): a silently cut instruction is a different instruction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt.errors import CheckpointError, InputError
from flashrt.io.files import read_bytes_capped
from flashrt.io.hub import hub_file

TOKENIZER_FILE = "tokenizer.model"
TOKENIZER_HELP = (
    "Pi0/Pi0.5 need PaliGemma's SentencePiece tokenizer `tokenizer.model` (from the Hugging Face repo "
    "google/paligemma-3b-pt-224, or openpi's gs://big_vision/paligemma_tokenizer.model). Checkpoints do "
    "not include it: pass its path with tokenizer=... (CLI: --tokenizer PATH), copy it into the checkpoint "
    "directory, or download the repo into the Hugging Face cache (`hf download google/paligemma-3b-pt-224 "
    "tokenizer.model`)."
)
STATE_BINS = 256
PALIGEMMA_REPO = "google/paligemma-3b-pt-224"


def find_tokenizer(explicit: str | Path | None, search_dirs: Sequence[Path]) -> Path:
    """The tokenizer file: `explicit` (a file, or a dir holding tokenizer.model), else the first
    `search_dirs/tokenizer.model`; CheckpointError saying where to get it when there is none."""
    if explicit is not None:
        path = Path(explicit)
        path = path / TOKENIZER_FILE if path.is_dir() else path
        if not path.is_file():
            raise CheckpointError(f"tokenizer {path} does not exist. {TOKENIZER_HELP}")
        return path
    for folder in search_dirs:
        if (folder / TOKENIZER_FILE).is_file():
            return folder / TOKENIZER_FILE
    cached = hub_file(PALIGEMMA_REPO, TOKENIZER_FILE)
    if cached is not None:
        return cached
    places = [*(str(d / TOKENIZER_FILE) for d in search_dirs), f"the hub cache of {PALIGEMMA_REPO}"]
    looked = ", ".join(places)
    raise CheckpointError(f"no tokenizer found (looked for {looked}). {TOKENIZER_HELP}")


class PaliGemmaTokenizer:
    """A SentencePiece model with PaliGemma's special ids, loaded once from a local file."""

    def __init__(self, path: str | Path) -> None:
        try:
            import sentencepiece
        except ImportError:
            raise CheckpointError("the `sentencepiece` package is needed to tokenize prompts "
                                  "(pip install 'flashrt[tokenizers]')") from None
        self.path = Path(path)
        # regular file, capped read: a FIFO or /dev/zero named as the tokenizer never hangs or grows
        proto = read_bytes_capped(self.path, "tokenizer", limit=64 << 20)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(f"cannot load tokenizer {self.path}: {exc}. {TOKENIZER_HELP}") from None
        self.bos_id, self.pad_id = self._sp.bos_id(), max(self._sp.pad_id(), 0)
        if self.bos_id < 0:
            raise CheckpointError(f"tokenizer {self.path} has no bos token; is it PaliGemma's?")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str, bos: bool = False) -> list[int]:
        return self._sp.encode(text, add_bos=bos)


def clean_prompt(task: str) -> str:
    """openpi's cleaning (also lerobot Pi0.5's): strip, "_" -> " ", newline -> " "."""
    return task.strip().replace("_", " ").replace("\n", " ")


STATE_BIN_EDGES = np.linspace(-1, 1, STATE_BINS + 1)[:-1]  # float64, made once (not per call)
STATE_BIN_EDGES.flags.writeable = False


def discretize_state(state: np.ndarray | torch.Tensor) -> np.ndarray:
    """Normalized state -> bin indices in -1..255 (numpy digitize against float64 bin edges)."""
    values = state.detach().cpu().numpy() if isinstance(state, torch.Tensor) else np.asarray(state)
    return np.digitize(values, bins=STATE_BIN_EDGES) - 1


def _lerobot_pi0(tok: PaliGemmaTokenizer, task: str, state: Any) -> list[int]:
    text = task if task.endswith("\n") else task + "\n"
    return [tok.bos_id, *tok.encode(text)]


def _lerobot_plain(tok: PaliGemmaTokenizer, task: str, state: Any) -> list[int]:
    return [tok.bos_id, *tok.encode(task)]


def _openpi_pi0(tok: PaliGemmaTokenizer, task: str, state: Any) -> list[int]:
    return tok.encode(clean_prompt(task), bos=True) + tok.encode("\n")


def pi05_prompt(task: str, state: Any) -> str:
    bins = " ".join(map(str, discretize_state(state)))
    return f"Task: {clean_prompt(task)}, State: {bins};\nAction: "


def _pi05(tok: PaliGemmaTokenizer, task: str, state: Any) -> list[int]:
    if state is None:
        raise InputError("Pi0.5 puts the state into the prompt: a state is required")
    return tok.encode(pi05_prompt(task, state), bos=True)


PROMPT_FORMATS: dict[str, Callable[[PaliGemmaTokenizer, str, Any], list[int]]] = {
    "lerobot_pi0": _lerobot_pi0,
    "lerobot_plain": _lerobot_plain,
    "openpi_pi0": _openpi_pi0,
    "pi05": _pi05,
}


@dataclass(frozen=True)
class PromptTokenizer:
    """Prompt (+ normalized state for Pi0.5) -> token ids, at most `max_length` of them."""

    tokenizer: PaliGemmaTokenizer
    format: str
    max_length: int

    def __post_init__(self) -> None:
        if self.format not in PROMPT_FORMATS:
            raise CheckpointError(f"unknown prompt format {self.format!r}; known: {sorted(PROMPT_FORMATS)}")

    def ids(self, prompt: Any, state: np.ndarray | torch.Tensor | None = None) -> list[int]:
        """Token ids of one prompt; InputError for a non-string or one longer than `max_length`."""
        if not isinstance(prompt, str):
            raise InputError(f"prompt must be a string, got {type(prompt).__name__}")
        ids = PROMPT_FORMATS[self.format](self.tokenizer, prompt, state)
        if len(ids) > self.max_length:
            raise InputError(f"prompt is {len(ids)} tokens, longer than the largest prompt bucket "
                             f"({self.max_length} tokens); shorten it or load with larger buckets")
        return ids

    def padded(self, ids: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (length,) int64 right-padded with pad, mask (length,) bool)."""
        out = torch.full((length,), self.tokenizer.pad_id, dtype=torch.int64)
        out[: len(ids)] = torch.as_tensor(list(ids), dtype=torch.int64)
        mask = torch.arange(length) < len(ids)
        return out, mask
