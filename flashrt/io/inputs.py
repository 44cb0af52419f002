"""Checks on what callers pass at run time, shared by every family and server (one rule each).

- Seeds: None, or an int in [0, SEED_MAX] (2**63 - 1, what `torch.Generator.manual_seed` takes whole);
  bools, floats (1.0 included) and negative or larger values are an InputError, never truncated or
  wrapped. Policies, Piper, Orpheus, `flashrt say` and both servers use `check_seed`.
- Text: a string without NUL characters or lone surrogates (which no phonemizer, tokenizer or log can
  take), `check_text_chars`.
- Speed (OpenAI's speaking-rate factor): a finite real number (not a bool) in [SPEED_MIN, SPEED_MAX],
  `check_speed`; a family may accept less (Orpheus: 1 only).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashrt.errors import InputError

__all__ = ["SEED_MAX", "SPEED_MIN", "SPEED_MAX", "check_seed", "check_speed", "check_text_chars"]

SEED_MAX = 2**63 - 1
SPEED_MIN, SPEED_MAX = 0.25, 4.0


def check_seed(seed: Any) -> int | None:
    """None, or a non-negative int at most `SEED_MAX` (module docstring)."""
    if seed is None:
        return None
    if isinstance(seed, bool | np.bool_) or not isinstance(seed, int | np.integer):
        raise InputError(f"seed must be an int (or None), got {type(seed).__name__} {seed!r}")
    if not 0 <= int(seed) <= SEED_MAX:
        raise InputError(f"seed must lie in [0, 2**63), got {seed}")
    return int(seed)


def check_text_chars(text: str, what: str = "text") -> str:
    """`text` when it holds no NUL character and no lone surrogate; InputError naming the first."""
    if "\x00" in text:
        raise InputError(f"{what}: contains a NUL character at {text.index(chr(0))}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{what}: a lone surrogate at {exc.start} is not text") from None
    return text


def check_speed(speed: Any) -> float:
    """A speaking-rate factor in [SPEED_MIN, SPEED_MAX] as a float (module docstring); else InputError."""
    ok = isinstance(speed, int | float | np.integer | np.floating) and not isinstance(speed, bool | np.bool_)
    if not ok or not SPEED_MIN <= float(speed) <= SPEED_MAX:  # NaN fails the comparison too
        raise InputError(f"speed: expected a number in [{SPEED_MIN}, {SPEED_MAX}], got {speed!r}")
    return float(speed)
