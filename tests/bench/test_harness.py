import json

import pytest
import torch
from support.bench_fakes import FakeImpl, register_fake

from flashrt.bench.harness import SCHEMA, BenchOptions, BenchResult, render, run_benchmark, write_outputs
from flashrt.profile.stats import LatencyStats

RESULT_KEYS = ["schema", "kind", "benchmark", "status", "reason", "implementation", "profile", "trace",
               "gate", "cold_start_ms", "steady", "vs", "memory", "roofline", "kernels", "env", "files"]
STEADY_KEYS = {"warmup", "iters", "attempts", "failures", "errors", "total", "stages"}
VS_KEYS = {"name", "status", "reason", "attempts", "failures", "errors", "total", "stages", "pairs",
           "pairs_with_failure", "speedup_median", "speedup_p10", "speedup_p90"}


def _run(name, profile, **options):
    return run_benchmark(name, profile, BenchOptions(progress=False, **options))


def test_ok_run_has_pinned_schema_and_strict_json(tmp_path, tiny_profile, fake_name):
    register_fake(fake_name)
    result = _run(fake_name, tiny_profile(), vs="eager")
    assert result.status == "ok" and result.reason == ""
    files = write_outputs(result, tmp_path, plot=True)
    data = json.loads((tmp_path / "results.json").read_text())
    assert list(data) == RESULT_KEYS and data["schema"] == SCHEMA
    assert set(data["steady"]) == STEADY_KEYS and set(data["vs"]) == VS_KEYS
    assert list(data["steady"]["total"]) == list(LatencyStats.keys())
    assert list(data["steady"]["stages"]) == ["validate", "replay"]
    assert data["steady"]["total"]["count"] == 12 and data["steady"]["attempts"] == 12
    assert data["vs"]["pairs"] == 12 and data["vs"]["status"] == "ok"
    assert data["trace"]["length"] == 3 and len(data["trace"]["inputs"]) == 3
    assert data["gate"]["passed"] and data["gate"]["checked"] == 3 and data["gate"]["vs"]["passed"]
    assert {"registry_import", "build", "load", "capture", "first_call"} <= set(data["cold_start_ms"])
    assert data["memory"]["adapter"] == {"buffers": 48} and data["memory"]["peak_rss"] > 0
    assert data["roofline"]["flops_per_call"] == 12.0 and data["roofline"]["basis"] == "replay p50"
    assert data["env"]["packages"]["torch"] == torch.__version__
    assert data["kernels"] == {"total": 2, "top": {"aten.mul.Tensor": 1, "aten.add.Tensor": 1}}
    assert files["png"].endswith("latency.png") and (tmp_path / "latency.png").stat().st_size > 20_000
    line = result.summary_line()
    assert json.loads(json.dumps(line, allow_nan=False))["status"] == "ok" and line["vs"] == "eager"
    assert line["kernels_per_replay"] == 2
    assert line["deadline_ms"] == data["steady"]["total"]["deadline_ms"]  # the miss rate's deadline beside it
    render(result)


def test_trace_digest_is_saved_and_seed_dependent(tiny_profile, fake_name):
    register_fake(fake_name)
    a = _run(fake_name, tiny_profile())
    b = _run(fake_name, tiny_profile(bench={"seed": 1}))
    assert a.trace["digest"] != b.trace["digest"] and a.trace["seed"] == 0


def test_recorded_trace_is_replayed(tmp_path, tiny_profile, fake_name):
    from flashrt.bench.trace import FrozenTrace

    register_fake(fake_name)
    trace = FrozenTrace.from_inputs([{"x": torch.ones(4, 3)}, {"x": torch.zeros(4, 3)}])
    path = trace.save(tmp_path / "rec.pt")
    result = _run(fake_name, tiny_profile(), trace_path=str(path))
    assert result.trace["digest"] == trace.digest and result.trace["source"] == "recorded:rec.pt"


def test_quality_gate_refuses_differing_outputs(tiny_profile, fake_name):
    register_fake(fake_name, offset=1e-3)  # y = 2x + 0.001 vs the reference's 2x
    result = _run(fake_name, tiny_profile())
    assert result.status == "gated-out" and "outputs differ" in result.reason
    assert not result.gate["passed"] and result.gate["failed"] == 3
    assert result.gate["max_abs"] == pytest.approx(1e-3, rel=1e-3)
    assert result.steady == {} and result.roofline is None  # no timing counted
    assert result.to_dict()["status"] == "gated-out"


def test_gate_tolerance_comes_from_the_profile(tiny_profile, fake_name):
    register_fake(fake_name, offset=1e-3)
    assert _run(fake_name, tiny_profile(quality={"atol": 1e-2})).status == "ok"


def test_gate_and_timed_checks_take_the_adapters_own_bound_for_its_reference(tiny_profile, fake_name,
                                                                              monkeypatch):
    """E.g. an int8 run behind onnxrt gated against eager int8: the recipe's bound, not the profile's."""
    from support.bench_fakes import FakeBenchmark
    register_fake(fake_name, offset=1e-3)
    monkeypatch.setattr(FakeBenchmark, "vs_tolerance", lambda self, name: (1e-2, 0.0) if name == "eager"
                        else None, raising=False)
    result = _run(fake_name, tiny_profile())
    assert result.status == "ok" and result.gate["atol"] == 1e-2 and result.steady["failures"] == 0


def test_failures_inside_the_run_are_counted(tiny_profile, fake_name):
    # calls 0-2 are the gate, 3-4 warm-up; timed calls start at 5
    register_fake(fake_name, fail_on={6, 9, 10})
    result = _run(fake_name, tiny_profile())
    total = result.steady["total"]
    assert result.status == "ok" and result.steady["attempts"] == 12
    assert result.steady["failures"] == 3 and total.failures == 3 and total.count == 9
    assert total.deadline_misses >= 3 and total.miss_rate >= 3 / 12
    assert "injected failure" in result.reason and "3 of 12" in result.reason


def test_vs_failures_stay_in_the_denominator(tiny_profile, fake_name):
    flaky = FakeImpl(name="flaky", fail_on=frozenset({3 + 2 + 1, 3 + 2 + 4}))  # 2 timed failures
    register_fake(fake_name, refs={"flaky": flaky})
    result = _run(fake_name, tiny_profile(), vs="flaky")
    vs = result.vs
    assert vs["attempts"] == 12 and vs["failures"] == 2 and vs["total"].count == 10
    assert vs["pairs"] == 12 and vs["pairs_with_failure"] == 2


def test_vs_gated_out_and_missing_reference_are_reported(tiny_profile, fake_name):
    register_fake(fake_name, refs={"off": FakeImpl(name="off", offset=1.0)})
    gated = _run(fake_name, tiny_profile(), vs="off")
    assert gated.status == "ok" and gated.vs["status"] == "gated-out" and not gated.gate["vs"]["passed"]
    missing = _run(fake_name, tiny_profile(), vs="lerobot")
    assert missing.status == "ok" and missing.vs["status"] == "unavailable"
    assert "not installed" in missing.vs["reason"] and missing.steady["total"].count == 12


def test_failed_result_keeps_the_schema():
    data = BenchResult("x", "refused", "no gpu").to_dict()
    assert list(data) == RESULT_KEYS and json.dumps(data, allow_nan=False)


class _Broken(FakeImpl):
    def run(self, inputs, timer):
        raise RuntimeError("compile failed\n" + "trace line\n" * 270)


def test_vs_side_that_raises_is_an_error_with_one_line(tiny_profile, fake_name):
    register_fake(fake_name, refs={"broken": _Broken(name="broken")})
    result = _run(fake_name, tiny_profile(), vs="broken")
    assert result.status == "ok" and result.vs["status"] == "error"
    assert result.vs["reason"] == "input 0: raised RuntimeError: compile failed"
    assert result.steady["total"].count == 12


def test_results_and_raw_samples_are_written_before_plotting(tmp_path, tiny_profile, fake_name, monkeypatch):
    import flashrt.profile.plots as plots

    def no_matplotlib(*args, **kwargs):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(plots, "plot_latency", no_matplotlib)
    register_fake(fake_name)
    result = _run(fake_name, tiny_profile(), vs="eager")
    files = write_outputs(result, tmp_path, plot=True)
    assert "png" not in files and "matplotlib" in files["png_skipped"]
    data = json.loads((tmp_path / "results.json").read_text())
    samples = json.loads((tmp_path / "samples.json").read_text())
    assert data["files"]["samples"] == str(tmp_path / "samples.json")
    again = LatencyStats.from_samples(samples["total_ms"])
    for key in ("p50", "p90", "p99", "max", "mean"):
        assert getattr(again, key) == data["steady"]["total"][key], key
    for stage in ("validate", "replay"):
        stage_again = LatencyStats.from_samples([row[stage] for row in samples["per_call_ms"]])
        assert stage_again.p99 == data["steady"]["stages"][stage]["p99"], stage
    assert len(samples["per_call_ms"]) == 12 and len(samples["vs_total eager"]) == 12


def test_console_shows_the_gate_verdict(tiny_profile, fake_name):
    from rich.console import Console

    register_fake(fake_name)
    console = Console(record=True, width=120)
    render(_run(fake_name, tiny_profile()), console=console)
    text = console.export_text()
    assert "quality gate" in text and "passed" in text and "max_abs" in text


def test_profiler_trace_names_each_side_and_stage_over_the_ops():
    """`--trace-out` on a GPU: torch.profiler's Chrome trace with flashrt's stage names as ranges (run
    here with the CPU activity only; on CUDA the kernels are added)."""
    from flashrt.bench.harness import Side, profiler_trace
    from flashrt.bench.trace import FrozenTrace

    trace = FrozenTrace.from_inputs([{"x": torch.randn(4, 3)} for _ in range(2)], seed=0)
    sides = [Side("A", FakeImpl(name="flashrt"), "cpu", 0, 0), Side("B", FakeImpl(name="eager"), "cpu", 0, 0)]
    events = json.loads(json.dumps(profiler_trace(sides, trace, "cpu", calls=3)))  # strict JSON
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"]
    names = [e["name"] for e in ranges]
    assert names.count("validate") == names.count("replay") == 6
    assert {f"{s} call {i}" for s in ("flashrt", "eager") for i in range(3)} <= set(names)
    assert all(isinstance(e["ts"], int | float) and e["dur"] >= 0 for e in ranges)
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    assert any(e["name"] in ("aten::mul", "aten::add") for e in ops)
    call0 = next(e for e in ranges if e["name"] == "flashrt call 0")
    inside = [e["name"] for e in ranges if call0["ts"] <= e["ts"] <= call0["ts"] + call0["dur"]
              and e["name"] in ("validate", "replay")]
    assert inside[:2] == ["validate", "replay"]
