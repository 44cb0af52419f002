"""Token selection on the device, inside a captured step: repetition penalty, greedy, and sampling with
temperature, top-k and top-p from a counter-based random stream.

Every knob is a device tensor (written before the prefill replay, read by every step), so one captured
decode step serves every request: no recapture when a request changes its temperature or k.

Randomness: no generator state and no RNG op in the graph (a CUDA graph would freeze its offsets, the
trace backend refuses it). The step's uniform variate u is a 32-bit integer hash of (seed, t)
(`hashed_uniform`, column 0), so a request's tokens depend only on its seed, reproducibly on any
backend, and a replay equals eager bit for bit.

Semantics (as transformers' logits processors, in this order): repetition penalty over every token seen
in the prompt and output (divide positive logits, multiply negative ones); temperature; top-k (k <= 0:
off); top-p (keep the smallest set of top tokens whose probability reaches p, always the first); then
one draw from what is kept, renormalized, by its inverse CDF over the ranks (largest first): the first
rank whose cumulative probability exceeds u times the kept total. Temperature 0 is greedy
(`greedy_token`, its own graph). Sampling ranks only the top ``candidates`` tokens (default 1024; see
`sample_token`).

Why the inverse CDF and not Gumbel-max (argmax of score + Gumbel noise per rank): the same
distribution from one variate per row instead of one per candidate, whose noise (a hash, two logs, an
add and an argmax over 720-1,024 columns) weighed on every sampled step.

Shapes: B batch, V vocabulary.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (xorshift-multiply), on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def hashed_uniform(seed: torch.Tensor, step: torch.Tensor, n: int) -> torch.Tensor:
    """(1, n) float32 uniforms in (0, 1) depending only on seed (1,), step (1,) and the column index."""
    key = _mix32((seed & _M32) ^ _mix32((step + 0x3C6EF372) & _M32))
    cols = torch.arange(n, device=seed.device, dtype=torch.int64)
    h = _mix32(key[:, None] ^ _mix32(cols)[None, :])
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))  # 23 bits: exact in float32, never 0 or 1


def step_uniforms(seed: torch.Tensor, steps: int) -> torch.Tensor:
    """(R, steps) float32: column t is row r's variate at step t, ``hashed_uniform(seed[r], t, 1)``,
    bit for bit: a whole request's draws in one pass (the slot decoder tabulates them at join, so a
    decode step gathers one value instead of hashing: ~45 ops on (R, 1) tensors)."""
    t = torch.arange(steps, device=seed.device, dtype=torch.int64)
    key = _mix32((seed[:, None] & _M32) ^ _mix32((t[None, :] + 0x3C6EF372) & _M32))
    h = _mix32(key ^ _mix32(torch.zeros((), device=seed.device, dtype=torch.int64)))
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Repetition penalty on the tokens marked in ``seen`` (B, V) bool; ``penalty`` (1,) (1.0: none)."""
    hit = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, hit, logits)


def greedy_token(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B, 1) int64 argmax (the first maximum on ties, like torch.argmax everywhere)."""
    return logits.argmax(-1, keepdim=True)


def sample_token(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 seed: torch.Tensor, step: torch.Tensor, candidates: int = 1024,
                 u: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) -> (B, 1) int64 drawn after temperature, top-k and top-p (module docstring). ``u``: the
    rows' variates (B, 1) where the caller has them (`step_uniforms`); None: hashed from seed and step.

    Only the ``candidates`` most likely tokens are ranked (`torch.topk`, not a sort of the vocabulary:
    about 10x cheaper on the CPU at V = 157k); probabilities still use the full distribution's
    normalizer, so top-p is exact whenever the nucleus fits in the candidates (top-k is capped there).

    The kept ranks are a prefix (top-k and top-p both keep the most likely), so the draw counts the kept
    ranks whose cumulative probability is at most u times the kept total; the count is capped at the last
    rank of positive probability (u * total may round up to the total). A row at temperature 0 (NaN
    probabilities; its caller takes the greedy token instead) draws rank 0, a valid index."""
    scaled = logits / temperature
    values, order = scaled.topk(min(candidates, logits.shape[-1]), dim=-1)  # descending
    ranks = torch.arange(values.shape[-1], device=logits.device)
    minus_inf = torch.full((), -torch.inf, device=logits.device)
    top = torch.where((ranks < top_k) | (top_k <= 0), values, minus_inf)
    # top-p over what top-k kept, renormalized (as the reference chains them); else over everything (which
    # the candidates are, reordered, where they hold the whole vocabulary: one logsumexp then, not two)
    norm = top.logsumexp(-1, keepdim=True)
    if values.shape[-1] < logits.shape[-1]:
        norm = torch.where(top_k > 0, norm, scaled.logsumexp(-1, keepdim=True))
    probs = (top - norm).exp()
    cum = probs.cumsum(-1)
    kept = torch.where((cum - probs) < top_p, probs, torch.zeros((), device=logits.device))
    kept_cum = kept.cumsum(-1)
    target = (hashed_uniform(seed, step, 1) if u is None else u) * kept_cum[..., -1:]
    last = ((kept > 0).sum(-1, keepdim=True) - 1).clamp_min(0)  # 0 for a row with no number (temperature 0)
    return order.gather(-1, torch.minimum((kept_cum <= target).sum(-1, keepdim=True), last))
