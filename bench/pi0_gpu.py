"""Benchmark: full-size Pi0 and Pi0.5 on a GPU — captured-graph replay and end-to-end `infer` latency.

Regime: batch 1, one observation -> one action chunk. RANDOM weights at the real sizes (SigLIP So400m/14
at 224 px, Gemma 2B prefix, Gemma 300M action expert, 257,152-token embedding), drawn on the GPU and
written in bf16 as a lerobot 0.6.1 policy dir (`flashrt.testing.synthetic.pi0.write_checkpoint`), loaded
with `load_policy(..., precision="bfloat16", backend="cuda")`; 1, 2 or 3 cameras fed 480 x 640 uint8
frames; 10 Euler steps, chunk 50; prompts of a few words (Pi0.5 adds the discretized state), each replayed in
its prompt bucket (reported).
The camera counts share one loaded model (a policy per count over the same weights).

Metrics per variant and camera count:
  replay p50/p90   CUDA-event time of the captured step alone (`frontend.run(bucket)`, inputs written)
  wall p50/p90/p99 host time of `Policy.infer` end to end: validate, frames to the GPU + resize,
                   replay, actions back + un-normalize (what a robot loop waits for)
  stages p50       the same calls split into validate / h2d / replay / postprocess
  eager            the same weights behind the eager backend (no capture): wall p50 and the ratio
                   eager / graph (what capture buys); the gate max |Δaction| graph vs eager
  lerobot          lerobot 0.6.1 eager on the same weights and dir: wall p50 and lerobot / flashrt, where
                   lerobot imports; otherwise "lerobot unavailable" (the GPU machine has no lerobot)
  roofline         network FLOPs and minimum bytes per call -> achieved TFLOP/s and GB/s at replay p50
Target (noted, not asserted): wall < 15 ms for 2 cameras on an H200.

`--kernel-profile` adds, per row, torch.profiler's top kernels by device time over three eager calls (the
kernels a replay runs, each visible outside a graph) with launches per call.

`--fp32-modules none` loads every module in bf16; the family's default ("lerobot") keeps the SigLIP tower,
projector, norms and heads in IEEE float32 (TF32 off) as lerobot's bf16 recipe does. On the first H200 run
(2026-12-04, default recipe) each camera added ~9.6 ms of replay (38.1 ms at 2 cameras, 47.7 at 3): the
fp32 vision tower, by its FLOPs.

    python bench/pi0_gpu.py --out /tmp/pi0-gpu                        # H200: both variants, 1-3 cameras
    python bench/pi0_gpu.py --device cpu --preset tiny --iters 5       # CPU smoke test (trace backend)

Writes `pi0_gpu.json` under --out after every measurement (a time-out still leaves what was measured),
prints tables on stderr and ONE JSON line last on stdout. `--budget-s` skips what would start after
that many seconds (reported as skipped) so a time-limited run still ends cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

TARGET_MS = 15.0
TARGET_CAMERAS = 2


def _percentiles(ms: list[float]) -> dict[str, float]:
    from flashrt.profile.stats import LatencyStats

    s = LatencyStats.from_samples(ms)
    return {"p50": s.p50, "p90": s.p90, "p99": s.p99, "count": s.count}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ measuring
def time_wall(run: Any, obs: list[dict], iters: int, device: str) -> list[float]:
    """Host ms of `run(o)` per call (cycling over `obs`); the call ends with actions on the host."""
    out = []
    for i in range(iters):
        _sync(device)
        start = time.perf_counter()
        run(obs[i % len(obs)])
        out.append((time.perf_counter() - start) * 1e3)
    return out


def time_replay(policy: Any, o: dict, iters: int) -> tuple[list[float], int]:
    """Device ms of the captured step alone, inputs of `o` written once."""
    from flashrt.bench.adapters.pi0 import staged_infer
    from flashrt.profile.timers import StageTimer

    _, bucket = staged_infer(policy, o, StageTimer(policy.frontend.device, nvtx=False))
    timer = StageTimer(policy.frontend.device, nvtx=False)
    for _ in range(iters):
        with timer.stage("replay"):
            policy.frontend.replay(bucket)
    return timer.samples()["replay"], bucket


def staged(policy: Any, obs: list[dict], iters: int) -> dict[str, float]:
    from flashrt.bench.adapters.pi0 import staged_infer
    from flashrt.profile.timers import StageTimer

    timer = StageTimer(policy.frontend.device, nvtx=False)
    for i in range(iters):
        staged_infer(policy, obs[i % len(obs)], timer)
    return {stage: statistics.median(ms) for stage, ms in timer.samples().items()}


def gate(a: Any, b: Any, obs: list[dict]) -> float:
    """max |Δaction| between two runners (`run(o) -> {"actions"}`) over `obs`."""
    import numpy as np

    from flashrt.profile.timers import StageTimer

    timer = StageTimer("cpu", nvtx=False)
    return max(float(np.abs(a.run(o, timer)["actions"] - b.run(o, timer)["actions"]).max()) for o in obs)


def kernel_profile(run: Any, obs: list[dict], device: str, calls: int = 3, top: int = 15) -> dict[str, Any]:
    """Where one call's device time goes, by kernel (CUDA; on the CPU by aten op), from torch.profiler over
    ``calls`` calls of ``run`` (the eager sibling: the same kernels a replay runs, each visible): the
    ``top`` names by time per call, with launches per call, and the total per call."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    run(obs[0])
    _sync(device)
    with profile(activities=activities) as prof:
        for i in range(calls):
            run(obs[i % len(obs)])
        _sync(device)
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0) if cuda else e.self_cpu_time_total
        if us > 0 and (not cuda or getattr(e, "device_type", None) == torch_device_type_cuda()):
            rows.append((us / calls / 1e3, e.count / calls, e.key))
    rows.sort(reverse=True)
    return {"by": "kernel" if cuda else "aten op", "calls": calls,
            "total_ms_per_call": sum(r[0] for r in rows),
            "top": [{"name": name[:120], "ms_per_call": ms, "launches_per_call": n}
                    for ms, n, name in rows[:top]]}


def torch_device_type_cuda() -> Any:
    from torch.autograd import DeviceType

    return DeviceType.CUDA


def roofline(policy: Any, n_cams: int, bucket: int, replay_ms: float) -> dict[str, float]:
    from flashrt.frontends.pi0.model import bytes_per_step, flops_per_step

    cfg, wb = policy.config, policy.frontend.frontend.model.dtype.itemsize
    flops = flops_per_step(cfg, n_cams, bucket)["total"]
    nbytes = bytes_per_step(cfg, n_cams, bucket, weight_bytes=wb)["total"]
    return {"flops": flops, "bytes": nbytes, "achieved_tflops": flops / replay_ms / 1e9,
            "achieved_gbs": nbytes / replay_ms / 1e6}


# ------------------------------------------------------------------------------------------ one variant
class VariantRun:
    """One variant: its random checkpoint on disk, the policy at the largest camera count, siblings."""

    def __init__(self, variant: str, args: argparse.Namespace, tmp: Path):
        from flashrt.bench.adapters import pi0 as pb
        from flashrt.testing.synthetic.pi0 import SyntheticSpec, write_checkpoint

        self.variant, self.args, self.pb = variant, args, pb
        preset = pb.PRESETS[args.preset]
        sizes = replace(preset.sizes, max_tokens=pb.TOKENIZER_MAX[variant])
        self.spec = SyntheticSpec(variant, sizes, pb.CAMERAS[: max(args.cameras)], preset.vocab,
                                  preset.storage)
        self.frame, self.folder, self.setup = preset.frame, tmp / variant, {}
        start = time.perf_counter()
        write_checkpoint(self.folder, self.spec, args.device)
        self.setup["write_s"] = time.perf_counter() - start
        self.base = self._load()

    def _load(self) -> Any:
        from flashrt.runner.policy import load_policy

        start = time.perf_counter()
        extra = {"fp32_modules": self.args.fp32_modules} if self.args.fp32_modules else {}
        policy = load_policy(self.folder, device=self.args.device, precision=self.args.precision,
                             backend=self.args.backend, **extra)
        _sync(self.args.device)
        capture = sum(policy.frontend.report()["capture_s"].values())
        self.setup |= {"load_s": time.perf_counter() - start - capture, "capture_s": capture,
                       "weights_gb": sum(p.numel() * p.element_size()
                                         for p in policy.frontend.frontend.model.parameters()) / 1e9}
        return policy

    def policy_for(self, n_cams: int) -> Any:
        if n_cams == len(self.base.cameras):
            return self.base
        return self.pb.sibling_policy(self.base, self.args.backend, cameras=self.pb.CAMERAS[:n_cams])

    def measure(self, n_cams: int) -> dict[str, Any]:
        a, pb = self.args, self.pb
        policy = self.policy_for(n_cams)
        obs = pb.observations(policy, 4, seed=n_cams, frame=self.frame)
        ours = pb.PolicyRunner("flashrt", policy)
        time_wall(lambda o: ours.run(o, _null_timer()), obs, a.warmup, a.device)
        replay, bucket = time_replay(policy, obs[0], a.iters)
        wall = time_wall(lambda o: ours.run(o, _null_timer()), obs, a.iters, a.device)
        row = {"variant": self.variant, "cameras": n_cams, "bucket": bucket,
               "replay_ms": _percentiles(replay), "wall_ms": _percentiles(wall),
               "stages_p50_ms": staged(policy, obs, max(a.iters // 4, 1))}
        row["roofline"] = roofline(policy, n_cams, bucket, row["replay_ms"]["p50"])
        row["eager"] = self._eager(policy, ours, obs)
        row["lerobot"] = self._lerobot(policy, ours, obs, n_cams)
        if n_cams == TARGET_CAMERAS:
            row["target"] = {"wall_p50_ms_below": TARGET_MS, "met": row["wall_ms"]["p50"] < TARGET_MS}
        return row

    def _eager(self, policy: Any, ours: Any, obs: list[dict]) -> dict[str, Any]:
        pb, a = self.pb, self.args
        eager = pb.PolicyRunner("eager", pb.sibling_policy(policy, "eager"))
        max_abs = gate(ours, eager, obs)
        wall = time_wall(lambda o: eager.run(o, _null_timer()), obs, max(a.iters // 4, 3), a.device)
        graph_p50 = statistics.median(time_wall(lambda o: ours.run(o, _null_timer()), obs,
                                                max(a.iters // 4, 3), a.device))
        out = {"gate_max_abs": max_abs, "wall_p50_ms": statistics.median(wall),
               "eager_over_graph": statistics.median(wall) / graph_p50}
        if a.kernel_profile:
            try:  # never run on a GPU yet (2026-12-04): a profiler surprise costs the breakdown, not the row
                kernels = kernel_profile(lambda o: eager.run(o, _null_timer()), obs, a.device)
            except Exception as exc:  # noqa: BLE001
                out["kernels"] = {"error": f"{type(exc).__name__}: {exc}"}
                return out
            out["kernels"] = kernels
            head = ", ".join(f"{k['name'][:40]} {k['ms_per_call']:.2f} ms x{k['launches_per_call']:.0f}"
                             for k in kernels["top"][:5])
            print(f"{self.variant} eager, {kernels['total_ms_per_call']:.1f} ms of {kernels['by']} time per "
                  f"call; top: {head}", file=sys.stderr)
        return out

    def _lerobot(self, policy: Any, ours: Any, obs: list[dict], n_cams: int) -> dict[str, Any]:
        from flashrt.bench.registry import ReferenceUnavailable

        a = self.args
        try:
            folder = self._camera_dir(n_cams)
            lerobot = self.pb.LerobotRunner(folder, policy.config, a.device, a.precision)
        except (ReferenceUnavailable, ImportError) as exc:
            return {"status": "lerobot unavailable", "reason": f"{type(exc).__name__}: {exc}"}
        max_abs = gate(ours, lerobot, obs)
        wall = time_wall(lambda o: lerobot.run(o, _null_timer()), obs, max(a.iters // 4, 3), a.device)
        graph = time_wall(lambda o: ours.run(o, _null_timer()), obs, max(a.iters // 4, 3), a.device)
        return {"status": "ok", "gate_max_abs": max_abs, "wall_p50_ms": statistics.median(wall),
                "lerobot_over_flashrt": statistics.median(wall) / statistics.median(graph)}

    def _camera_dir(self, n_cams: int) -> Path:
        """The checkpoint declaring `n_cams` cameras: the same weights and tokenizer (links), its own
        config and processors (lerobot's network size follows the config's cameras)."""
        from flashrt.testing.synthetic.pi0 import write_metadata

        if n_cams == len(self.spec.cameras):
            return self.folder
        folder = self.folder.parent / f"{self.variant}-{n_cams}cam"
        folder.mkdir(exist_ok=True)
        for name in ("model.safetensors", "tokenizer.model"):
            if not (folder / name).exists():
                os.symlink(self.folder / name, folder / name)
        write_metadata(folder, replace(self.spec, cameras=self.pb.CAMERAS[:n_cams]))
        return folder


def _null_timer() -> Any:
    from flashrt.profile.timers import StageTimer

    return StageTimer("cpu", nvtx=False)


# ------------------------------------------------------------------------------------------ report
def _table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = f"Pi0 / Pi0.5, ms (target: wall p50 < {TARGET_MS:g} ms with {TARGET_CAMERAS} cameras on an H200)"
    t = Table(title=title)
    for col in ("variant", "cams", "bucket", "replay p50", "wall p50", "wall p99", "eager wall p50",
                "eager/graph", "lerobot/flashrt", "TFLOP/s", "GB/s"):
        t.add_column(col, justify="right")
    for r in rows:
        if "skipped" in r:
            t.add_row(r["variant"], str(r["cameras"]), "-", r["skipped"], *["-"] * 7)
            continue
        lr = r["lerobot"]
        t.add_row(r["variant"], str(r["cameras"]), str(r["bucket"]), f"{r['replay_ms']['p50']:.2f}",
                  f"{r['wall_ms']['p50']:.2f}", f"{r['wall_ms']['p99']:.2f}",
                  f"{r['eager']['wall_p50_ms']:.2f}",
                  f"{r['eager']['eager_over_graph']:.2f}",
                  f"{lr['lerobot_over_flashrt']:.2f}" if lr["status"] == "ok" else "unavailable",
                  f"{r['roofline']['achieved_tflops']:.1f}", f"{r['roofline']['achieved_gbs']:.0f}")
    Console(stderr=True, width=170).print(t)


def summary_line(record: dict[str, Any]) -> dict[str, Any]:
    line = {"bench": "pi0_gpu", "status": record["status"], "device": record["device"],
            "preset": record["preset"], "target_ms": TARGET_MS}
    for r in record["rows"]:
        if "skipped" not in r:
            key = f"{r['variant']}_{r['cameras']}cam"
            line[f"{key}_replay_p50_ms"] = r["replay_ms"]["p50"]
            line[f"{key}_wall_p50_ms"] = r["wall_ms"]["p50"]
    line["lerobot"] = next((r["lerobot"]["status"] for r in record["rows"] if "lerobot" in r), None)
    return line | {"total_s": record["total_s"], "results": record.get("file")}


def _write(record: dict[str, Any], out: Path | None) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    record["file"] = str(out / "pi0_gpu.json")
    (out / "pi0_gpu.json").write_text(json.dumps(record, indent=2, default=str))


# ------------------------------------------------------------------------------------------ main
def _args(argv: list[str] | None) -> argparse.Namespace:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=("full", "small", "tiny"), default="full")
    parser.add_argument("--cameras", default="1,2,3", help="comma-separated camera counts (1-3)")
    parser.add_argument("--variants", default="pi0,pi05")
    parser.add_argument("--iters", type=int, default=100, help="timed calls per measurement")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--precision", default=None, help="[bfloat16 on cuda, float32 on cpu]")
    parser.add_argument("--kernel-profile", action="store_true",
                        help="torch.profiler over 3 eager calls per row: the top kernels by device time "
                             "(what a replay runs, each visible; the JSON row's eager.kernels)")
    parser.add_argument("--fp32-modules", choices=("lerobot", "none"), default=None,
                        help="a half precision's float32 modules: 'lerobot' (the family's default: vision, "
                             "projector, norms and heads in IEEE fp32, as lerobot's bf16 recipe) or 'none' "
                             "(all in --precision)")
    parser.add_argument("--backend", default=None, help="graph backend [cuda on cuda, trace on cpu]")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    parser.add_argument("--budget-s", type=float, default=170.0,
                        help="start a variant / measurement only if the last one would still end before this")
    parser.add_argument("--out", type=Path, default=None, help="folder for pi0_gpu.json")
    args = parser.parse_args(argv)
    args.cameras = sorted({int(c) for c in args.cameras.split(",")})
    if not set(args.cameras) <= {1, 2, 3}:
        parser.error("--cameras takes counts between 1 and 3")
    cuda = args.device.startswith("cuda")
    args.precision = args.precision or ("bfloat16" if cuda else "float32")
    args.backend = args.backend or ("cuda" if cuda else "trace")
    return args


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


class Budget:
    """Wall-clock budget: something starts only if the last thing of its kind would still fit."""

    def __init__(self, seconds: float):
        self.start, self.seconds, self.last = time.perf_counter(), seconds, {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, kind: str) -> bool:
        return self.elapsed() + self.last.get(kind, 0.0) <= self.seconds

    def spent(self, kind: str, since: float) -> None:
        self.last[kind] = time.perf_counter() - since


def run(args: argparse.Namespace) -> dict[str, Any]:
    budget = Budget(args.budget_s)
    record: dict[str, Any] = {"bench": "pi0_gpu", "status": "ok", "device": _device_name(args.device),
                              "preset": args.preset, "precision": args.precision,
                              "fp32_modules": args.fp32_modules or "lerobot", "backend": args.backend,
                              "iters": args.iters, "budget_s": args.budget_s, "setup": {}, "rows": [],
                              "errors": []}
    for variant in args.variants.split(","):
        since = time.perf_counter()
        if not budget.allows("variant"):
            record["rows"] += [_skipped(variant, n) for n in sorted(args.cameras, reverse=True)]
            continue
        with tempfile.TemporaryDirectory(prefix=f"flashrt-pi0-gpu-{variant}-") as tmp:
            _run_variant(variant, args, Path(tmp), record, budget)
        _free(args.device)
        budget.spent("variant", since)
    record["total_s"] = budget.elapsed()
    record["status"] = "ok" if not record["errors"] else "error"
    _write(record, args.out)
    return record


def _skipped(variant: str, n_cams: int) -> dict[str, Any]:
    return {"variant": variant, "cameras": n_cams, "skipped": "time budget"}


def _run_variant(variant: str, args: argparse.Namespace, tmp: Path, record: dict, budget: Budget) -> None:
    try:
        vr = VariantRun(variant, args, tmp)
        record["setup"][variant] = vr.setup
        for n in sorted(args.cameras, reverse=True):
            since = time.perf_counter()
            record["rows"].append(vr.measure(n) if budget.allows("measure") else _skipped(variant, n))
            budget.spent("measure", since)
            _write(record, args.out)
    except Exception as exc:  # reported in the results, the other variant still runs
        record["errors"].append(f"{variant}: {type(exc).__name__}: {exc}")
        print(f"pi0_gpu: {variant} failed: {type(exc).__name__}: {exc}", file=sys.stderr)


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    import torch

    args = _args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    record = run(args)
    _table(record["rows"])
    for name, setup in record["setup"].items():
        print(f"{name} setup: " + ", ".join(f"{k} {v:.2f}" for k, v in setup.items()), file=sys.stderr)
    for error in record["errors"]:
        print(f"error: {error}", file=sys.stderr)
    print(json.dumps(summary_line(record), default=str))
    return 0 if record["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
