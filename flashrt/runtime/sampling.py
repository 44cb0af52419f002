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
`sample_token`), and on the CPU backends that run a step's branches only the first `FIRST_RANKS` while
every row's kept set fits in them (``first=``). The slot decoder tabulates a request's variates
when it joins (`step_uniforms`), the same values as the hash.

Why the inverse CDF and not Gumbel-max (argmax of score + Gumbel noise per rank): the same
distribution from one variate per row instead of one per candidate, whose noise (a hash, two logs, an
add and an argmax over 720-1,024 columns) weighed on every sampled step.

Shapes: B batch, V vocabulary.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

_M32 = 0xFFFFFFFF
FIRST_RANKS = 32  # ranks a `sample_token(first=...)` tries before its candidates
FIRST_PAUSE = 8  # steps a `sample_token(first=...)` ranks every candidate after a try that fell short


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (xorshift-multiply), on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _step_key(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The hash of (seed, step), elementwise over broadcast int64 tensors."""
    return _mix32((seed & _M32) ^ _mix32((step + 0x3C6EF372) & _M32))


def _unit(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 in (0, 1): 23 bits, exact in float32, never 0 or 1."""
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def hashed_uniform(seed: torch.Tensor, step: torch.Tensor, n: int) -> torch.Tensor:
    """(1, n) float32 uniforms in (0, 1) depending only on seed (1,), step (1,) and the column index."""
    cols = torch.arange(n, device=seed.device, dtype=torch.int64)
    return _unit(_mix32(_step_key(seed, step)[:, None] ^ _mix32(cols)[None, :]))


def step_uniforms(seed: torch.Tensor, steps: int) -> torch.Tensor:
    """(R, steps) float32: column t is row r's variate at step t, ``hashed_uniform(seed[r], t, 1)``,
    bit for bit (column 0's mix is zero): a whole request's draws in one pass (the slot decoder
    tabulates them at join, so a decode step gathers one value instead of hashing: ~45 ops on (R, 1)
    tensors)."""
    t = torch.arange(steps, device=seed.device, dtype=torch.int64)
    return _unit(_mix32(_step_key(seed[:, None], t[None, :])))


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Repetition penalty on the tokens marked in ``seen`` (B, V) bool; ``penalty`` (1,) (1.0: none)."""
    hit = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, hit, logits)


def greedy_token(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B, 1) int64 argmax (the first maximum on ties, like torch.argmax everywhere)."""
    return logits.argmax(-1, keepdim=True)


def sample_token(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 seed: torch.Tensor, step: torch.Tensor, candidates: int = 1024,
                 u: torch.Tensor | None = None, first: torch.Tensor | None = None,
                 used: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) -> (B, 1) int64 drawn after temperature, top-k and top-p (module docstring). ``u``: the
    rows' variates (B, 1) where the caller has them (`step_uniforms`); None: hashed from seed and step.
    ``used`` (B, 1) bool: the rows whose draw the caller takes (None: all of them), for ``first``.

    Only the ``candidates`` most likely tokens are ranked (`torch.topk`, not a sort of the vocabulary:
    about 10x cheaper on the CPU at V = 157k); probabilities still use the full distribution's
    normalizer, so top-p is exact whenever the nucleus fits in the candidates (top-k is capped there).

    ``first`` (a (1,) int64 counter buffer, zero at the start; CPU graph backends that run Python
    control flow: eager, jit): rank only the `FIRST_RANKS` most likely tokens, and the ``candidates``
    only when some row it takes (``used``) keeps more than those (`draw_first`; a row at temperature 0,
    or a row of a batch bucket past the live ones, keeps no number, and a batch would otherwise rank
    every candidate at each step for it). After such a step the next `FIRST_PAUSE`
    steps rank the candidates at once (counted down in ``first``), so a flat distribution, where the
    try always falls short, pays for it one step in nine. Both paths rank in canonical order (`rank`:
    value descending, ties by token id), so the draw does not depend on how many were ranked as long as
    the kept ones were: the same tokens as without ``first``, bit for bit, except where two kept
    candidates hold the very same value (``torch.topk`` orders such ties as it likes; the canonical
    order needs a stable sort, which the ONNX export has no translation for). A data-dependent branch
    (a host read), so never inside a CUDA graph or the trace backend. With a peaked distribution (a
    trained LM at Orpheus' temperature 0.6 and top-p 0.8 keeps a handful) the 8-row step of a 720-token
    vocabulary ranked 32 tokens instead of 720 (topk 70 -> 16 us), of a 157k one 1.9 instead of 6.3 ms.

    The kept ranks are a prefix (top-k and top-p both keep the most likely), so the draw counts the kept
    ranks whose cumulative probability is at most u times the kept total; the count is capped at the last
    rank of positive probability (u * total may round up to the total). A row at temperature 0 (NaN
    probabilities; its caller takes the greedy token instead) draws rank 0, a valid index."""
    scaled = logits / temperature
    u = hashed_uniform(seed, step, 1) if u is None else u
    norm = scaled.logsumexp(-1, keepdim=True)
    ranked = min(int(candidates), logits.shape[-1])
    if first is not None and ranked > FIRST_RANKS:
        used = torch.ones_like(temperature, dtype=torch.bool) if used is None else used
        return scripted_draw_first()(scaled, norm, top_k, top_p, u, first, used, FIRST_RANKS, ranked,
                                     FIRST_PAUSE)
    return draw(scaled, norm, top_k, top_p, u, ranked, FIRST_RANKS, False)[0]


def rank(scaled: torch.Tensor, k: int, canonical: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row (B, V) and their token ids, value descending; ``canonical``: ties by
    ascending id (the same whatever ``k``, where the k-th value is not tied with the next), else in
    ``torch.topk``'s order."""
    if not canonical:
        return scaled.topk(k, dim=-1)
    if k >= scaled.shape[-1]:
        return torch.sort(scaled, dim=-1, descending=True, stable=True)
    values, order = scaled.topk(k, dim=-1)
    by_id = order.argsort(dim=-1)
    values, order = values.gather(-1, by_id), order.gather(-1, by_id)
    values, at = torch.sort(values, dim=-1, descending=True, stable=True)
    return values, order.gather(-1, at)


def draw(scaled: torch.Tensor, norm: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor,
         k: int, head: int, canonical: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, 1), mass (B, 1)) from the ``k`` best ranks (`sample_token`); ``norm`` the full
    distribution's logsumexp (B, 1); ``mass`` the probability of these ranks (a view, no work: what
    `draw_first` decides by). A top-k of at most ``head``
    (`FIRST_RANKS`) is normalized over the first ``head`` ranks whatever ``k``, so a draw of that many
    ranks equals one of more, bit for bit."""
    values, order = rank(scaled, k, canonical)
    ranks = torch.arange(values.shape[-1], device=scaled.device)
    minus_inf = torch.full((), -torch.inf, device=scaled.device)
    top = torch.where((ranks < top_k) | (top_k <= 0), values, minus_inf)
    local = torch.where(top_k <= head, top[:, :min(head, values.shape[-1])].logsumexp(-1, keepdim=True),
                        top.logsumexp(-1, keepdim=True))
    probs = (top - torch.where(top_k > 0, local, norm)).exp()
    cum = probs.cumsum(-1)
    kept = torch.where((cum - probs) < top_p, probs, torch.zeros((), device=scaled.device))
    kept_cum = kept.cumsum(-1)
    target = u * kept_cum[:, -1:]
    last = ((kept > 0).sum(-1, keepdim=True) - 1).clamp_min(0)  # 0 for a row with no number (temperature 0)
    return order.gather(-1, torch.minimum((kept_cum <= target).sum(-1, keepdim=True), last)), cum[:, -1:]


def draw_first(scaled: torch.Tensor, norm: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               u: torch.Tensor, pause: torch.Tensor, used: torch.Tensor, first: int, k: int,
               steps: int) -> torch.Tensor:
    """`draw` over the ``first`` best ranks when every ``used`` row (B, 1) fits in them, else over ``k``
    (the other rows' tokens are the caller's to drop); while the
    counter ``pause`` (1,) is above zero, over ``k`` at once (counted down; set to ``steps`` when a try
    falls short). Run as TorchScript (`scripted_draw_first`): a traced step keeps the branches."""
    if bool(pause[0] > 0):
        pause.sub_(1)
        return draw(scaled, norm, top_k, top_p, u, k, first, True)[0]
    tokens, mass = draw(scaled, norm, top_k, top_p, u, first, first, True)
    # a row without top-k keeps nothing past these ranks once their mass reaches top_p; a row with one
    # fits when its top-k does (its probabilities are normalized over its top-k, all of which it needs)
    if bool((torch.where(top_k > 0, top_k <= first, mass >= top_p) | ~used).all()):
        return tokens
    pause.fill_(steps)
    return draw(scaled, norm, top_k, top_p, u, k, first, True)[0]


@functools.cache
def scripted_draw_first() -> Any:
    """`draw_first` compiled by TorchScript once, on first use (a traced step records the call and keeps
    its branch; eager runs it as is). TorchScript is deprecated in torch's favour of compile/export,
    which have no CPU interpreter that releases the GIL: its warning is not shown (`flashrt.runtime.jit`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(draw_first)
