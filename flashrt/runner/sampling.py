"""Token selection on the device, re-exported: it lives in `flashrt.runtime.sampling` (next to the
decode runner in `flashrt.runtime.decode`). Existing imports from here keep working."""

from flashrt.runtime.sampling import greedy_token, hashed_uniform, penalize, sample_token

__all__ = ["greedy_token", "hashed_uniform", "penalize", "sample_token"]
