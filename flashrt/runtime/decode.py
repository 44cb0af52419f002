"""The AR decode runner: prefill buckets + ONE decode step captured once and replayed per token.

It knows no model. A model answers `DecodeModel` (`flashrt.frontends.lm.CausalLM` does; Pi0-FAST's
prefix + action-token decoder can too): it owns its weights and K/V cache and gives two graph bodies
that read and write the runner's step buffers (`DecodeIO`). The runner appends the sampler and the
bookkeeping to each body and captures the result:

    prefill graph (one per prompt bucket)    model.prefill(bucket, io) -> logits; mark the prompt's
                                             tokens seen; position = length; step = 0; pick token 0
    decode graph (one per mode, captured     model.decode(io) -> logits; position += 1; pick the next
    once: "greedy" and "sample")             token into io.token (it feeds the next replay) and into
                                             io.out[:, step]; step += 1

So N replays of the decode graph generate N tokens with no host work at all: the token, its position
and the step counter live in device tensors, the graph feeds itself. The host reads tokens only when
the caller asks for them (`generate(..., sync_every=k)` reads a block of k; stop tokens are checked on
the host, so up to k - 1 steps past a stop token are wasted, never returned).

Hot path of one request (`Decoder.generate`), each verb once: `check` (prompt ids within the
vocabulary, sizes within the bucket and the cache, sampling settings; InputError before any buffer is
touched) -> `write` (prompt padded to its bucket, length, sampling knobs, seed) -> prefill replay ->
decode replays, reading blocks of tokens. `report()` counts captures and replays per graph; after
load, captures never change (a test pins it: a whole utterance adds zero).

`DecodeIO` buffers (runner-owned, allocated once; B batch (1), P the largest prompt bucket, V the
vocabulary, G max new tokens):
    prompt (B, P) int64 input; length (1,) int64 input; temperature, top_p (1,) float32 input; top_k,
    seed (1,) int64 input; penalty (1,) float32 input; token (B, 1) int64 state; position, step (1,)
    int64 state; seen (B, V) bool state; logits (B, V) float32 scratch; out (B, G) int64 output.

A ``constraint`` (optional) runs inside both graphs before the pick: ``constraint(logits, step) ->
logits`` with ``step`` the (1,) index of the token being picked, e.g. a mask allowing only the codes
valid at that place of an audio frame (the Orpheus runner's `frame_constraint`).

``penalty=False`` builds the graphs without the repetition-penalty work (the penalize pass and the
``seen`` bookkeeping, ~7 of a small model's per-token ops); requests must then ask for 1.0 (checked).
Pi0-FAST uses it: lerobot's action-token decode has no penalty.

One request at a time per Decoder: a second concurrent `generate` raises ConfigError (the chain runs
each stage in one worker, so it never happens there).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from flashrt.errors import ConfigError, InputError
from flashrt.runtime.buckets import GraphSet
from flashrt.runtime.buffers import Buffers, BufferSpec
from flashrt.runtime.graphs import backend_for_device
from flashrt.runtime.sampling import greedy_token, penalize, sample_token

__all__ = ["DecodeModel", "DecodeIO", "JoinedBuffers", "Sampling", "Decoder", "Generation"]

DEFAULT_BUCKETS = (16, 64, 256)
MODES = ("greedy", "sample")


@runtime_checkable
class DecodeModel(Protocol):
    """What the runner needs from a model (see the module docstring and `flashrt.frontends.lm`).

    ``prefill(bucket, io)`` may read more than the prompt ids (a VLA's images, a speaker embedding):
    the model keeps those in its own static buffers, written by its own ``write`` before the caller
    starts iterating `Decoder.generate` (the prefill replays at the first ``next``). Its K/V cache
    must hold ``cache_len`` slots; the runner keeps prompt + new tokens within it. A model that keeps
    static buffers of its own exposes them as ``buffers`` (a `Buffers`): graphs are captured against
    them too (`JoinedBuffers`)."""

    device: torch.device
    vocab_size: int
    cache_len: int
    batch: int

    def prefill(self, bucket: int, io: DecodeIO) -> None: ...

    def decode(self, io: DecodeIO) -> None: ...

    def describe(self) -> dict[str, Any]: ...


class JoinedBuffers:
    """The runner's step buffers and the model's own declared buffers (images, K/V cache) as the one
    named set every graph is captured against: a backend that exports the step (onnxrt) makes each an
    input or output instead of baking it in as a constant, and every backend checks their storage.
    Live: `tensors` reads both sets at each call. Names must not clash (ConfigError)."""

    def __init__(self, *sets: Buffers | None) -> None:
        self._sets = [s for s in sets if s is not None]
        names = [n for s in self._sets for n in s.tensors]
        clash = sorted({n for n in names if names.count(n) > 1})
        if clash:
            raise ConfigError(f"the decode runner and its model both declare buffer(s) {clash}; rename them")

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: t for s in self._sets for n, t in s.tensors.items()}


class DecodeIO:
    """The runner's step buffers, by attribute (``io.token``, ``io.position``, ...); see module docstring."""

    def __init__(self, batch: int, prompt_len: int, vocab: int, max_new: int, device: torch.device) -> None:
        i64, f32 = torch.int64, torch.float32
        self.buffers = Buffers([
            BufferSpec("prompt", (batch, prompt_len), i64, "input", low=0, high=vocab - 1),
            BufferSpec("length", (1,), i64, "input", low=1, high=prompt_len),
            BufferSpec("temperature", (1,), f32, "input", low=0.0),
            BufferSpec("top_k", (1,), i64, "input"),
            BufferSpec("top_p", (1,), f32, "input", low=0.0, high=1.0),
            BufferSpec("penalty", (1,), f32, "input", low=1e-6),
            BufferSpec("seed", (1,), i64, "input"),
            BufferSpec("token", (batch, 1), i64, "state", doc="last picked token; input of the next step"),
            BufferSpec("position", (1,), i64, "state", doc="cache slot of `token`"),
            BufferSpec("step", (1,), i64, "state", doc="index of the next output token"),
            BufferSpec("seen", (batch, vocab), torch.bool, "state", doc="tokens for the repetition penalty"),
            BufferSpec("logits", (batch, vocab), f32, "scratch"),
            BufferSpec("out", (batch, max_new), i64, "output", doc="tokens picked so far"),
        ], device)

    def __getattr__(self, name: str) -> torch.Tensor:
        if name == "buffers" or name not in self.buffers:
            raise AttributeError(name)
        return self.buffers[name]


@dataclass(frozen=True)
class Sampling:
    """Decoding settings of one request. temperature 0: greedy; top_k <= 0: off; top_p 1: off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0

    @property
    def mode(self) -> str:
        return "greedy" if self.temperature == 0 else "sample"

    def check(self) -> Sampling:
        if not (self.temperature >= 0 and 0 < self.top_p <= 1 and self.repetition_penalty > 0):
            raise InputError(f"sampling: need temperature >= 0, 0 < top_p <= 1, repetition_penalty > 0; "
                             f"got {self}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise InputError(f"sampling: seed must be an int, got {self.seed!r}")
        return self


@dataclass
class Generation:
    """What the last `generate` did: tokens, why it ended, timings (ms, perf_counter)."""

    prompt_len: int = 0
    tokens: list[int] = field(default_factory=list)
    finish: str = ""
    prefill_ms: float = 0.0
    first_token_ms: float = 0.0
    total_ms: float = 0.0
    decode_replays: int = 0


class Decoder:
    """Captured prefill buckets and decode steps over one `DecodeModel` (module docstring)."""

    def __init__(self, model: DecodeModel, buckets: Iterable[int] = DEFAULT_BUCKETS,
                 max_new_tokens: int = 256, backend: str | None = None, strict: bool = True,
                 constraint: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 candidates: int = 1024, penalty: bool = True) -> None:
        self.model, self.constraint, self.candidates = model, constraint, int(candidates)
        self.penalty = bool(penalty)  # False: no repetition-penalty work in the graphs (requests use 1.0)
        fits = sorted({int(b) for b in buckets if int(b) < model.cache_len})
        self.buckets = tuple(fits) or (model.cache_len - 1,)
        self.max_new_tokens = int(max_new_tokens)
        if self.max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens must be positive, got {max_new_tokens}")
        self.backend = backend_for_device(backend, model.device)
        self.io = DecodeIO(model.batch, self.buckets[-1], model.vocab_size, self.max_new_tokens, model.device)
        self.graph_buffers = JoinedBuffers(self.io.buffers, getattr(model, "buffers", None))
        self.prefills = GraphSet(self.backend, self._prefill_body, self.buckets, buffers=self.graph_buffers,
                                 strict=strict)
        self.steps: dict[str, Any] = {}
        self.captures = {mode: 0 for mode in MODES}
        self.replays = {mode: 0 for mode in MODES}
        self.last = Generation()
        self._busy = threading.Lock()

    # ------------------------------------------------------------------------------ capture
    def capture(self) -> Decoder:
        """Capture every prefill bucket and both decode modes (load time, not the hot path). Capture runs
        the bodies once for real (trace, cuda warm-up), so valid settings are written first."""
        self.write(self.buckets[0], torch.zeros((1, 1), dtype=torch.int64), Sampling())
        self.prefills.capture_all()
        for mode in MODES:
            self.steps[mode] = self.backend.capture(self._decode_body(mode), self.graph_buffers)
            self.captures[mode] += 1
        return self

    def _prefill_body(self, bucket: int):
        io, model = self.io, self.model

        def run() -> None:
            model.prefill(bucket, io)
            if self.penalty:
                prompt = io.prompt[:, :bucket]
                valid = (torch.arange(bucket, device=prompt.device) < io.length).to(torch.float32)
                counts = torch.zeros(io.seen.shape, device=prompt.device).scatter_add_(
                    1, prompt, valid.expand_as(prompt))
                io.seen.copy_(counts > 0)
            io.position.copy_(io.length)
            io.step.zero_()
            self._pick(greedy=False)  # the first token: greedy or sampled by the temperature buffer
        return run

    def _decode_body(self, mode: str):
        io, model = self.io, self.model

        def run() -> None:
            model.decode(io)
            io.position.add_(1)
            self._pick(greedy=mode == "greedy")
        return run

    def _pick(self, greedy: bool) -> None:
        """Penalize, choose, record: token (feeds the next step), out[:, step], seen; step += 1."""
        io = self.io
        logits = penalize(io.logits, io.seen, io.penalty) if self.penalty else io.logits
        if self.constraint is not None:
            logits = self.constraint(logits, io.step)
        chosen = greedy_token(logits)
        if not greedy:
            drawn = sample_token(logits, io.temperature, io.top_k, io.top_p, io.seed, io.step,
                                 self.candidates)
            chosen = torch.where(io.temperature > 0, drawn, chosen)
        io.token.copy_(chosen)
        io.out.index_copy_(1, io.step.clamp(max=io.out.shape[1] - 1), chosen)
        if self.penalty:
            io.seen.scatter_(1, chosen, True)
        io.step.add_(1)

    # ------------------------------------------------------------------------------ hot path
    def check(self, prompt: Any, max_new_tokens: int | None,
              sampling: Sampling) -> tuple[int, torch.Tensor, int]:
        """(bucket, prompt ids (1, L) int64, max new tokens); InputError before anything is written."""
        return check_request(self, prompt, max_new_tokens, sampling)

    def write(self, bucket: int, ids: torch.Tensor, sampling: Sampling) -> None:
        n = ids.shape[-1]
        prompt = torch.zeros((self.model.batch, self.buckets[-1]), dtype=torch.int64)
        prompt[:, :n] = ids
        self.io.buffers.write({
            "prompt": prompt, "length": torch.tensor([n]),
            "temperature": torch.tensor([float(sampling.temperature)]),
            "top_k": torch.tensor([int(sampling.top_k)]), "top_p": torch.tensor([float(sampling.top_p)]),
            "penalty": torch.tensor([float(sampling.repetition_penalty)]),
            "seed": torch.tensor([int(sampling.seed) & 0xFFFFFFFF])})

    def generate(self, prompt: Any, max_new_tokens: int | None = None, stop: Iterable[int] = (),
                 sampling: Sampling | None = None, sync_every: int = 1) -> Iterator[int]:
        """Yield new token ids until a stop token (not yielded) or ``max_new_tokens``."""
        sampling = sampling or Sampling()
        bucket, ids, limit = self.check(prompt, max_new_tokens, sampling)
        if sync_every <= 0:
            raise InputError(f"sync_every must be positive, got {sync_every}")
        if not self._busy.acquire(blocking=False):
            raise ConfigError("this Decoder is generating for another caller; one request at a time")
        try:
            yield from self._run(bucket, ids, limit, frozenset(int(s) for s in stop), sampling, sync_every)
        finally:
            self._busy.release()

    def _run(self, bucket: int, ids: torch.Tensor, limit: int, stop: frozenset[int], sampling: Sampling,
             sync_every: int) -> Iterator[int]:
        gen = self.last = Generation(prompt_len=ids.shape[-1])
        start = time.perf_counter()
        self.write(bucket, ids, sampling)
        with torch.inference_mode():
            self.prefills.replay(bucket)
        gen.prefill_ms = (time.perf_counter() - start) * 1e3
        step, produced, read = self.steps[sampling.mode], 1, 0
        while True:
            with torch.inference_mode():
                while produced < min(limit, read + sync_every):
                    step.replay()
                    produced += 1
                    self.replays[sampling.mode] += 1
            block = self.io.out[0, read:produced].tolist()
            for token in block:
                if not gen.tokens and not gen.first_token_ms:
                    gen.first_token_ms = (time.perf_counter() - start) * 1e3
                if token in stop:
                    return self._finish(gen, start, "stop", produced)
                gen.tokens.append(token)
                yield token
            read = produced
            if produced >= limit:
                return self._finish(gen, start, "length", produced)

    def _finish(self, gen: Generation, start: float, why: str, produced: int) -> None:
        gen.finish, gen.decode_replays = why, produced - 1
        gen.total_ms = (time.perf_counter() - start) * 1e3

    # ------------------------------------------------------------------------------ reporting
    def report(self) -> dict[str, Any]:
        """Captures (they never grow after `capture`), decode replays per mode, the prefill set's counters."""
        return {"decode_captures": dict(self.captures), "decode_replays": dict(self.replays),
                "prefill": self.prefills.report(),
                "backend": self.backend.name, "last": self.last.__dict__.copy()}

    def describe(self) -> dict[str, Any]:
        return {"model": self.model.describe(), "buckets": list(self.buckets), "backend": self.backend.name,
                "max_new_tokens": self.max_new_tokens, "step_buffers_bytes": self.io.buffers.nbytes()}


def check_request(runner: Any, prompt: Any, max_new_tokens: int | None,
                  sampling: Sampling) -> tuple[int, torch.Tensor, int]:
    """A request's checks against a decode runner (its ``model``, ``prefills``, ``buckets``,
    ``max_new_tokens``, ``penalty``): (prompt bucket, ids (1, L) int64, max new tokens), or InputError
    before anything is written."""
    ids, model = _as_ids(prompt), runner.model
    n = ids.shape[-1]
    if n == 0 or ids.min() < 0 or ids.max() >= model.vocab_size:
        raise InputError(f"prompt: {n} token ids, each must lie in [0, {model.vocab_size - 1}]")
    bucket = runner.prefills.select(n)
    if bucket is None:
        raise InputError(f"prompt of {n} tokens exceeds the largest prefill bucket {runner.buckets[-1]}")
    limit = runner.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
    if not 0 < limit <= runner.max_new_tokens or n + limit > model.cache_len:
        raise InputError(f"max_new_tokens {limit}: must lie in 1..{runner.max_new_tokens} and fit the "
                         f"cache with the prompt ({n} + {limit} > {model.cache_len} slots)")
    sampling.check()
    if not runner.penalty and sampling.repetition_penalty != 1.0:
        raise InputError("this decoder was built without the repetition penalty (penalty=False); "
                         f"repetition_penalty must be 1.0, got {sampling.repetition_penalty}")
    return bucket, ids, limit


def _as_ids(prompt: Any) -> torch.Tensor:
    try:
        ids = torch.as_tensor(prompt)
    except (TypeError, ValueError) as exc:
        raise InputError(f"prompt: not a sequence of token ids ({exc})") from None
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise InputError(f"prompt: expected a 1-D sequence of integer token ids, got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    return ids.to(torch.int64)[None]
