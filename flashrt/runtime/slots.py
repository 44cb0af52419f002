"""Slot-batched AR decode: several requests share one captured decode step, each in its own cache row.

    dec = SlotDecoder(load_lm(folder, batch=8), prompt_buckets=(32, 64), max_new_tokens=512).capture()
    a = dec.join(prompt_a, 100, stop={eos})                 # prefill into a free row (slot)
    b = dec.join(prompt_b, 40, sampling=Sampling(0.7, seed=3))
    while dec.live:
        for seat in dec.step(blocks=7):                     # 7 replays of the live bucket, one read
            use(seat, seat.new)                             # tokens of this block; seat.finish when done

It knows no model. A model answers `SlotModel` (`flashrt.frontends.lm.CausalLM` does): a K/V cache
with one row per slot (``batch`` rows) and three graph bodies over the runner's buffers (`SlotIO`):

    prefill graph (one per prompt bucket)    model.prefill_row(bucket, io): the joining prompt into row
                                             io.row only -> io.join_logits; then that row's sampling
                                             knobs, seen-token mask, position = length, step = 0 and
                                             its first token are written (other rows untouched)
    decode graph (one per batch bucket,      model.decode_rows(b, io, keys): rows [0, b), each at its own
    key bucket and mode "greedy" /           position, attending to the first ``keys`` cache slots ->
    "sample")                                logits; each active row advances one token

Per-row state lives in device tensors (token, position, step, seen, temperature, top_k, top_p,
penalty, seed, out), so a request joins at a token boundary and leaves when it stops, and the batch
bucket (1, 2, 4, 8 by default) follows the number of live rows between replays, and the key bucket
(128, 256, ... up to the cache length by default) the furthest slot a block writes, so a step
attends to the slots in use rather than the whole cache (the slots past a row's position are masked
either way: the same values bit for bit): graphs are captured once at load, never after (`report()`
counts captures and replays per graph).

The rows in use are always [0, live): a request that leaves has the last live row moved into its
place (`move_row` of the cache, and the state rows), so the smallest bucket holding ``live`` rows
serves them. ``active`` (host-written, one flag per row) says which rows advance in a replay: rows
beyond ``live`` in the bucket and rows the caller pauses (a request whose consumer is full) are
recomputed but do not move — their token, position, step and outputs stay, and on resume the same
step is taken again — so a paused request costs its neighbours nothing but a row of compute, and
its tokens do not change.

Each row is computed as it would be alone: per-row positions, masks and sampling knobs; the random
variate of row r at step t hashes (seed_r, t) only (`flashrt.runtime.sampling`), so a sampled request
draws exactly as it would alone in `flashrt.runtime.decode.Decoder`, whatever shares its batch. Greedy
tokens equal the request alone (and transformers' `generate`) as long as batching does not change a
GEMM's rounding enough to flip an argmax (tests check it on real prompts).

Host syncs: one read of the new tokens per `step()` (``blocks`` replays); stop tokens are found on the
host; a block never runs a row past its ``max_new_tokens`` (the block is shortened), so the cache and
``out`` are never overrun. One thread drives a SlotDecoder (ConfigError on concurrent use).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, runtime_checkable

import torch

from flashrt.errors import ConfigError, InputError
from flashrt.runtime.buckets import GraphSet
from flashrt.runtime.buffers import Buffers, BufferSpec
from flashrt.runtime.decode import MODES, Generation, JoinedBuffers, Sampling, check_request
from flashrt.runtime.graphs import backend_for_device
from flashrt.runtime.sampling import greedy_token, penalize, sample_token, step_uniforms

__all__ = ["SlotModel", "SlotIO", "Seat", "SlotDecoder", "DEFAULT_BATCH_BUCKETS"]

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8)
FIRST_RANK_BACKENDS = ("eager", "jit")  # run a step's Python branches at replay (not trace, not CUDA graphs)
KNOBS = ("temperature", "top_k", "top_p", "penalty", "seed")
ROW_STATE = ("token", "position", "step", "seen", *KNOBS, "uniform", "out")  # moved with a row when packed


@runtime_checkable
class SlotModel(Protocol):
    """What the slot runner needs from a model (module docstring; `flashrt.frontends.lm.CausalLM`)."""

    device: torch.device
    vocab_size: int
    cache_len: int
    batch: int

    def prefill_row(self, bucket: int, io: SlotIO) -> None: ...

    def decode_rows(self, rows: int, io: SlotIO, keys: int | None = None) -> None: ...

    def move_row(self, src: int, dst: int) -> None: ...

    def describe(self) -> dict[str, Any]: ...


class SlotIO:
    """The runner's buffers, by attribute. S rows, P the largest prompt bucket, V vocabulary, G max new
    tokens. Inputs (the joining request): prompt (1, P), length (1,), row (1,), join_* knobs; the host
    also writes ``active`` (S,) between replays. State (per row): token (S, 1), position, step, seed
    (S,), seen (S, V), temperature, top_k, top_p, penalty (S, 1), uniform (S, G) (the variate of each
    step, tabulated by the prefill). Scratch: logits (S, V), join_logits (1, V). Output: out (S, G), the
    tokens each row picked."""

    def __init__(self, rows: int, prompt_len: int, vocab: int, max_new: int, device: torch.device) -> None:
        i64, f32 = torch.int64, torch.float32
        self.buffers = Buffers([
            BufferSpec("prompt", (1, prompt_len), i64, "input", low=0, high=vocab - 1),
            BufferSpec("length", (1,), i64, "input", low=1, high=prompt_len),
            BufferSpec("row", (1,), i64, "input", low=0, high=rows - 1, doc="the row the prefill writes"),
            BufferSpec("join_temperature", (1, 1), f32, "input", low=0.0),
            BufferSpec("join_top_k", (1, 1), i64, "input"),
            BufferSpec("join_top_p", (1, 1), f32, "input", low=0.0, high=1.0),
            BufferSpec("join_penalty", (1, 1), f32, "input", low=1e-6),
            BufferSpec("join_seed", (1,), i64, "input"),
            BufferSpec("active", (rows,), torch.bool, "input", doc="rows that advance in a decode replay"),
            BufferSpec("rank_pause", (1,), i64, "state",
                       doc="steps left that rank every candidate at once (`sample_token`'s ``first``)"),
            BufferSpec("token", (rows, 1), i64, "state", doc="last picked token of each row"),
            BufferSpec("position", (rows,), i64, "state", doc="cache slot of each row's `token`"),
            BufferSpec("step", (rows,), i64, "state", doc="index of each row's next output token"),
            BufferSpec("seen", (rows, vocab), torch.bool, "state", doc="tokens for the repetition penalty"),
            BufferSpec("temperature", (rows, 1), f32, "state"),
            BufferSpec("top_k", (rows, 1), i64, "state"),
            BufferSpec("top_p", (rows, 1), f32, "state"),
            BufferSpec("penalty", (rows, 1), f32, "state"),
            BufferSpec("seed", (rows,), i64, "state"),
            BufferSpec("uniform", (rows, max_new), f32, "state",
                       doc="each row's sampling variate per step (`step_uniforms` of its seed)"),
            BufferSpec("logits", (rows, vocab), f32, "scratch"),
            BufferSpec("join_logits", (1, vocab), f32, "scratch"),
            BufferSpec("out", (rows, max_new), i64, "output", doc="tokens picked so far, per row"),
        ], device)

    def __getattr__(self, name: str) -> torch.Tensor:
        if name == "buffers" or name not in self.buffers:
            raise AttributeError(name)
        return self.buffers[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.buffers[name]


@dataclass(eq=False)
class Seat:
    """One request in a `SlotDecoder`: its row, what it asked for, what it got so far."""

    limit: int
    stop: frozenset[int]
    sampling: Sampling
    row: int = -1
    produced: int = 1          # tokens picked on the device (the prefill picks the first)
    read: int = 0              # tokens the host has read
    new: list[int] = field(default_factory=list)   # tokens of the last step (stop token excluded)
    paused: bool = False
    finish: str = ""           # "stop", "length", "left" once it is over
    generation: Generation = field(default_factory=Generation)
    started: float = 0.0

    @property
    def done(self) -> bool:
        return bool(self.finish)


class SlotDecoder:
    """Captured prefill buckets and batch-bucket decode steps over one `SlotModel` (module docstring)."""

    def __init__(self, model: SlotModel, prompt_buckets: Iterable[int] = (16, 64, 256),
                 batch_buckets: Iterable[int] = DEFAULT_BATCH_BUCKETS, max_new_tokens: int = 256,
                 backend: str | None = None, strict: bool = True,
                 constraint: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 candidates: int = 1024, penalty: bool = True,
                 key_buckets: Iterable[int] | None = None) -> None:
        self.model, self.constraint, self.candidates = model, constraint, int(candidates)
        self.penalty = bool(penalty)
        fits = sorted({int(b) for b in prompt_buckets if int(b) < model.cache_len})
        self.buckets = tuple(fits) or (model.cache_len - 1,)
        self.batch_buckets = _batch_buckets(batch_buckets, model.batch)
        self.key_buckets = _key_buckets(key_buckets, model.cache_len)
        self.max_new_tokens = int(max_new_tokens)
        if self.max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens must be positive, got {max_new_tokens}")
        self.backend = backend_for_device(backend, model.device)
        # rank the first few tokens and all candidates only when a row keeps more (a host-read branch:
        # backends that run Python control flow, on the CPU; `flashrt.runtime.sampling.sample_token`)
        self.first_ranks = self.backend.name in FIRST_RANK_BACKENDS and model.device.type == "cpu"
        self.io = SlotIO(model.batch, self.buckets[-1], model.vocab_size, self.max_new_tokens, model.device)
        self.graph_buffers = JoinedBuffers(self.io.buffers, getattr(model, "buffers", None))
        self.prefills = GraphSet(self.backend, self._prefill_body, self.buckets, buffers=self.graph_buffers,
                                 strict=strict)
        self.steps = {(mode, keys): GraphSet(self.backend, partial(self._decode_body, mode, keys),
                                             self.batch_buckets, buffers=self.graph_buffers, strict=strict)
                      for mode in MODES for keys in self.key_buckets}
        self.seats: list[Seat] = []          # seats[i] holds row i; rows [0, live) are in use
        self.replays: dict[str, int] = {f"{m}@{b}": 0 for m in MODES for b in self.batch_buckets}
        self.key_replays: dict[int, int] = {k: 0 for k in self.key_buckets}
        self.moves = 0
        self.last = Generation()  # the generation of the request that finished last
        self._active = torch.zeros(model.batch, dtype=torch.bool)
        self._busy = threading.Lock()

    @property
    def rows(self) -> int:
        return self.model.batch

    @property
    def live(self) -> int:
        return len(self.seats)

    @property
    def free(self) -> int:
        return self.rows - len(self.seats)

    # ------------------------------------------------------------------------------ capture
    def capture(self) -> SlotDecoder:
        """Capture every prompt bucket and every (mode, batch bucket) step, then clear every row."""
        self._write_join(self.buckets[0], torch.zeros((1, 1), dtype=torch.int64), Sampling(), 0)
        self.io.buffers.write({"active": torch.zeros(self.rows, dtype=torch.bool)})
        self.prefills.capture_all()
        for steps in self.steps.values():
            steps.capture_all()
        return self

    def _prefill_body(self, bucket: int) -> Callable[[], None]:
        io, model = self.io, self.model

        def run() -> None:
            model.prefill_row(bucket, io)
            row = io.row
            seen = torch.zeros((1, io.seen.shape[1]), dtype=torch.bool, device=io.seen.device)
            if self.penalty:
                prompt = io.prompt[:, :bucket]
                valid = (torch.arange(bucket, device=prompt.device) < io.length).to(torch.float32)
                counts = torch.zeros(seen.shape, device=prompt.device).scatter_add_(
                    1, prompt, valid.expand_as(prompt))
                seen = counts > 0
            step = torch.zeros(1, dtype=torch.int64, device=row.device)
            uniform = step_uniforms(io.join_seed, io.uniform.shape[1])
            chosen = self._pick(io.join_logits, seen, step, *(io[f"join_{k}"] for k in KNOBS),
                                uniform[:, :1], greedy=False, used=None)
            for name in KNOBS:
                io[name].index_copy_(0, row, io[f"join_{name}"])
            io.uniform.index_copy_(0, row, uniform)
            if self.penalty:
                seen = seen.scatter(1, chosen, torch.ones_like(chosen, dtype=torch.bool))  # traceable (jit)
            io.seen.index_copy_(0, row, seen)
            io.position.index_copy_(0, row, io.length)
            io.step.index_copy_(0, row, step + 1)
            io.token.index_copy_(0, row, chosen)
            io.out.select(1, 0).index_copy_(0, row, chosen[:, 0])
        return run

    def _decode_body(self, mode: str, keys: int, rows: int) -> Callable[[], None]:
        io, model = self.io, self.model

        def run() -> None:
            model.decode_rows(rows, io, keys)
            active, step = io.active[:rows], io.step[:rows]
            advance = active.to(torch.int64)
            io.position[:rows].add_(advance)
            knobs = (io[k][:rows] for k in KNOBS)
            greedy = mode == "greedy"
            at = step[:, None].clamp(max=io.out.shape[1] - 1)
            u = None if greedy else io.uniform[:rows].gather(1, at)
            chosen = self._pick(io.logits[:rows], io.seen[:rows], step, *knobs, u, greedy=greedy,
                                used=active[:, None])
            chosen = torch.where(active[:, None], chosen, io.token[:rows])
            io.token[:rows].copy_(chosen)
            out = io.out[:rows]
            out.scatter_(1, at, torch.where(active[:, None], chosen, out.gather(1, at)))
            if self.penalty:
                seen = io.seen[:rows]
                seen.scatter_(1, chosen, seen.gather(1, chosen) | active[:, None])
            step.add_(advance)
        return run

    def _pick(self, logits: torch.Tensor, seen: torch.Tensor, step: torch.Tensor, temperature: torch.Tensor,
              top_k: torch.Tensor, top_p: torch.Tensor, penalty: torch.Tensor, seed: torch.Tensor,
              u: torch.Tensor | None, greedy: bool, used: torch.Tensor | None) -> torch.Tensor:
        """(R, V) logits of R rows at their steps (R,) -> (R, 1) tokens, each row with its own knobs and
        its variate ``u`` (R, 1) of this step (sampled graphs; None in greedy ones). ``used`` (R, 1): the
        rows whose token is kept (None: all); a sampled draw is taken where the temperature is above 0."""
        if self.penalty:
            logits = penalize(logits, seen, penalty)
        if self.constraint is not None:
            logits = self.constraint(logits, step[:, None])
        chosen = greedy_token(logits)
        if not greedy:
            sampled = temperature > 0
            first = used_rows = None
            if self.first_ranks:  # only the first-ranks try asks which rows are kept
                first, used_rows = self.io.rank_pause, sampled if used is None else sampled & used
            drawn = sample_token(logits, temperature, top_k, top_p, seed, step, self.candidates, u=u,
                                 first=first, used=used_rows)
            chosen = torch.where(sampled, drawn, chosen)
        return chosen

    # ------------------------------------------------------------------------------ requests
    def check(self, prompt: Any, max_new_tokens: int | None,
              sampling: Sampling) -> tuple[int, torch.Tensor, int]:
        """(prompt bucket, ids (1, L), max new tokens); InputError before anything is written."""
        return check_request(self, prompt, max_new_tokens, sampling)

    def join(self, prompt: Any, max_new_tokens: int | None = None, stop: Iterable[int] = (),
             sampling: Sampling | None = None) -> Seat:
        """Prefill a request into the next free row; its first token is read by the next `step`.
        InputError for a bad request, ConfigError when every row is taken (check `free` first)."""
        sampling = sampling or Sampling()
        bucket, ids, limit = self.check(prompt, max_new_tokens, sampling)
        stops = frozenset(int(s) for s in stop)
        with self._driving():
            if not self.free:
                raise ConfigError(f"all {self.rows} rows of this SlotDecoder are taken; wait for a free one")
            seat = Seat(limit, stops, sampling, row=self.live, started=time.perf_counter())
            seat.generation = Generation(prompt_len=ids.shape[-1])
            self._write_join(bucket, ids, sampling, seat.row)
            with torch.inference_mode():
                self.prefills.replay(bucket)
            self.seats.append(seat)
            seat.generation.prefill_ms = (time.perf_counter() - seat.started) * 1e3
        return seat

    def _write_join(self, bucket: int, ids: torch.Tensor, sampling: Sampling, row: int) -> None:
        n = ids.shape[-1]
        prompt = torch.zeros((1, self.buckets[-1]), dtype=torch.int64)
        prompt[:, :n] = ids
        self.io.buffers.write({
            "prompt": prompt, "length": torch.tensor([n]), "row": torch.tensor([row]),
            "join_temperature": torch.tensor([[float(sampling.temperature)]]),
            "join_top_k": torch.tensor([[int(sampling.top_k)]]),
            "join_top_p": torch.tensor([[float(sampling.top_p)]]),
            "join_penalty": torch.tensor([[float(sampling.repetition_penalty)]]),
            "join_seed": torch.tensor([int(sampling.seed) & 0xFFFFFFFF])})

    def step(self, blocks: int = 1) -> list[Seat]:
        """Decode replays of the smallest bucket holding the live rows until each has ``blocks`` unread
        tokens (fewer when a row would pass its ``max_new_tokens``), then one read. Returns the seats
        that got tokens (in ``seat.new``) or finished (``seat.finish``); finished seats have left."""
        if blocks <= 0:
            raise InputError(f"blocks must be positive, got {blocks}")
        with self._driving():
            running = [s for s in self.seats if not s.paused]
            # a block ends when each row has ``blocks`` unread tokens (a new row's first is its prefill's)
            due = [min(blocks - (s.produced - s.read), s.limit - s.produced) for s in running]
            replays = max(0, min(due)) if running else 0
            if replays > 0:
                self._replay(running, replays)
            return self._read()

    def _replay(self, running: list[Seat], replays: int) -> None:
        active = torch.zeros(self.rows, dtype=torch.bool)
        for seat in running:
            active[seat.row] = True
        if not torch.equal(active, self._active):
            self.io.buffers.write({"active": active})
            self._active = active
        mode = "sample" if any(s.sampling.mode == "sample" for s in running) else "greedy"
        keys = self._keys(replays)
        steps = self.steps[(mode, keys)]
        bucket = steps.select(self.live)
        graph = steps.graph(bucket)
        with torch.inference_mode():
            graph.replay(replays)  # a block of steps (one call on the jit backend: one GIL hand-back)
        self.replays[f"{mode}@{bucket}"] += replays
        self.key_replays[keys] += replays
        for seat in running:
            seat.produced += replays

    def _keys(self, replays: int) -> int:
        """The smallest key bucket holding every slot this block writes: a live row's token sits at
        slot prompt + produced - 1 and the block's replays write the next ones (rows in the batch
        bucket past the live ones sit at slot 0, `_release`)."""
        top = max(s.generation.prompt_len + s.produced - 1 for s in self.seats) + replays
        return next((k for k in self.key_buckets if k >= top), self.key_buckets[-1])

    def _read(self) -> list[Seat]:
        due = [s for s in self.seats if s.produced > s.read]
        if not due:
            return []
        lo, hi = min(s.read for s in due), max(s.produced for s in due)
        block = self.io.buffers.download("out")[:self.live, lo:hi].tolist()
        now = time.perf_counter()
        for seat in due:
            self._take(seat, block[seat.row][seat.read - lo:seat.produced - lo], now)
        for seat in [s for s in due if s.done]:
            self._release(seat)
        return due

    def _take(self, seat: Seat, tokens: list[int], now: float) -> None:
        gen, seat.new = seat.generation, []
        if not gen.first_token_ms:
            gen.first_token_ms = (now - seat.started) * 1e3
        seat.read = seat.produced
        for token in tokens:
            if token in seat.stop:
                return self._finish(seat, "stop", now)
            seat.new.append(token)
            gen.tokens.append(token)
        if seat.produced >= seat.limit:
            self._finish(seat, "length", now)

    def _finish(self, seat: Seat, why: str, now: float) -> None:
        seat.finish = why
        seat.generation.finish, seat.generation.decode_replays = why, seat.produced - 1
        seat.generation.total_ms = (now - seat.started) * 1e3
        self.last = seat.generation

    def leave(self, seat: Seat) -> None:
        """A request that stops early (cancelled): free its row at once (no-op once it has left)."""
        with self._driving():
            if seat in self.seats:
                self._finish(seat, "left", time.perf_counter())
                self._release(seat)

    def pause(self, seat: Seat, paused: bool = True) -> None:
        """Hold a seat in place (its row is recomputed but does not advance) or let it go on."""
        seat.paused = bool(paused)

    def _release(self, seat: Seat) -> None:
        """Free the seat's row; the last live row moves into it, so rows [0, live) stay packed."""
        row, last = seat.row, self.live - 1
        self.seats.remove(seat)
        seat.row = -1
        if row != last:
            moved = self.seats[-1]
            self.seats.remove(moved)
            self.seats.insert(row, moved)
            self.model.move_row(last, row)
            for name in ROW_STATE:
                self.io[name][row].copy_(self.io[name][last])
            moved.row = row
            self.moves += 1
        self.io.position[last] = 0  # a free row is still computed in its bucket: its writes stay in slot 0

    # ------------------------------------------------------------------------------ reporting
    @contextmanager
    def _driving(self) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise ConfigError("this SlotDecoder is driven by another thread; one driver at a time")
        try:
            yield
        finally:
            self._busy.release()

    def report(self) -> dict[str, Any]:
        """Captures per graph (they never grow after `capture`), replays per (mode@batch bucket), rows."""
        return {"prefill": self.prefills.report(),
                "captures": self.prefills.captures + sum(g.captures for g in self.steps.values()),
                "decode_captured": {m: sorted({b for (mode, _), g in self.steps.items() if mode == m
                                               for b in g.report()["captured"]}) for m in MODES},
                "decode_replays": {k: v for k, v in self.replays.items() if v},
                "key_replays": {k: v for k, v in self.key_replays.items() if v},
                "rows": self.rows, "live": self.live, "row_moves": self.moves, "backend": self.backend.name}

    def describe(self) -> dict[str, Any]:
        return {"model": self.model.describe(), "prompt_buckets": list(self.buckets),
                "batch_buckets": list(self.batch_buckets), "key_buckets": list(self.key_buckets),
                "rows": self.rows, "backend": self.backend.name,
                "max_new_tokens": self.max_new_tokens, "step_buffers_bytes": self.io.buffers.nbytes()}


def _key_buckets(buckets: Iterable[int] | None, cache_len: int) -> tuple[int, ...]:
    """The cache lengths a decode step attends to, always ending with the whole cache; None: 128,
    256, 512, ... below it (a step's attention costs its key count in every row: at 8 rows over a
    2048-slot cache it was half of a 64-wide model's step; from 128 rather than 512 keys, an 8-row
    step of the 64-wide model over its first 128 positions, where a request's first audio is made,
    took 5.0 instead of 6.0 ms per 7 tokens)."""
    if buckets is None:
        buckets = [128 << i for i in range(max(0, int(cache_len).bit_length())) if 128 << i < cache_len]
    sizes = sorted({int(b) for b in buckets if 0 < int(b) < cache_len} | {int(cache_len)})
    return tuple(sizes)


def _batch_buckets(buckets: Iterable[int], rows: int) -> tuple[int, ...]:
    """The batch buckets that fit the model's rows, always ending with ``rows`` itself."""
    if rows < 1:
        raise ConfigError(f"a slot-batched model needs at least one row (batch), got {rows}")
    sizes = sorted({int(b) for b in buckets if 0 < int(b) < rows} | {rows})
    return tuple(sizes)
