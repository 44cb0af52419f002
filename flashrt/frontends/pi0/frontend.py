"""Pi0 / Pi0.5 frontend: declared static buffers and one captured graph per (batch, prompt-length) bucket.

Set up once (`Pi0Frontend.__init__` + `capture`), replay forever (`run`):

* Buffers (`flashrt.runtime.buffers`), allocated once at the LARGEST bucket and the largest batch:
  the model's io buffers (`vision_images`, `vision_masks`, `prefix_tokens`, `prefix_token_masks`,
  [`expert_state`], `expert_noise`, `expert_actions`) and its K/V cache (`prefix_k`, `prefix_v`). The
  graph of a smaller bucket L and batch n reads views of them: the first n rows, the first L token
  columns and the first P(L) + suffix K/V slots. Views never reallocate, so every graph keeps pointing
  at the same storage.
* Graphs: one `GraphSet` per batch bucket (`batches`, default (1,): one observation per replay; e.g.
  (1, 2, 4) for a server that batches robots) over the chosen backend ("eager", "trace", "cuda"),
  all captured at load by `capture()`. Hot path: `bucket = bucket_for(n_tokens)` (the smallest bucket
  holding the prompt; a prompt longer than the largest bucket is an InputError), write the inputs of
  rows 0..n-1, `run(bucket, batch)` (`batch_for(n)`: the smallest batch bucket holding n rows),
  `actions(row)`. Rows are independent: row i's actions depend only on row i's inputs (every op of the
  step is per row), so rows n..batch-1 of a padded batch may hold anything; batching changes a row's
  result only by float rounding (other GEMM shapes), well within 1e-5 in float32.
* The step runs under ``torch.inference_mode`` (no autograd version counters or view tracking: ~3%
  less CPU time; every tensor it writes is a static buffer, its temporaries never escape) and, on a
  GPU, under its pinned numerics (`NUMERICS`, `flashrt.runtime.numerics`: TF32 off unless the load
  asked for it, the SDPA backends in a fixed priority), scoped to the step.
* Real-time chunking (`flashrt.runtime.rtc`) is a static input too: `write_guidance(frozen, weights,
  gains)` fills `expert_rtc_*`, which every denoise step of the captured step reads; `write_guidance()`
  clears the weights (then the step is the unguided one, bit for bit).
* Noise is a static input: `write_noise(check_noise(array))` copies a caller's array,
  `write_noise(seed=s)` samples N(0, 1) with a seeded CPU generator (the same noise
  on every device) and copies it in, `write_noise()` draws
  from the frontend's own generator on the device; always outside the graph. Host values reach the
  device through the buffers' pinned host staging (`Buffers.host` / `upload`), actions come back
  through `actions_host()` (`Buffers.download`): no tensor allocated per call.

Ownership: the frontend owns its Buffers, graphs and generator; the model's weights must keep their
storage for as long as the graphs live (see `flashrt.runtime.graphs`). One call at a time.

Shape legend: B batch (the largest batch bucket), C cameras, R resolution, L prompt bucket, H chunk,
A max action dim.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from flashrt.errors import ConfigError, InputError
from flashrt.frontends.pi0.model import (
    Pi0Model,
    io_buffer_specs,
    kernel_stages,
    kv_buffer_specs,
    meta_twin,
    rtc_buffer_specs,
)
from flashrt.nn.attention import StaticKV
from flashrt.ops.csrc_ops import CUDA_FORMS
from flashrt.profile.kernels import KernelCount, count_kernels
from flashrt.runtime.buffers import Buffers, check_value
from flashrt.runtime.graphs import GraphSet, backend_for_device
from flashrt.runtime.numerics import Numerics
from flashrt.runtime.rtc import euler_times_f32

BUCKET_LADDER = (8, 16, 32, 64, 128, 256, 512)
# SDPA pinned for the family on a GPU: SigLIP's unmasked attention takes flash (bf16 / fp16), the
# Gemmas' attention with its key-padding bias takes memory-efficient (flash has no bias), math is the
# fallback; cuDNN left out (its support for these shapes and its numerics change with cuDNN versions;
# tests/runtime/test_numerics.py compares the backends on these shapes).
NUMERICS = Numerics(tf32=False, sdpa=("flash", "efficient", "math"))


MAX_BATCH = 64  # the largest batch bucket a frontend takes (buffers scale with it)


def default_buckets(max_len: int) -> tuple[int, ...]:
    """Powers of two below the prompt limit, then the limit itself: 48 -> (8, 16, 32, 48)."""
    return (*(b for b in BUCKET_LADDER if b < max_len), max_len)


def batch_buckets(batches: Sequence[int] | None) -> tuple[int, ...]:
    """The batch buckets to capture: the given sizes, sorted, with 1 always among them (one observation
    replays at batch 1, exactly as a frontend built without batching); None -> (1,)."""
    given = list(batches or ())
    if any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_BATCH for b in given):
        raise ConfigError(f"batch buckets must be ints in 1..{MAX_BATCH}, got {given}")
    return tuple(sorted({1, *given}))


class Pi0Frontend:
    """Static buffers + one graph per (batch, prompt) bucket around a loaded `Pi0Model`."""

    def __init__(self, model: Pi0Model, n_cams: int, buckets: Sequence[int], backend: str | None = None,
                 backend_opts: Mapping[str, Any] | None = None, numerics: Numerics = NUMERICS,
                 batches: Sequence[int] | None = None) -> None:
        self.model, self.config, self.numerics = model, model.config, numerics
        self.n_cams = int(n_cams)
        self.device = model.action_in.weight.device
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        if not self.buckets or self.buckets[0] <= 0:
            raise ValueError(f"prompt buckets must be positive, got {buckets}")
        self.max_len = self.buckets[-1]
        self.batches = batch_buckets(batches)
        rows, max_prefix = self.batches[-1], self.config.prefix_len(self.n_cams, self.max_len)
        self.buffers = Buffers([*io_buffer_specs(self.config, rows, self.n_cams, self.max_len),
                                *kv_buffer_specs(self.config, rows, max_prefix, model.dtype),
                                *rtc_buffer_specs(self.config, rows)], self.device)
        self.buffers["expert_rtc_times"].copy_(euler_times_f32(self.config.num_steps))
        spec = self.buffers.spec("expert_noise")
        self._noise_spec = replace(spec, shape=(1, *spec.shape[1:]))  # one row's noise, as callers give it
        self._guided = False
        self.backend = backend_for_device(backend, self.device, **dict(backend_opts or {}))
        self.graph_sets = {n: GraphSet(self.backend, self._build if n == 1 else self._batch_build(n),
                                       self.buckets, buffers=self.buffers) for n in self.batches}
        self.graphs = self.graph_sets[1]
        self.replays: Counter[int] = Counter()  # replays per batch bucket
        self._generator: torch.Generator | None = None  # made on first use (none exists on meta)
        self._seeded = torch.Generator()  # CPU: re-seeded for each seed= draw
        self._kernel_counts: dict[int, KernelCount] = {}

    # ------------------------------------------------------------------------------ capture
    def _batch_build(self, batch: int) -> Callable[[int], Callable[[], None]]:
        return lambda bucket: self._build(bucket, batch)

    def _build(self, bucket: int, batch: int = 1) -> Callable[[], None]:
        """The no-argument step of one bucket: views of the max-size buffers, nothing allocated."""
        run = self.raw_step(bucket, batch)
        if self.device.type != "cuda":  # the scope is empty off CUDA: decided here, not per call

            def step() -> None:
                with torch.inference_mode():
                    run()

            return step

        def pinned_step() -> None:
            with torch.inference_mode(), self.numerics.scope(self.device):
                run()

        return pinned_step

    def raw_step(self, bucket: int, batch: int = 1) -> Callable[[], None]:
        """The step of `bucket` over rows [0, batch) without the inference-mode wrapper (for callers that
        wrap it their own way, e.g. torch.compile, which cannot trace inside inference mode)."""
        b, c, n = self.buffers, self.config, batch
        t = c.prefix_len(self.n_cams, bucket) + c.suffix_len
        kv = StaticKV(b["prefix_k"][:, :n, :, :t], b["prefix_v"][:, :n, :, :t])
        args = (b["vision_images"][:n], b["vision_masks"][:n], b["prefix_tokens"][:n, :bucket],
                b["prefix_token_masks"][:n, :bucket], b["expert_state"][:n] if c.has_state_token else None,
                b["expert_noise"][:n])
        guide = (b["expert_rtc_frozen"][:n], b["expert_rtc_weights"][:n], b["expert_rtc_gains"],
                 b["expert_rtc_times"])
        out, model = b["expert_actions"][:n], self.model
        return lambda: model.sample_actions(*args, kv=kv, out=out, guide=guide)

    def capture(self) -> dict[str, Any]:
        """Capture every (batch, prompt) bucket now (load time); returns the report."""
        for graphs in self.graph_sets.values():
            graphs.capture_all()
        return self.report()

    def kernels_per_replay(self, bucket: int | None = None) -> KernelCount:
        """The kernels one replay of `bucket` (default: the largest) launches on a CUDA device, counted
        on a meta twin of this frontend (`flashrt.profile.kernels`: attention by the backends of its pinned
        numerics, each ``flashrt::`` op one kernel where its csrc kernel takes the call, split by
        `kernel_stages`; computed once per bucket, seconds at full size)."""
        bucket = self.buckets[-1] if bucket is None else bucket
        if bucket not in self._kernel_counts:
            twin = self if self.device.type == "meta" else \
                Pi0Frontend(meta_twin(self.model), self.n_cams, self.buckets, "eager")
            self._kernel_counts[bucket] = count_kernels(twin.raw_step(bucket), self.numerics.sdpa,
                                                        kernel_stages(twin.model), CUDA_FORMS)
        return self._kernel_counts[bucket]

    def report(self) -> dict[str, Any]:
        """The batch-1 GraphSet's report (its buckets, captures, counters), the buffers' bytes, and per
        batch bucket: the prompt buckets captured, capture seconds and replays."""
        sets = {n: g.report() for n, g in self.graph_sets.items()}
        return {**sets[1], "buffers_bytes": self.buffers.nbytes(),
                "buffers_by_role": {r: self.buffers.nbytes(r) for r in ("input", "output", "state")},
                "batches": list(self.batches),
                "batch_captured": {n: r["captured"] for n, r in sets.items()},
                "batch_capture_s": {n: sum(r["capture_s"].values()) for n, r in sets.items()},
                "batch_replays": {n: self.replays[n] for n in self.batches}}

    # ------------------------------------------------------------------------------ hot path
    def bucket_for(self, n_tokens: int) -> int:
        """The smallest bucket holding `n_tokens` prompt tokens; InputError when none does."""
        if self.graphs.select(n_tokens) is None:
            raise InputError(f"prompt of {n_tokens} tokens exceeds the largest bucket {self.max_len}; "
                             f"buckets: {list(self.buckets)}")
        return self.graphs.bucket_for(n_tokens)

    def batch_for(self, rows: int) -> int:
        """The smallest batch bucket holding `rows` observations; InputError beyond the largest."""
        batch = next((n for n in self.batches if n >= rows), None)
        if batch is None or rows < 1:
            raise InputError(f"{rows} rows: batch buckets are {list(self.batches)}")
        return batch

    def check_noise(self, noise: Any) -> torch.Tensor:
        """Validate caller noise: (H, A) or (1, H, A), float, finite; returns (1, H, A) float32."""
        spec = self._noise_spec
        t = noise if isinstance(noise, torch.Tensor) else torch.as_tensor(noise)
        if t.dim() == len(spec.shape) - 1:
            t = t[None]
        if not t.is_floating_point():
            raise InputError(f"noise: expected a float array of shape {spec.shape[1:]}, got dtype {t.dtype}")
        return check_value(spec, t.to(torch.float32))

    def write_noise(self, noise: torch.Tensor | None = None, seed: int | None = None) -> None:
        """Fill row 0's noise: a checked caller array, or N(0, 1) from `seed` (drawn on a CPU generator:
        the same noise on every device) / the own generator (drawn on the device). Host values go
        through the buffer's host staging (`Buffers.host` / `upload`): nothing allocated."""
        self.write_noise_rows([(noise, seed)])

    def write_noise_rows(self, rows: Sequence[tuple[torch.Tensor | None, int | None]]) -> None:
        """`write_noise` for rows 0..n-1, each (noise, seed) as there: a row's values are the ones it
        would get alone. The host rows go up in one upload; rows drawn on the device are drawn after
        it (stream order), so the upload never overwrites them."""
        b, drawn = self.buffers, []
        host = b.host("expert_noise") if any(n is not None or s is not None for n, s in rows) else None
        for row, (noise, seed) in enumerate(rows):
            if noise is not None:
                host[row : row + 1].copy_(noise)
            elif seed is not None:  # == torch.randn(shape, generator=torch.Generator().manual_seed(seed))
                host[row].normal_(generator=self._seeded.manual_seed(int(seed)))
            else:
                drawn.append(row)
        if host is not None:
            b.upload("expert_noise")
        for row in drawn:
            b["expert_noise"][row].normal_(generator=self.generator())  # what randn does, in place

    def generator(self) -> torch.Generator:
        """The frontend's own device generator (seeded from the OS on first use)."""
        if self._generator is None:
            self._generator = torch.Generator(self.device)
            self._generator.seed()
        return self._generator

    def write_guidance(self, frozen: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                       gains: torch.Tensor | None = None) -> None:
        """Real-time chunking inputs of row 0: frozen (H, A) normalized actions (zero-padded), weights
        (H,), gains (num_steps,); None (the default) clears every row's, so the next replay is
        unguided."""
        b = self.buffers
        if frozen is None:
            if self._guided:
                b["expert_rtc_weights"].zero_()
                self._guided = False
            return
        b["expert_rtc_frozen"][0].copy_(frozen)
        b["expert_rtc_weights"][0, :, 0].copy_(weights)
        b["expert_rtc_gains"].copy_(gains)
        self._guided = True

    def run(self, bucket: int, batch: int = 1) -> None:
        """Replay the graph of (`batch`, `bucket`) (from `batch_for`, `bucket_for`), after the inputs of
        rows [0, batch) were written."""
        self.graph_sets[batch].replay(bucket)
        self.replays[batch] += 1

    def actions(self, row: int = 0) -> torch.Tensor:
        """The last replay's actions of `row` (H, A) float32, copied to the host."""
        return self.buffers["expert_actions"][row].to("cpu", copy=True)

    def actions_host(self) -> torch.Tensor:
        """The last replay's actions (B, H, A) float32 on the host without a tensor of their own: the
        buffer itself on the CPU, its pinned twin on CUDA (`Buffers.download`); valid until the next
        replay. `actions()` is the copy to keep."""
        return self.buffers.download("expert_actions")
