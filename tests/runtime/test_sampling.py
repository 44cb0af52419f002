"""Device sampling against transformers' logits processors, in generate()'s order: repetition penalty
(over prompt and output tokens), temperature, top-k, top-p; then the draw.

The draw is the inverse CDF of what is kept over the ranks (the tempered logits, largest first), at
the step's uniform u, a hash of (seed, step) (`hashed_uniform`). So for any seed the token
`sample_token` must return is computable from transformers' processed scores and the same u: the first
rank whose cumulative kept probability exceeds u times their total. Over many seeds every kept token
gets its turn, so a token kept or dropped by mistake changes some draw."""

import pytest
import torch

from flashrt.runtime.sampling import (
    FIRST_PAUSE,
    FIRST_RANKS,
    draw,
    hashed_uniform,
    penalize,
    sample_token,
    step_uniforms,
)

transformers = pytest.importorskip("transformers")

V = 96
SEEDS = range(300)
PENALTY = 1.3
# (temperature, top_k, top_p): both filters, k off, p off, k past the vocabulary, both off, hot and cold
CASES = [(0.7, 20, 0.8), (1.6, 30, 0.6), (0.5, 0, 0.9), (1.3, 12, 1.0), (0.8, V + 10, 0.7), (1.0, 0, 1.0),
         (2.5, 40, 0.5), (0.4, 25, 0.95)]


def _logits_and_history(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, V) logits of both signs and (1, 30) ids seen so far (a prompt and outputs, with repeats)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, V, generator=gen) * 3.0
    history = torch.randint(0, V, (1, 30), generator=gen)
    return logits, history


def _seen(history: torch.Tensor) -> torch.Tensor:
    return torch.zeros(1, V, dtype=torch.bool).scatter_(1, history, True)


def _reference_chain(temperature: float, top_k: int, top_p: float):
    """The warpers generate() builds for these settings, in its order (each only when it is on)."""
    p = transformers
    chain = [p.RepetitionPenaltyLogitsProcessor(PENALTY), p.TemperatureLogitsWarper(temperature)]
    if top_k != 0:
        chain.append(p.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        chain.append(p.TopPLogitsWarper(top_p))
    return p.LogitsProcessorList(chain)


def _expected_draw(scores: torch.Tensor, order: torch.Tensor, seed: int, step: int) -> int:
    """Inverse CDF in float64 over transformers' kept scores (softmax of the filtered scores)."""
    probs = torch.softmax(scores[0, order[0]].double(), -1)
    cum = probs.cumsum(-1)
    u = float(hashed_uniform(torch.tensor([seed]), torch.tensor([step]), 1))
    rank = min(int((cum <= u * float(cum[-1])).sum()), int((probs > 0).sum()) - 1)
    return int(order[0, rank])


def test_repetition_penalty_matches_transformers_over_prompt_and_output_tokens():
    logits, history = _logits_and_history()
    assert (logits < 0).any() and (logits > 0).any()
    ours = penalize(logits, _seen(history), torch.tensor([PENALTY]))
    theirs = transformers.RepetitionPenaltyLogitsProcessor(PENALTY)(history, logits.clone())
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    assert not torch.equal(ours, logits)


@pytest.mark.parametrize("temperature, top_k, top_p", CASES)
def test_draws_follow_transformers_processors_in_generate_order(temperature, top_k, top_p):
    logits, history = _logits_and_history(1)
    scores = _reference_chain(temperature, top_k, top_p)(history, logits.clone())
    penalized = penalize(logits, _seen(history), torch.tensor([PENALTY]))
    order = (penalized / temperature).argsort(-1, descending=True)
    knobs = torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p])
    drawn, expected = [], []
    for seed in SEEDS:
        step = seed % 7
        drawn.append(int(sample_token(penalized, *knobs, torch.tensor([seed]), torch.tensor([step]))))
        expected.append(_expected_draw(scores, order, seed, step))
    assert drawn == expected
    kept = int(torch.isfinite(scores).sum())
    assert len(set(drawn)) > min(kept, 3) // 2, "the seeds must visit the kept set, not one token"


def test_the_cases_exercise_each_filter():
    """Each ordering the draws guard is live for these logits: top-k before top-p keeps a different set
    than top-p first, and tempering before the filters keeps a different set than after them."""
    logits, history = _logits_and_history(1)
    differs = {"k_then_p": False, "temperature_first": False}
    p = transformers
    for temperature, top_k, top_p in CASES:
        if top_k == 0 or top_k >= V or top_p >= 1.0:
            continue
        base = p.RepetitionPenaltyLogitsProcessor(PENALTY)(history, logits.clone())
        right = _reference_chain(temperature, top_k, top_p)(history, logits.clone()).isfinite()
        top_k_of, top_p_of = p.TopKLogitsWarper(top_k), p.TopPLogitsWarper(top_p)
        swapped = top_k_of(history, top_p_of(history, base / temperature))
        late = top_p_of(history, top_k_of(history, base.clone())) / temperature
        differs["k_then_p"] |= not torch.equal(right, swapped.isfinite())
        differs["temperature_first"] |= not torch.equal(right, late.isfinite())
    assert all(differs.values()), differs


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 20, 0.8), (5.0, 0, 0.5), (2.5, 0, 0.5)])
def test_draws_from_fewer_candidates_than_the_vocabulary_match_while_the_nucleus_fits(temperature, top_k,
                                                                                     top_p):
    """candidates < V ranks the top 48 only, with the full distribution's normalizer (the second logsumexp
    of `sample_token`); where the kept set fits in them the draws are transformers' exactly. The hot cases
    leave real mass past rank 48, so a normalizer over the candidates alone would change some draws."""
    logits, history = _logits_and_history(1)
    scores = _reference_chain(temperature, top_k, top_p)(history, logits.clone())
    assert int(torch.isfinite(scores).sum()) <= 48, "the case must keep fewer tokens than the candidates"
    penalized = penalize(logits, _seen(history), torch.tensor([PENALTY]))
    order = (penalized / temperature).argsort(-1, descending=True)
    knobs = torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p])
    drawn = [int(sample_token(penalized, *knobs, torch.tensor([s]), torch.tensor([s % 5]), candidates=48))
             for s in SEEDS]
    assert drawn == [_expected_draw(scores, order, s, s % 5) for s in SEEDS]


def test_step_uniforms_tabulate_the_hashed_variate_of_every_step():
    """The slot decoder's table of a request's variates (filled at join) holds, bit for bit, what
    `hashed_uniform` gives at each step, so a row draws the same tokens as the hashing runners."""
    for seed in (0, 3, 0xFFFFFFFF, 123456789):
        table = step_uniforms(torch.tensor([seed]), 40)
        hashed = torch.cat([hashed_uniform(torch.tensor([seed]), torch.tensor([t]), 1) for t in range(40)], 1)
        assert table.shape == (1, 40) and torch.equal(table, hashed)
    assert not torch.equal(step_uniforms(torch.tensor([1]), 8), step_uniforms(torch.tensor([2]), 8))


def _fresh() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64)


@pytest.mark.parametrize("vocab,candidates", [(720, 1024), (2000, 256), (300, 48)])
def test_ranking_the_first_few_draws_the_same_tokens_as_ranking_all(vocab, candidates):
    """``first=`` ranks FIRST_RANKS tokens and falls back to the candidates when a row keeps more:
    bit for bit the tokens of ranking them all in canonical order (ties by token id), on peaked rows (the
    fast branch) and flat ones (the fallback), with top-k below, at and above FIRST_RANKS and tied
    logits, alone and batched, eager and traced; without ties ``first=False`` (topk's order) agrees."""
    g = torch.Generator().manual_seed(vocab)
    seen = {True: 0, False: 0}
    for trial in range(60):
        rows = 1 + trial % 8
        sharp = torch.rand((rows, 1), generator=g) * 12          # 0: flat rows, 12: one token dominates
        plain = torch.randn((rows, vocab), generator=g) * sharp
        tied = plain.clone()
        tied[:, ::97] = tied[:, :1]
        ks = [0, 5, FIRST_RANKS, FIRST_RANKS + 1, 100]
        knobs = (torch.rand((rows, 1), generator=g) + 0.3,
                 torch.tensor([[ks[(trial + r) % 5]] for r in range(rows)]),
                 torch.rand((rows, 1), generator=g) * 0.99 + 0.01)
        seed, step = torch.arange(rows) + trial, torch.full((rows,), trial)
        u = hashed_uniform(seed, step, 1)
        for logits in (plain, tied):
            scaled = logits / knobs[0]
            every = draw(scaled, scaled.logsumexp(-1, keepdim=True), knobs[1], knobs[2], u,
                         min(candidates, vocab), FIRST_RANKS, True)[0]
            fast = sample_token(logits, *knobs, seed, step, candidates=candidates, first=_fresh())
            assert torch.equal(fast, every), trial
            for r in range(rows):  # each row alone draws what it draws in the batch
                alone = sample_token(logits[r:r + 1], *(k[r:r + 1] for k in knobs), seed[r:r + 1],
                                     step[r:r + 1], candidates=candidates, first=_fresh())
                assert torch.equal(alone, fast[r:r + 1])
        assert torch.equal(sample_token(plain, *knobs, seed, step, candidates=candidates),  # no ties
                           sample_token(plain, *knobs, seed, step, candidates=candidates, first=_fresh()))
        mass = (plain / knobs[0]).softmax(-1).sort(-1, descending=True).values[:, :FIRST_RANKS].sum(-1)
        top_k = knobs[1][:, 0]
        seen[bool(torch.where(top_k > 0, top_k <= FIRST_RANKS, mass >= knobs[2][:, 0]).all())] += 1
    assert seen[True] and seen[False]  # both branches ran

    def step_fn(lg, t, k, p, s, st):
        return sample_token(lg, t, k, p, s, st, candidates=candidates, first=_fresh())

    rows = 4
    args = (torch.randn(rows, vocab, generator=g) * 12, torch.full((rows, 1), 0.6),
            torch.zeros((rows, 1), dtype=torch.int64), torch.full((rows, 1), 0.8), torch.arange(rows),
            torch.zeros(rows, dtype=torch.int64))
    traced = torch.jit.trace(step_fn, args, check_trace=False)
    for sharpness in (12.0, 0.05, 0.0):  # the traced step keeps the branch: peaked, flat, all tied
        lg = torch.randn(rows, vocab, generator=g) * sharpness
        assert torch.equal(traced(lg, *args[1:]), step_fn(lg, *args[1:]))


def test_a_try_that_falls_short_pauses_the_first_ranks():
    """After a step whose kept set did not fit in FIRST_RANKS, the next FIRST_PAUSE steps rank every
    candidate at once (counted down in the caller's buffer), then it tries again; the tokens are the
    same either way."""
    g = torch.Generator().manual_seed(5)
    knobs = (torch.full((2, 1), 1.0), torch.zeros((2, 1), dtype=torch.int64), torch.full((2, 1), 0.95))
    pause = _fresh()
    flat, peaked = torch.randn(2, 500, generator=g) * 0.01, torch.randn(2, 500, generator=g) * 30
    counts = []
    for t, logits in enumerate([flat] + [peaked] * (FIRST_PAUSE + 1)):
        seed, step = torch.arange(2), torch.full((2,), t)
        drawn = sample_token(logits, *knobs, seed, step, first=pause)
        assert torch.equal(drawn, sample_token(logits, *knobs, seed, step, first=_fresh()))
        counts.append(int(pause))
    assert counts == [FIRST_PAUSE, *range(FIRST_PAUSE - 1, -1, -1), 0]


def test_rows_the_caller_drops_do_not_make_the_first_ranks_fall_short():
    """``used`` names the rows whose draw is taken: a flat row, or one at temperature 0 (no number), that
    the caller drops does not send the batch to ranking every candidate, and the rows it takes draw the
    same tokens bit for bit; the same rows taken do."""
    g = torch.Generator().manual_seed(11)
    logits = torch.cat([torch.randn(2, 500, generator=g) * 30, torch.randn(2, 500, generator=g) * 0.01])
    knobs = (torch.tensor([[1.0], [0.7], [1.0], [0.0]]), torch.zeros((4, 1), dtype=torch.int64),
             torch.full((4, 1), 0.95))
    seed, step = torch.arange(4), torch.zeros(4, dtype=torch.int64)
    taken = torch.tensor([[True], [True], [False], [False]])
    pause = _fresh()
    drawn = sample_token(logits, *knobs, seed, step, first=pause, used=taken)
    assert int(pause) == 0
    assert torch.equal(drawn[:2], sample_token(logits[:2], *(k[:2] for k in knobs), seed[:2], step[:2],
                                               first=_fresh()))
    for used in (None, torch.tensor([[True], [True], [True], [False]])):
        pause = _fresh()
        sample_token(logits, *knobs, seed, step, first=pause, used=used)
        assert int(pause) == FIRST_PAUSE
