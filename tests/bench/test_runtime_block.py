import pytest
import torch

from flashrt.bench.harness import BenchOptions, run_benchmark
from flashrt.bench.registry import ReferenceUnavailable
from flashrt.bench.runtime_block import PRESETS, make_benchmark
from flashrt.errors import ConfigError
from flashrt.profile.timers import StageTimer


def test_static_path_matches_the_plain_layer_on_every_backend(tiny_profile):
    bench = make_benchmark(tiny_profile(runtime={"backend": "trace"}), None, "cpu")
    inputs = bench.make_inputs(0)
    eager = bench.reference("eager")
    timer = StageTimer()
    for x in inputs:
        y, ref = bench.run(x, timer)["y"], eager.run(x, timer)["y"]
        assert y.shape == (1, 8, 64) and torch.equal(y, ref)
    assert [r.stage for r in timer.records()[:5]] == ["validate", "h2d", "replay", "d2h", "postprocess"]
    other = bench.reference("eager-backend")
    assert torch.equal(other.run(inputs[0], timer)["y"], eager.run(inputs[0], timer)["y"])
    assert {"load", "buffers", "capture"} <= set(bench.cold_start_ms)


def test_outputs_depend_on_the_input(tiny_profile):
    bench = make_benchmark(tiny_profile(), None, "cpu")
    a, b = bench.make_inputs(0)[:2]
    assert not torch.equal(bench.run(a, StageTimer())["y"], bench.run(b, StageTimer())["y"])


def test_flops_and_bytes_of_the_tiny_preset(tiny_profile):
    bench = make_benchmark(tiny_profile(), None, "cpu")
    c = PRESETS["tiny"]
    n, s = c.batch * c.tokens, c.prefix + c.tokens
    matmuls = [(c.width, (c.heads + 2 * c.kv_heads) * c.head_dim), (c.heads * c.head_dim, c.width),
               (c.width, 2 * c.mlp_dim), (c.mlp_dim, c.width)]
    expected = sum(2 * n * k * m for k, m in matmuls) + 2 * 2 * n * c.heads * c.head_dim * s
    params = sum(p.numel() for p in bench.model.layer.parameters())
    flops, nbytes = bench.flops_bytes()
    assert flops == expected
    assert nbytes == 4 * (params + 2 * c.kv_heads * s * c.head_dim + 2 * n * c.width)
    assert bench.memory()["weights"] == 4 * params


def test_policy_replans_once_per_chunk(tiny_profile):
    bench = make_benchmark(tiny_profile(), None, "cpu")
    policy = bench.policy()
    obs = bench.make_inputs(0)[0]
    flags = []
    for _ in range(20):
        action = policy.step(obs)
        flags.append(policy.replanned)
    assert action.shape == (8,) and [i for i, f in enumerate(flags) if f] == [0, 8, 16]


@pytest.mark.parametrize("sections, match", [
    ({"shapes": {"preset": "huge"}}, "no preset"),
    ({"precision": "fp8"}, "fp8"),
    ({"model": {"layers": 3}}, "layers"),
])
def test_refusals(tiny_profile, sections, match):
    precision = sections.pop("precision", None)
    profile = tiny_profile(**sections)
    if precision:
        from dataclasses import replace

        profile = replace(profile, precision=precision)
    with pytest.raises(ConfigError, match=match):
        make_benchmark(profile, None, "cpu")


def test_unknown_reference_and_checkpoint(tiny_profile):
    bench = make_benchmark(tiny_profile(), None, "cpu")
    with pytest.raises(ReferenceUnavailable, match="lerobot"):
        bench.reference("lerobot")
    with pytest.raises(ConfigError, match="checkpoint"):
        make_benchmark(tiny_profile(), "/some/ckpt", "cpu")


def test_bench_runs_trace_replay_against_eager(tiny_profile):
    profile = tiny_profile(runtime={"backend": "trace"}, bench={"iters": 6, "warmup": 1})
    result = run_benchmark("runtime-block", profile, BenchOptions(vs="eager", progress=False))
    assert result.status == "ok" and result.implementation == "flashrt:trace"
    assert result.gate["passed"] and result.gate["max_abs"] == 0.0
    assert result.steady["total"].count == 6 and result.vs["pairs"] == 6
    assert list(result.steady["stages"]) == ["validate", "h2d", "replay", "d2h", "postprocess"]
    assert result.roofline["bound"] in ("compute", "memory")


def test_onnxrt_as_the_measured_backend_and_as_vs(tiny_profile, tmp_path, monkeypatch):
    """`--backend onnxrt` and `--vs onnxrt`: the layer exported (export cache in a tmp folder) and run by
    onnxruntime on its own static buffers, gated against eager and timed pair by pair."""
    import functools

    from flashrt.runtime import graphs, onnxrt

    entry = graphs._REGISTRY["onnxrt"]
    monkeypatch.setitem(graphs._REGISTRY, "onnxrt", graphs.BackendEntry(
        "onnxrt", functools.partial(onnxrt.OnnxRuntimeBackend, cache_dir=tmp_path, threads=1), entry.devices,
        entry.doc, entry.takes_device))
    profile = tiny_profile(quality={"atol": 1e-5, "rtol": 1e-5})  # cpu-tiny's: onnxruntime sums in its order
    options = BenchOptions(vs="onnxrt", iters=3, warmup=1, progress=False)
    result = run_benchmark("runtime-block", profile, options)
    assert result.status == "ok", result.reason
    assert result.vs["name"] == "onnxrt" and result.vs["status"] == "ok"
    assert result.gate["vs"]["passed"] and result.vs["pairs"] == 3
    measured = run_benchmark("runtime-block", profile, BenchOptions(backend="onnxrt", iters=2, warmup=1,
                                                                   progress=False))
    assert measured.status == "ok" and measured.implementation == "flashrt:onnxrt"
    assert measured.gate["passed"] and onnxrt.STATS.cache_hits >= 1   # the second run loads, no export
