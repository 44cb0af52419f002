"""`flashrt bench`: one benchmark run, from a profile to a results file, a figure and a JSON line.

Protocol (the order matters; each step is in the results):
1. Lock the configuration: profile (+ overrides), device check (a profile this machine cannot run is
   refused, status "refused"), environment record.
2. Cold start, reported apart from steady state: registry import, adapter build (the factory's own
   phases: load, calibration, capture ...), first call.
3. Freeze the trace (generated from the profile's seed or loaded from a recorded file); every input is
   hashed and the digests are saved with the results.
4. Quality gate before any timing counts: the reference implementation (`quality.reference`) runs the
   whole trace; the measured implementation (and the `--vs` one) must match it within the profile's
   atol/rtol on every input, or the run stops with status "gated-out". Timed attempts are gated too.
5. Warm-up, then timed attempts, A/B/A/B when comparing; failures are counted, never dropped.
6. Per-stage and total statistics, deadline misses at the target rate, memory, roofline.
The result is a `BenchResult` (schema below); `write_outputs` adds the JSON file and the PNG.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from flashrt.bench import memory
from flashrt.bench.env import environment
from flashrt.bench.gate import compare
from flashrt.bench.profiles import Profile, check_device
from flashrt.bench.registry import ReferenceUnavailable, get_benchmark
from flashrt.bench.roofline import device_peak, roofline
from flashrt.bench.sidebyside import Side, interleave, pair_speedups, summarize_pairs
from flashrt.bench.trace import FrozenTrace
from flashrt.profile.stats import LatencyStats
from flashrt.profile.timers import StageTimer

SCHEMA = "flashrt.bench.result/1"


@dataclass
class BenchResult:
    """Results of one `flashrt bench` run; `to_dict()` is the results JSON (keys pinned by a test).

    schema          "flashrt.bench.result/1"
    kind            "bench"
    benchmark       registry name; implementation: the measured side's name (e.g. "flashrt:trace")
    status          "ok" | "gated-out" | "refused" (profile not runnable here) | "error"; reason: why
    profile         the profile as run (overrides applied)
    trace           {seed, source, length, digest, inputs: [sha256 per input]}
    gate            {reference, atol, rtol, passed, checked, failed, max_abs, where, reason, vs}
    cold_start_ms   {process_start, registry_import, build, <adapter phases: load, capture ...>,
                     reference_build, first_call, vs_build, vs_first_pass (whole trace; includes
                     torch.compile's compilation)}
    steady          {warmup, iters, attempts, failures, errors, total: LatencyStats,
                     stages: {stage: LatencyStats}}  (LatencyStats keys: see flashrt.profile.stats)
    vs              null, or {name, status, reason, attempts, failures, errors, total, stages, pairs,
                     pairs_with_failure, speedup_median, speedup_p10, speedup_p90}
    memory          {rss_start, rss_end, peak_rss, cuda, adapter: {buffers, weights, ...}}
    kernels         null, or {total, top: {op: count}}: kernels one replay launches on a GPU, counted on
                     the meta device (`flashrt.profile.kernels`; adapters with `kernels_per_replay()`)
    roofline        null, or {basis, flops_per_call, bytes_per_call, achieved_tflops, achieved_gbs,
                     compute_fraction, bandwidth_fraction, intensity, ridge, bound, peak}
    env             flashrt.bench.env.environment()
    files           {json, png, trace} paths written (filled by write_outputs)
    """

    benchmark: str
    status: str = "ok"
    reason: str = ""
    implementation: str = ""
    profile: dict[str, Any] = field(default_factory=dict)
    trace: dict[str, Any] = field(default_factory=dict)
    gate: dict[str, Any] = field(default_factory=dict)
    cold_start_ms: dict[str, float] = field(default_factory=dict)
    steady: dict[str, Any] = field(default_factory=dict)
    vs: dict[str, Any] | None = None
    memory: dict[str, Any] = field(default_factory=dict)
    roofline: dict[str, Any] | None = None
    kernels: dict[str, Any] | None = None
    env: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    schema: str = SCHEMA
    kind: str = "bench"
    plot_data: dict[str, Any] = field(default_factory=dict, repr=False)
    frozen_trace: FrozenTrace | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        from flashrt.profile.report import to_jsonable

        out = asdict(replace(self, frozen_trace=None, plot_data={}))  # asdict would deep-copy them
        out.pop("plot_data")
        out.pop("frozen_trace")
        head = {"schema": out.pop("schema"), "kind": out.pop("kind")}
        return to_jsonable(head | out)

    def summary_line(self) -> dict[str, Any]:
        """The one JSON line for scripts: status, the headline numbers and where the rest is."""
        total = self.steady.get("total")
        line = {"schema": self.schema, "kind": self.kind, "benchmark": self.benchmark, "status": self.status,
                "implementation": self.implementation, "profile": self.profile.get("name"),
                "trace_digest": self.trace.get("digest"), "reason": self.reason or None}
        if isinstance(total, LatencyStats):
            line |= {k: getattr(total, k) for k in ("p50", "p90", "p99", "max", "jitter", "miss_rate",
                                                    "deadline_ms")}
        if self.kernels:
            line["kernels_per_replay"] = self.kernels.get("total")
        if self.vs:
            line |= {"vs": self.vs.get("name"), "vs_status": self.vs.get("status"),
                     "speedup_median": self.vs.get("speedup_median")}
        return line | {"results": self.files.get("json")}


@dataclass(frozen=True)
class BenchOptions:
    """Per-run choices on top of the profile (command-line flags)."""

    checkpoint: str | None = None
    vs: str | None = None
    iters: int | None = None
    warmup: int | None = None
    backend: str | None = None
    trace_path: str | None = None
    progress: bool = True
    precision: str | None = None
    tokenizer: str | None = None  # `--tokenizer`: the profile's [model] tokenizer
    snac_noise: str | None = None  # `--snac-noise`: the profile's [model] noise_mode
    chrome_trace: bool = False  # `--trace-out`: on a GPU, profile extra calls with torch.profiler

    def __post_init__(self) -> None:
        """The flags' own values, checked under their names (the profile re-checks the merged result)."""
        from flashrt.errors import ConfigError

        if self.iters is not None and self.iters < 1:
            raise ConfigError(f"--iters {self.iters}: must be at least 1 (timed calls)")
        if self.warmup is not None and self.warmup < 0:
            raise ConfigError(f"--warmup {self.warmup}: must be 0 or more")


def apply_options(profile: Profile, options: BenchOptions) -> Profile:
    """The profile with the command-line overrides (validated like a file)."""
    bench = {k: v for k, v in (("iters", options.iters), ("warmup", options.warmup)) if v is not None}
    runtime = {"backend": options.backend} if options.backend else {}
    profile = profile.with_overrides(bench=bench, runtime=runtime)
    profile = profile if options.precision is None else profile.with_precision(options.precision)
    return with_model(profile, tokenizer=options.tokenizer, noise_mode=options.snac_noise)


def with_model(profile: Profile, **values: str | None) -> Profile:
    """The profile with these `[model]` keys set, those given (not None): `--tokenizer PATH` (tokenizer,
    read by the policy adapters), `--snac-noise MODE` (noise_mode, read by the SNAC benchmark)."""
    given = {k: v for k, v in values.items() if v is not None}
    return replace(profile, model=profile.model | given) if given else profile


def vs_tolerances(adapter: Any, name: str, atol: float, rtol: float) -> tuple[float, float]:
    """(atol, rtol) the `--vs` side is gated with: the profile's, unless the adapter says otherwise
    (`vs_tolerance(name)`, e.g. a float reference of a quantized run: the recipe's bound)."""
    own = getattr(adapter, "vs_tolerance", None)
    found = own(name) if own is not None else None
    return (atol, rtol) if found is None else found


def process_age_ms() -> float | None:
    """Milliseconds since this process started (Linux), i.e. interpreter + imports before the bench."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")) * 1e3


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with `n` torch CPU threads (0: unchanged); the previous count is restored afterwards."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def build_adapter(name: str, profile: Profile, options: BenchOptions, device: str,
           cold: dict[str, float]) -> Any:
    start = time.perf_counter()
    entry = get_benchmark(name)
    cold["registry_import"] = _ms_since(start)
    start = time.perf_counter()
    adapter = entry.factory(profile, options.checkpoint, device)
    cold["build"] = _ms_since(start)
    cold.update({k: float(v) for k, v in getattr(adapter, "cold_start_ms", {}).items()})
    return adapter


def freeze_trace(adapter: Any, profile: Profile, trace_path: str | None) -> FrozenTrace:
    """The recorded trace at `trace_path`, or the adapter's inputs for the profile's seed."""
    if trace_path:
        return FrozenTrace.load(trace_path)
    seed = profile.bench.seed
    return FrozenTrace.from_inputs(adapter.make_inputs(seed), seed=seed)


def golden_outputs(reference: Any, trace: FrozenTrace) -> list[Any]:
    """The reference implementation's outputs on every trace input (untimed)."""
    timer = StageTimer("cpu", nvtx=False)
    return [reference.run(x, timer) for x in trace]


def gate_check(impl: Any, trace: FrozenTrace, golden: list[Any], atol: float, rtol: float) -> dict[str, Any]:
    """Run `impl` on every trace input and compare with `golden`; errors count as failures."""
    timer, verdicts = StageTimer("cpu", nvtx=False), []
    for i, (x, ref) in enumerate(zip(trace, golden)):
        try:
            verdicts.append(compare(impl.run(x, timer), ref, atol, rtol, where=f"input {i}"))
        except Exception as exc:
            verdicts.append(_error_verdict(i, exc))
    failed = [v for v in verdicts if not v.passed]
    worst = failed[0] if failed else max(verdicts, key=lambda v: v.max_abs)
    return {"passed": not failed, "checked": len(verdicts), "failed": len(failed),
            "max_abs": max(v.max_abs for v in verdicts), "where": worst.where, "reason": worst.reason}


def _error_verdict(i: int, exc: Exception) -> Any:
    from flashrt.bench.gate import GateResult

    return GateResult(False, where=f"input {i}", reason=f"raised {one_line(exc)}")


def _progress(total: int, enabled: bool, label: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="call", disable=not enabled, leave=False)


class _Run:
    """State of one benchmark run; each method is one protocol step (see module doc)."""

    def __init__(self, name: str, profile: Profile, options: BenchOptions):
        self.options, self.profile = options, apply_options(profile, options)
        self.result = BenchResult(benchmark=name, profile=self.profile.to_dict())
        self.cold: dict[str, float] = {}
        self.adapter: Any = None

    def prepare(self) -> bool:
        """Steps 1-4; False when the run stops (refused, error or gated-out)."""
        age = process_age_ms()
        if age is not None:
            self.cold["process_start"] = age
        self.device = check_device(self.profile)
        self.result.env = environment()
        self.result.memory["rss_before_build"] = memory.rss_bytes()
        self.adapter = build_adapter(self.result.benchmark, self.profile, self.options, self.device,
                                     self.cold)
        self.result.implementation = getattr(self.adapter, "name", self.result.benchmark)
        self.trace = freeze_trace(self.adapter, self.profile, self.options.trace_path)
        self.result.trace, self.result.frozen_trace = self.trace.record(), self.trace
        return self._gate()

    def _gate(self) -> bool:
        q = self.profile.quality
        start = time.perf_counter()
        reference = self.adapter.reference(q.reference)
        self.golden = golden_outputs(reference, self.trace)
        self.cold["reference_build"] = _ms_since(start)
        start = time.perf_counter()
        self.gate_tol = atol, rtol = vs_tolerances(self.adapter, q.reference, q.atol, q.rtol)
        gate = gate_check(self.adapter, self.trace, self.golden, atol, rtol)
        self.cold["first_call"] = _ms_since(start) / len(self.trace)
        self.result.gate = {"reference": q.reference, "atol": atol, "rtol": rtol, **gate, "vs": None}
        quality = getattr(self.adapter, "quality", None)
        if quality is not None and quality() is not None:
            self.result.gate["quantization"] = quality()
        if not gate["passed"]:
            self.result.status = "gated-out"
            self.result.reason = f"outputs differ from {q.reference!r}: {gate['where']}: {gate['reason']}"
        return gate["passed"]

    def build_vs(self) -> Any:
        """The `--vs` implementation, gated; None (and the reason in results) when unavailable."""
        name = self.options.vs
        if not name:
            return None
        self.result.vs = {"name": name, "status": "ok", "reason": ""}
        start = time.perf_counter()
        try:
            impl = self.adapter.reference(name)
        except (ReferenceUnavailable, ImportError) as exc:
            self.result.vs |= {"status": "unavailable", "reason": one_line(exc)}
            return None
        except Exception as exc:  # a side that fails to build ends the comparison, never the whole run
            self.result.vs |= {"status": "error", "reason": one_line(exc)}
            return None
        self.cold["vs_build"] = _ms_since(start)
        q, start = self.profile.quality, time.perf_counter()
        self.vs_tol = vs_tolerances(self.adapter, name, q.atol, q.rtol)
        try:
            gate = gate_check(impl, self.trace, self.golden, *self.vs_tol)
        except Exception as exc:  # e.g. torch.compile failing on its first pass
            self.result.vs |= {"status": "error", "reason": one_line(exc)}
            return None
        self.cold["vs_first_pass"] = _ms_since(start)  # includes compilation for lazy references
        self.result.gate["vs"] = {**gate, "atol": self.vs_tol[0], "rtol": self.vs_tol[1]}
        if not gate["passed"]:
            status = "error" if str(gate["reason"]).startswith("raised ") else "gated-out"
            self.result.vs |= {"status": status, "reason": f"{gate['where']}: {gate['reason']}"}
            return None
        return impl

    def measure(self, vs_impl: Any) -> list[Side]:
        """Step 5: warm-up, then timed attempts (interleaved when comparing)."""
        b = self.profile.bench
        sides = [Side("A", self.adapter, self.device, *self.gate_tol)]
        if vs_impl is not None:
            sides.append(Side("B", vs_impl, self.device, *self.vs_tol))
        interleave(sides, self.trace, self.golden, b.warmup)
        for side in sides:
            side.reset()
        memory.reset_cuda_peaks(self.device)
        self.result.memory["rss_start"] = memory.rss_bytes()
        with _progress(b.iters, self.options.progress, self.result.benchmark) as bar:
            interleave(sides, self.trace, self.golden, b.iters, bar)
        return sides

    def summarize(self, sides: list[Side]) -> None:
        """Step 6."""
        rate, b = self.profile.bench.target_rate_hz, self.profile.bench
        a = sides[0].summary(rate)
        self.result.steady = {"warmup": b.warmup, "iters": b.iters, **{k: a[k] for k in (
            "attempts", "failures", "errors", "total", "stages")}}
        if len(sides) > 1:
            self.result.vs |= {k: v for k, v in sides[1].summary(rate).items() if k != "name"}
            self.result.vs |= summarize_pairs(pair_speedups(sides[0].attempts, sides[1].attempts))
        self.result.memory |= {"rss_end": memory.rss_bytes(), "peak_rss": memory.peak_rss_bytes(),
                               "cuda": memory.cuda_memory(self.device),
                               "adapter": dict(getattr(self.adapter, "memory", dict)())}
        self.result.roofline = self._roofline(a)
        counter = getattr(self.adapter, "kernels_per_replay", None)
        self.result.kernels = counter() if callable(counter) else None
        self.result.cold_start_ms = self.cold
        self.result.plot_data = _plot_data(sides, rate)
        self.result.plot_data["chrome"] = [e for i, side in enumerate(sides)
                                           for e in side.timer.chrome_events(i + 1, side.name)]
        if a["failures"]:
            self.result.reason = f"{a['failures']} of {a['attempts']} timed attempts failed: {a['errors'][0]}"

    def _roofline(self, a: dict[str, Any]) -> dict[str, Any] | None:
        flops, nbytes = self.adapter.flops_bytes()
        basis = "replay" if "replay" in a["stages"] else "total"
        stats = a["stages"][basis] if basis == "replay" else a["total"]
        if stats.count == 0:
            return None
        peak = device_peak(self.device, self.profile.precision)
        return {"basis": f"{basis} p50", **roofline(flops, nbytes, stats.p50 / 1e3, peak)}

    def close(self) -> None:
        closer = getattr(self.adapter, "close", None)
        if callable(closer):
            closer()


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, at most `limit` characters (for tables and exit messages)."""
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    text = f"{type(exc).__name__}: {first.strip()}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _plot_data(sides: list[Side], rate_hz: float) -> dict[str, Any]:
    a = sides[0]
    per_call = a.per_call()
    names = dict.fromkeys(k for row in per_call for k in row)
    stages = {s: [row[s] for row in per_call if s in row] for s in names}
    stages["total"] = [x.total_ms for x in a.attempts if x.ok]
    compare_series = {f"total {s.name}": [x.total_ms for x in s.attempts if x.ok] for s in sides[1:]}
    return {"stages": stages, "per_call": per_call, "compare": compare_series, "deadline_ms": 1e3 / rate_hz,
            "title": f"{a.name}"}


class ProfiledTimer(StageTimer):
    """A `StageTimer` whose stages are also torch.profiler ranges (``record_function``), so the
    profiler's trace shows flashrt's stage names over the kernels they launch."""

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        import torch

        with torch.profiler.record_function(name), super().stage(name):
            yield


PROFILED_CALLS = 10


def profiler_trace(sides: list[Side], trace: FrozenTrace, device: str,
                   calls: int = PROFILED_CALLS) -> list[dict[str, Any]]:
    """Chrome trace events of `calls` more rounds (untimed, after the measurement) under torch.profiler:
    CPU ops, CUDA kernels on a GPU, each side's calls and its stages as named ranges."""
    import json
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = str(device).startswith("cuda")
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        for i in range(calls):
            for side in sides:
                with torch.profiler.record_function(f"{side.name} call {i}"):
                    side.impl.run(trace[i % len(trace)], ProfiledTimer(device, nvtx=False))
        if cuda:
            torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def run_benchmark(name: str, profile: Profile, options: BenchOptions | None = None) -> BenchResult:
    """Run benchmark `name` under `profile`. DeviceError / ConfigError propagate (the CLI reports them
    as status "refused" / "error"); a gate failure returns a result with status "gated-out".
    With ``options.chrome_trace`` on a CUDA device, the Chrome trace is torch.profiler's (extra calls
    after the timed ones); on the CPU it is the stage timers' of the timed calls."""
    run = _Run(name, profile, options or BenchOptions())
    try:
        with torch_threads(run.profile.device.threads):
            if run.prepare():
                vs_impl = run.build_vs()
                sides = run.measure(vs_impl)
                run.summarize(sides)
                if run.options.chrome_trace and str(run.device).startswith("cuda"):
                    run.result.plot_data["chrome"] = profiler_trace(sides, run.trace, run.device)
                    run.result.plot_data["chrome_source"] = f"torch.profiler ({PROFILED_CALLS} extra calls)"
    finally:
        run.close()
    run.result.cold_start_ms = run.cold
    return run.result


def write_outputs(result: BenchResult, out_dir: str | Path, plot: bool = True,
                  save_trace: bool = False, trace_out: str | Path | None = None) -> dict[str, str]:
    """Write results.json (and latency.png when there are samples, trace.pt with `save_trace`) into
    `out_dir`; returns the paths. A saved trace replays with `flashrt bench --trace PATH`."""
    from flashrt.profile.report import write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if save_trace and result.frozen_trace is not None:
        result.files["trace"] = str(result.frozen_trace.save(out / "trace.pt"))
    d = result.plot_data
    if d.get("stages", {}).get("total"):  # raw per-call samples: any percentile can be recomputed
        result.files["samples"] = str(out / "samples.json")
        write_json(out / "samples.json", {"per_call_ms": d["per_call"], "total_ms": d["stages"]["total"],
                                          **{f"vs_{k}": v for k, v in d["compare"].items()}})
    if trace_out is not None and d.get("chrome"):
        from flashrt.profile.timers import write_chrome_trace

        result.files["chrome_trace"] = str(write_chrome_trace(trace_out, d["chrome"]))
        result.files["chrome_trace_source"] = d.get("chrome_source", "stage timers (the timed calls)")
    result.files["json"] = str(out / "results.json")
    write_json(out / "results.json", result.to_dict())  # results first: a failing plot never loses them
    if plot and d.get("stages", {}).get("total"):
        result.files.update(_plot(result, out))
        write_json(out / "results.json", result.to_dict())
    return dict(result.files)


def _plot(result: BenchResult, out: Path) -> dict[str, str]:
    """latency.png, or a note saying why there is none (matplotlib missing or failing)."""
    d = result.plot_data
    title = f"{result.benchmark} · {d['title']} · profile {result.profile.get('name')}"
    try:
        from flashrt.profile.plots import plot_latency

        png = plot_latency(out / "latency.png", d["stages"], d["per_call"], title, d["deadline_ms"],
                           d["compare"])
    except Exception as exc:  # plotting is a convenience: the results are already on disk
        return {"png_skipped": one_line(exc)}
    return {"png": str(png)}


def render(result: BenchResult, console: Any = None) -> None:
    """Tables for people (stderr): stage latencies, comparison, cold start, memory, roofline."""
    from flashrt.profile.report import kv_table, print_tables, stats_table

    tables = []
    if result.steady:
        stats = {**result.steady["stages"], "total": result.steady["total"]}
        tables.append(stats_table(stats, f"{result.benchmark} · {result.implementation} (ms)"))
    if result.vs:
        vs = result.vs
        if "total" in vs:
            tables.append(stats_table({**vs["stages"], "total": vs["total"]}, f"vs {vs['name']} (ms)"))
        tables.append(kv_table({k: v for k, v in vs.items() if k not in ("stages", "total", "errors")},
                               "side by side (speedup = B ms / A ms)"))
    if result.gate:
        tables.append(kv_table(gate_summary(result.gate), "quality gate"))
    tables.append(kv_table(result.cold_start_ms, "cold start (ms)"))
    tables.append(kv_table({k: _mib(v) for k, v in _flat(result.memory).items()}, "memory"))
    if result.roofline:
        tables.append(kv_table({k: v for k, v in _flat(result.roofline).items()}, "roofline"))
    print_tables(*tables, console=console)


def gate_summary(gate: dict[str, Any]) -> dict[str, Any]:
    """The gate's verdict for the console: passed, max |Δ| vs the reference, tolerances, where."""
    out = {"reference": gate.get("reference"), "verdict": "passed" if gate.get("passed") else "FAILED",
           "max_abs": gate.get("max_abs"), "atol / rtol": f"{gate.get('atol')} / {gate.get('rtol')}"}
    if not gate.get("passed"):
        out["where"] = f"{gate.get('where')}: {gate.get('reason')}"
    vs = gate.get("vs")
    if vs:
        out["vs verdict"] = "passed" if vs.get("passed") else "FAILED"
        out["vs max_abs"] = vs.get("max_abs")
    quant = gate.get("quantization")
    if quant:  # the calibration gate of a quantized run (held-out samples, normalized actions)
        out["calibration gate"] = (f"min cosine {quant.get('min_cosine')}, "
                                   f"max |Δ| {quant.get('max_abs_delta')}, "
                                   f"worst layer {quant.get('worst_layer')} ({quant.get('cache')})")
    return out


def _mib(value: Any) -> Any:
    return f"{value / 2**20:,.1f} MiB" if isinstance(value, int) else value


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out
