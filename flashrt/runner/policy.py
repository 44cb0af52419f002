"""Robot policies behind one runner: `load_policy(path)` -> `Policy` with `infer`, `step`, `reset`.

    policy = load_policy("path/to/checkpoint", device="cuda")   # the family is detected
    out = policy.infer(obs, seed=0)    # {"actions": (chunk, action_dim) float32, "timing", "bucket"}
    policy.reset()                     # new episode
    action = policy.step(obs)          # one action per control tick; replans every n_action_steps
    outs = policy.infer_batch([Request(obs_a, seed=1), Request(obs_b, seed=2)])   # several robots

The runner knows no model. It drives a `flashrt.runtime.frontend.PolicyFrontend` through its verbs
(check -> write -> replay -> read) and owns only the call pattern: argument checks, the action queue,
the replan period, timing, and one caller at a time. The family (found through
`flashrt.frontends.registry`) owns the observation spelling, preprocessing, tokenization,
normalization and the captured step.

Guarantees (tested):
* Every argument (`seed`, `noise`, the whole observation) is checked before any static buffer is
  written: a bad call raises `InputError` and the next good call is bit-identical to a fresh policy's.
* `step()` checks its observation on every tick, not only on replanning ticks.
* Outputs are checked finite on the host copy the runner already holds (no device sync added); a
  NaN/inf chunk raises `NumericalError` and is never queued.
* Host work: `infer` makes no CUDA event unless a device-clock `timer` is passed, and the tensors it
  allocates outside the replay are a small constant, the same for every model size (the families
  write through preallocated, pinned staging; `flashrt.profile.alloc` counts them, a test pins them).
* Batches (`infer_batch`, a server's several robots): every request is checked on its own first; a
  refused one is answered with its own error and never reaches a buffer, the others run as one
  replay per group of up to the largest batch bucket (`batches`), each in its own row with its own
  noise, and get the actions `infer` gives them alone (up to float rounding: other GEMM shapes; a
  group of one runs exactly as `infer`). A family that cannot batch says why (`cannot_batch`) and
  runs the requests one by one.
* Threads: a policy serializes its callers with one lock (`infer`, `step`, `reset` each take it; an
  uncontended acquire is negligible next to a step). Two threads on one policy get correct results
  one after the other, never a mix of each other's buffers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt.errors import CheckpointError, ConfigError, NumericalError
from flashrt.frontends.registry import policy_families
from flashrt.io.hub import resolve_checkpoint
from flashrt.io.inputs import check_seed
from flashrt.profile import StageTimer
from flashrt.runtime.frontend import PolicyFamily, PolicyFrontend

__all__ = ["Policy", "Request", "load_policy", "detect_family", "check_seed", "batch_ladder"]

log = logging.getLogger(__name__)
NON_FINITE = ("the policy produced NaN/inf actions: the checkpoint's weights or statistics are broken (they "
              "were finite at load), or the precision overflows; try precision='float32'")
HOST = "cpu"  # the clock of the runner's own stage timer: host wall-clock, no per-call CUDA events


@dataclass(frozen=True)
class Request:
    """One observation of `Policy.infer_batch`, with the randomness `infer` takes (`noise`, `seed`)."""

    obs: Mapping[str, Any]
    noise: Any = None
    seed: Any = None


@dataclass(frozen=True)
class _Ready:
    """A checked request of a batch: its index, prompt bucket, checked form, seed, validate time."""

    index: int
    bucket: int
    checked: Any
    seed: int | None
    validate_ms: float


def batch_ladder(max_batch: int) -> tuple[int, ...]:
    """Batch buckets up to `max_batch`: powers of two below it, then it: 4 -> (1, 2, 4), 6 -> (1, 2, 4, 6)."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ConfigError(f"max_batch must be a positive int, got {max_batch!r}")
    return (*(1 << k for k in range(max_batch.bit_length()) if 1 << k < max_batch), max_batch)


def _replan_period(frontend: PolicyFrontend, n_action_steps: Any) -> int:
    n = frontend.n_action_steps if n_action_steps is None else n_action_steps
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 < int(n) <= frontend.chunk_size:
        raise ConfigError(f"n_action_steps {n!r} must be an int in 1..{frontend.chunk_size} (the chunk size)")
    return int(n)


class Policy:
    """A loaded policy: validated observation -> static buffers -> replay -> un-normalized actions.

    Owns its frontend; `step` keeps an action queue that `reset` clears. Callers are serialized by one
    lock (module docstring)."""

    def __init__(self, frontend: PolicyFrontend, n_action_steps: int | None = None) -> None:
        self.frontend = frontend
        self.n_action_steps = _replan_period(frontend, n_action_steps)
        self._queue: deque[np.ndarray] = deque()
        self._lock = threading.RLock()
        self.last_timing: dict[str, float] = {}

    @property
    def chunk_size(self) -> int:
        return self.frontend.chunk_size

    @property
    def action_dim(self) -> int:
        return self.frontend.action_dim

    @property
    def queued(self) -> int:
        """Actions left before the next replan."""
        return len(self._queue)

    @property
    def batches(self) -> tuple[int, ...]:
        """Batch buckets of the frontend: observations one replay serves ((1,): one at a time)."""
        return tuple(getattr(self.frontend, "batches", (1,)))

    @property
    def max_batch(self) -> int:
        return self.batches[-1]

    @property
    def cannot_batch(self) -> str:
        """Why this policy serves one observation per replay; "" when it batches."""
        if self.max_batch > 1:
            return ""
        return getattr(self.frontend, "cannot_batch", "") or \
            f"{type(self.frontend).__name__} declares no batch buckets"

    # ------------------------------------------------------------------------------ hot path
    def infer(self, obs: Mapping[str, Any], noise: Any = None, seed: int | None = None,
              timer: StageTimer | None = None, guide: Any = None) -> dict[str, Any]:
        """One observation -> a whole chunk: {"actions": (chunk_size, action_dim) float32, "timing",
        "bucket"}. `noise` (the family's noise shape) or `seed` fix the randomness.

        `timer` (a `flashrt.profile.StageTimer`, optional) receives the stages of this call: "validate"
        (every check; nothing written), "h2d" (static buffers written), "replay" (the captured step) and
        "postprocess" (outputs to the host, un-normalized, checked finite). Without one, "timing" is
        host wall-clock (no CUDA events are made per call): on a GPU "replay_ms" is then the launch,
        and the wait for the step lands in "postprocess_ms"; pass ``timer=StageTimer(policy.device)``
        for the stages on the device's clock.

        `guide` (a `flashrt.runtime.rtc.Guidance`, optional): real-time chunking, for families whose
        frontend has `supports_guidance` (ConfigError otherwise); `flashrt.AsyncPolicy` builds it."""
        with self._lock:
            seed = check_seed(seed)
            start = time.perf_counter()
            timer = timer if timer is not None else StageTimer(HOST)
            first = len(timer)
            with timer.stage("validate"):
                bucket, checked = self._check(obs, noise, guide)
            actions = self._run(bucket, checked, seed, timer)
            ms = {r.stage: r.ms for r in timer.records(first)}
            timing = {"preprocess_ms": ms["validate"] + ms["h2d"], "replay_ms": ms["replay"],
                      "postprocess_ms": ms["postprocess"], "total_ms": (time.perf_counter() - start) * 1e3}
            self.last_timing = timing
            return {"actions": actions, "timing": timing, "bucket": bucket}

    def _check(self, obs: Mapping[str, Any], noise: Any, guide: Any) -> tuple[int, Any]:
        if guide is None:
            return self.frontend.check(obs, noise)
        if not getattr(self.frontend, "supports_guidance", False):
            raise ConfigError(f"{type(self.frontend).__name__} does not support real-time chunking guidance")
        return self.frontend.check(obs, noise, guide=guide)

    def _run(self, bucket: int, checked: Any, seed: int | None, timer: StageTimer) -> np.ndarray:
        with timer.stage("h2d"):
            self.frontend.write(bucket, checked, seed)
        with timer.stage("replay"):
            self.frontend.replay(bucket)
        with timer.stage("postprocess"):
            actions = self.frontend.read(checked)
            if not np.isfinite(actions).all():
                raise NumericalError(NON_FINITE)
        return actions

    def infer_batch(self, requests: Sequence[Request]) -> list[dict[str, Any] | Exception]:
        """Several observations (several robots) -> for each, `infer`'s result dict (plus "rows": the
        observations its replay served, "batch": the batch bucket) or the exception its request raised
        (returned, not raised). Each request is checked alone before any buffer is written; the good
        ones run in arrival order in groups of up to `max_batch`, one replay per group at the longest
        prompt's bucket (module docstring). A non-finite row is that request's NumericalError only."""
        with self._lock:
            start = time.perf_counter()
            out: list[Any] = [None] * len(requests)
            ready = []
            for index, request in enumerate(requests):
                try:
                    ready.append(self._check_request(index, request))
                except Exception as exc:  # this request's own error, answered to it alone
                    out[index] = exc
            for k in range(0, len(ready), self.max_batch):
                group = ready[k : k + self.max_batch]
                try:
                    results = self._run_group(group, start)
                except Exception as exc:  # the group's write/replay/read failed: each of its requests says so
                    results = [exc] * len(group)
                for item, result in zip(group, results):
                    out[item.index] = result
            return out

    def _check_request(self, index: int, request: Request) -> _Ready:
        start = time.perf_counter()
        seed = check_seed(request.seed)
        bucket, checked = self.frontend.check(request.obs, request.noise)
        return _Ready(index, bucket, checked, seed, (time.perf_counter() - start) * 1e3)

    def _run_group(self, group: Sequence[_Ready], start: float) -> list[dict[str, Any] | Exception]:
        """One replay for the group: a group of one exactly as `infer`, else its rows at the smallest
        batch bucket holding them and the largest prompt bucket among them."""
        timer = StageTimer(HOST)
        if len(group) == 1:
            one = group[0]
            actions, batch, bucket = [self._run(one.bucket, one.checked, one.seed, timer)], 1, one.bucket
        else:
            batch, bucket = self.frontend.batch_for(len(group)), max(item.bucket for item in group)
            with timer.stage("h2d"):
                self.frontend.write_rows(bucket, [(item.checked, item.seed) for item in group])
            with timer.stage("replay"):
                self.frontend.replay(bucket, batch)
            with timer.stage("postprocess"):
                actions = self.frontend.read_rows([item.checked for item in group])
        ms = {r.stage: r.ms for r in timer.records()}
        total = (time.perf_counter() - start) * 1e3
        results: list[dict[str, Any] | Exception] = []
        for item, chunk in zip(group, actions):
            timing = {"preprocess_ms": item.validate_ms + ms["h2d"], "replay_ms": ms["replay"],
                      "postprocess_ms": ms["postprocess"], "total_ms": total}
            results.append({"actions": chunk, "timing": timing, "bucket": bucket, "rows": len(group),
                            "batch": batch} if np.isfinite(chunk).all() else NumericalError(NON_FINITE))
        self.last_timing = results[-1]["timing"] if isinstance(results[-1], dict) else self.last_timing
        return results

    def step(self, obs: Mapping[str, Any], noise: Any = None, seed: int | None = None,
             timer: StageTimer | None = None) -> np.ndarray:
        """One action (action_dim,) per control tick; a new chunk is inferred every n_action_steps.
        The observation is checked on every tick. `timer` (optional) receives the stages of the tick
        ("validate" every tick; "h2d", "replay", "postprocess" on a replanning tick), as `infer`'s;
        without one a tick that only pops a queued action times nothing."""
        with self._lock:
            seed = check_seed(seed)
            with timer.stage("validate") if timer is not None else contextlib.nullcontext():
                bucket, checked = self.frontend.check(obs, noise)
            if not self._queue:
                chunk = self._run(bucket, checked, seed, timer if timer is not None else StageTimer(HOST))
                self._queue.extend(chunk[: self.n_action_steps])
            return self._queue.popleft()

    def reset(self) -> None:
        """Start a new episode: forget the queued actions."""
        with self._lock:
            self._queue.clear()

    def info(self) -> dict[str, Any]:
        return {**self.frontend.describe(), "n_action_steps": self.n_action_steps,
                "graphs": self.frontend.report()}

    def __getattr__(self, name: str) -> Any:
        """Family attributes (cameras, state_dim, checkpoint, config, ...) read through to the
        frontend, so family-aware callers (bench adapters, the demo) need no unwrapping."""
        if name.startswith("_") or name == "frontend":
            raise AttributeError(name)
        return getattr(self.frontend, name)


# ---------------------------------------------------------------------------------- loading
def detect_family(path: str | Path, families: Mapping[str, PolicyFamily] | None = None) -> PolicyFamily:
    """The one registered family that claims `path`; CheckpointError listing every family tried and
    why each declined when none does."""
    folder = Path(path)
    known = policy_families() if families is None else dict(families)
    if not folder.exists():
        raise CheckpointError(f"{folder} does not exist (a policy checkpoint is a folder)")
    reasons = {}
    for name, family in known.items():
        try:
            family.detect(folder)
        except CheckpointError as exc:
            reasons[name] = str(exc)
            continue
        return family
    tried = "; ".join(f"{name}: {why}" for name, why in reasons.items())
    raise CheckpointError(f"{folder}: no policy family recognises it. Tried {tried}")


def cli_options(tokenizer: str | Path | None = None, embodiment: str | None = None) -> dict[str, Any]:
    """The family options a command line gives `load_policy`: ``--tokenizer PATH``, ``--embodiment TAG``
    (GROOT: a tag name, or its integer id as digits); the family refuses an option it does not take."""
    options: dict[str, Any] = {}
    if tokenizer is not None:
        options["tokenizer"] = str(tokenizer)
    if embodiment is not None:
        options["embodiment"] = int(embodiment) if embodiment.isdigit() else embodiment
    return options


def load_policy(path: str | Path, device: str | torch.device = "cpu",
                precision: str | torch.dtype = "float32", num_steps: int | None = None,
                backend: str | None = None, buckets: Sequence[int] | None = None,
                n_action_steps: int | None = None, family: str | None = None, allow_download: bool = False,
                batches: Sequence[int] | None = None, **options: Any) -> Policy:
    """Load a policy checkpoint directory (the family is detected) and capture its graphs.

    device          "cpu", "cuda", "cuda:N" or "auto"
    precision       one of `flashrt.quant.precision.compute_dtype`'s names ("fp32" = "float32",
                    "bf16" = "bfloat16", "fp16" = "float16") or a torch dtype
    num_steps       flow-matching steps (default: the checkpoint's)
    backend         graph backend "eager" | "trace" | "cuda" (default: cuda on a GPU, eager on the CPU)
    buckets         prompt-length buckets (default: the family's ladder up to the checkpoint's limit)
    n_action_steps  replan period of `step` (default: the checkpoint's)
    family          skip detection and load as this family
    batches         batch buckets to capture, e.g. (1, 2, 4) (`infer_batch`; default: one observation
                    per replay); a family that cannot batch refuses it (ConfigError saying why; its
                    `PolicyFamily.options` has no "batches")
    allow_download  a hub id (``owner/name``) not in the local Hugging Face cache may be downloaded
                    (default: the local cache only; `flashrt.io.hub`)
    options         the family's own options (Pi0: tokenizer, asset_id; GROOT: embodiment, ...)
    """
    path = resolve_checkpoint(path, allow_download)
    known = policy_families()
    if family is not None and family not in known:
        raise ConfigError(f"unknown policy family {family!r}; known: {sorted(known)}")
    fam = known[family] if family is not None else detect_family(path, known)
    if batches is not None and tuple(batches) != (1,):
        if "batches" not in fam.options:
            raise ConfigError(f"{fam.name} policies cannot batch (one observation per replay); load them "
                              f"without batches={tuple(batches)}")
        options["batches"] = tuple(batches)
    unknown = sorted(set(options) - set(fam.options))
    if unknown:
        raise ConfigError(f"{fam.name} policies take no option(s) {unknown}; their options: "
                          f"{sorted(fam.options)}")
    start = time.perf_counter()
    log.info("loading %s as a %s policy (device %s, precision %s)", path, fam.name, device, precision)
    frontend = fam.load(Path(path), device=device, precision=precision, num_steps=num_steps,
                        backend=backend, buckets=buckets, **options)
    captured = frontend.report().get("capture_s", {})
    log.info("%s loaded in %.2f s (capture %.2f s over %d buckets)", path, time.perf_counter() - start,
             sum(captured.values()) if isinstance(captured, dict) else 0.0, len(frontend.buckets))
    return Policy(frontend, n_action_steps)
