"""GPU checks of the profiler and the bench (skipped without CUDA): CUDA-event stage timing, the
runtime-block CUDA graph replay against the eager layer, GPU memory accounting."""

import pytest
import torch

from flashrt.bench.harness import BenchOptions, run_benchmark
from flashrt.profile.timers import StageTimer, Timer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_event_stage_timer():
    timer = StageTimer("cuda")
    a = torch.randn(1024, 1024, device="cuda")
    for _ in range(3):
        timer.new_call()
        with timer.stage("matmul"):
            a @ a
    records = timer.records()
    assert len(records) == 3 and all(r.ms > 0 for r in records)
    with Timer("cuda") as t:
        a @ a
    assert t.ms > 0


def test_runtime_block_cuda_graph_vs_eager(tiny_profile):
    profile = tiny_profile(device={"kind": "cuda", "threads": 0}, runtime={"backend": "cuda"},
                           bench={"iters": 20, "warmup": 3})
    result = run_benchmark("runtime-block", profile, BenchOptions(vs="eager", progress=False))
    assert result.status == "ok" and result.implementation == "flashrt:cuda", result.reason
    assert result.gate["passed"] and result.vs["pairs"] == 20
    assert result.memory["cuda"]["peak_allocated"] > 0
    assert result.roofline["peak"]["bandwidth_gbs"] is None or result.roofline["peak"]["bandwidth_gbs"] > 0


def test_trace_out_on_cuda_is_torch_profilers_with_the_stage_names(tiny_profile, tmp_path):
    import json

    from flashrt.bench.harness import write_outputs

    profile = tiny_profile(device={"kind": "cuda", "threads": 0}, runtime={"backend": "cuda"},
                           bench={"iters": 5, "warmup": 1})
    result = run_benchmark("runtime-block", profile, BenchOptions(progress=False, chrome_trace=True))
    files = write_outputs(result, tmp_path, plot=False, trace_out=tmp_path / "trace.json")
    assert files["chrome_trace_source"].startswith("torch.profiler")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    ranges = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    assert {"validate", "h2d", "replay", "d2h"} <= ranges
    assert any(e.get("cat") == "kernel" for e in events)  # the replayed graph's kernels under the stages
