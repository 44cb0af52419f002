"""The `pi0` / `pi05` benchmark adapters on the tiny preset: registration, the random checkpoint's
lerobot layout (checked against checkpoints lerobot 0.6.1 itself saved: tests/fixtures/pi0_e2e), the
quality gate through the harness, FLOP/byte accounting, the control-loop view, refusals."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from flashrt.bench.adapters import pi0 as pi0_bench
from flashrt.bench.harness import BenchOptions, run_benchmark
from flashrt.bench.loop import LoopConfig, run_loop, summarize_loop
from flashrt.bench.profiles import parse_profile
from flashrt.bench.registry import ReferenceUnavailable, available, discover
from flashrt.errors import ConfigError
from flashrt.frontends.pi0.config import config_from_state_dict_shapes, preset
from flashrt.frontends.pi0.model import bytes_per_step, flops_per_step
from flashrt.profile.timers import StageTimer
from flashrt.testing.synthetic import pi0 as synthetic
from flashrt.testing.synthetic.pi0 import SyntheticSizes

E2E = Path(__file__).resolve().parents[2] / "fixtures" / "pi0_e2e"
# The sizes of the lerobot-saved e2e fixtures (tests/fixtures/gen/gen_pi0_e2e.py, case *_cam2).
E2E_SIZES = SyntheticSizes(vision_width=32, vision_depth=2, vision_mlp=64, image_size=42, vlm_width=64,
                      vlm_mlp=128, expert_width=32, expert_mlp=64, depth=2, head_dim=16, max_dim=12,
                      chunk_size=6, n_action_steps=4, num_steps=3)
E2E_VOCAB, E2E_TOKENS = 395, {"pi0": 24, "pi05": 72}


def profile(**sections):
    data = {"device": {"kind": "cpu", "threads": 1}, "shapes": {"preset": "tiny"},
            "bench": {"warmup": 1, "iters": 4, "trace_len": 3, "target_rate_hz": 10.0},
            "quality": {"atol": 1e-5, "rtol": 1e-5}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return parse_profile(data, "pi0-test")


@pytest.fixture(scope="module")
def pi0():
    bench = pi0_bench.make_pi0_benchmark(profile(), None, "cpu")
    yield bench
    bench.close()


def test_registry_finds_both_variants():
    entries = available()
    assert {"pi0", "pi05"} <= set(entries)
    assert "flashrt.bench.adapters.pi0" not in discover()
    assert entries["pi05"].factory is pi0_bench.make_pi05_benchmark


@pytest.mark.parametrize("variant", pi0_bench.VARIANTS)
def test_random_checkpoint_has_the_layout_lerobot_saves(variant):
    """Key -> shape table, processor pipelines and config values equal what lerobot 0.6.1 wrote."""
    policy_dir = E2E / f"{variant}_cam2" / "policy"
    with safe_open(str(policy_dir / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in sorted(f.keys())}
    assert synthetic.lerobot_shapes(variant, E2E_SIZES, E2E_VOCAB) == saved
    sizes = replace(E2E_SIZES, max_tokens=E2E_TOKENS[variant])
    spec = synthetic.SyntheticSpec(variant, sizes, ("top", "wrist"))
    pre, post = synthetic.processor_jsons(spec)
    assert pre == json.loads((policy_dir / "policy_preprocessor.json").read_text())
    assert post == json.loads((policy_dir / "policy_postprocessor.json").read_text())
    config, lerobot = synthetic.config_json(spec), json.loads((policy_dir / "config.json").read_text())
    assert {k: lerobot[k] for k in config} == config


@pytest.mark.parametrize("variant", pi0_bench.VARIANTS)
def test_full_preset_has_the_real_sizes(variant):
    """Shapes only (no weights): the full preset derives to Pi0's SigLIP So400m, Gemma 2B and 300M."""
    shapes = synthetic.lerobot_shapes(variant, pi0_bench.FULL, pi0_bench.PRESETS["full"].vocab)
    cfg = config_from_state_dict_shapes(shapes, variant, "gemma_2b", "gemma_300m")
    want = preset(variant)
    assert (cfg.vision, cfg.vlm, cfg.expert, cfg.max_action_dim) == (want.vision, want.vlm, want.expert, 32)
    assert pi0_bench.PRESETS["expert"] == pi0_bench.PRESETS["full"]


def test_random_weights_are_seeded_tied_and_typed():
    shapes = synthetic.lerobot_shapes("pi0", E2E_SIZES, E2E_VOCAB)
    a = synthetic.random_weights(shapes, 3, dtype=torch.bfloat16)
    b = synthetic.random_weights(shapes, 3, dtype=torch.bfloat16)
    c = synthetic.random_weights(shapes, 4)
    head = "model.paligemma_with_expert.paligemma."
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == torch.bfloat16 for k in a)
    assert not torch.equal(a[head + "lm_head.weight"].float(), c[head + "lm_head.weight"])
    assert torch.equal(c[head + "lm_head.weight"], c[head + "model.language_model.embed_tokens.weight"])


def test_run_maps_the_policy_stages(pi0):
    timer = StageTimer()
    inputs = pi0.make_inputs(0)
    out = pi0.run(inputs[0], timer)
    assert out["actions"].shape == (10, 7) and out["actions"].dtype == np.float32
    assert [r.stage for r in timer.records()] == ["validate", "h2d", "replay", "postprocess"]
    expected = pi0.loaded.infer({k: inputs[0][k] for k in pi0_bench.OBS_KEYS}, noise=inputs[0]["noise"])
    assert np.array_equal(out["actions"], expected["actions"])
    other = pi0.run(inputs[1], timer)["actions"]
    assert not np.allclose(other, out["actions"])
    assert {"write_checkpoint", "load", "capture"} <= set(pi0.cold_start_ms)


def test_flops_and_bytes_follow_the_replayed_bucket(pi0):
    pi0.impl.buckets.clear()
    pi0.run(pi0.make_inputs(0)[0], StageTimer())
    (bucket,) = pi0.impl.buckets
    cfg = pi0.loaded.config
    flops, nbytes = pi0.flops_bytes()
    assert flops == flops_per_step(cfg, 2, bucket)["total"] > 0
    assert nbytes == bytes_per_step(cfg, 2, bucket, weight_bytes=4)["total"] > 0
    assert pi0.memory()["weights"] > 0 and pi0.memory()["buffers"] > 0


def test_gate_trace_against_eager_through_the_harness():
    options = BenchOptions(vs="eager", progress=False)
    result = run_benchmark("pi0", profile(runtime={"backend": "trace"}), options)
    assert result.status == "ok" and result.implementation == "flashrt:trace"
    assert result.gate["passed"] and result.gate["max_abs"] == 0.0 and result.gate["vs"]["passed"]
    assert list(result.steady["stages"]) == ["validate", "h2d", "replay", "postprocess"]
    assert result.steady["total"].count == 4 and result.vs["pairs"] == 4
    assert result.roofline["flops_per_call"] > 0 and result.roofline["bytes_per_call"] > 0


@pytest.mark.compile
@pytest.mark.timeout(2400)
def test_vs_compile_builds_passes_the_gate_and_is_timed():
    """`flashrt bench pi0 --vs compile` (docs/benchmarks/pi0.md, P3): the step under torch.compile traces
    (ATen MLPs, no_grad), matches the eager reference and is timed beside flashrt. Slow: inductor compiles
    the whole step on its first pass (minutes on 2 cores, much longer with a cold inductor cache)."""
    result = run_benchmark("pi0", profile(bench={"iters": 2, "warmup": 0}),
                           BenchOptions(vs="compile", progress=False))
    assert result.status == "ok" and result.vs["status"] == "ok", result.vs
    assert result.gate["vs"]["passed"] and result.gate["vs"]["max_abs"] <= 1e-5
    assert result.vs["pairs"] == 2 and result.vs["failures"] == 0
    assert result.cold_start_ms["vs_first_pass"] > 0


def test_pi05_views_chunk_and_steps_come_from_the_profile():
    bench = pi0_bench.make_pi05_benchmark(profile(shapes={"views": 3, "chunk": 4, "steps": 2}), None, "cpu")
    try:
        assert bench.loaded.cameras == ("top", "wrist", "side")
        assert bench.loaded.config.variant == "pi05" and bench.loaded.config.num_steps == 2
        inputs = bench.make_inputs(1)
        assert set(inputs[0]["images"]) == {"top", "wrist", "side"} and inputs[0]["noise"].shape == (1, 4, 32)
        eager = bench.reference("eager")
        for x in inputs:
            ours, ref = bench.run(x, StageTimer())["actions"], eager.run(x, StageTimer())["actions"]
            assert np.array_equal(ours, ref)
        assert bench.run(inputs[0], StageTimer())["actions"].shape == (4, 7)
    finally:
        bench.close()


def test_loop_replans_once_per_action_horizon_with_a_fake_clock(pi0):
    now = [0.0]

    def clock():
        now[0] += 1e-4  # every step takes a tenth of a millisecond
        return now[0]

    def sleep(seconds):
        now[0] += seconds

    trace = pi0.make_inputs(0)
    policy = pi0.policy()
    policy.reset()
    ticks = run_loop(policy, lambda k: trace[k % len(trace)], LoopConfig(rate_hz=50, steps=12),
                     clock=clock, sleep=sleep)
    assert [t.index for t in ticks if t.boundary] == [0, 5, 10]  # n_action_steps 5 of the tiny preset
    assert summarize_loop(ticks, LoopConfig(rate_hz=50, steps=12))["missed"] == 0


def test_real_checkpoint_and_variant_mismatch(tmp_path):
    folder = shutil.copytree(E2E / "pi0_cam1" / "policy", tmp_path / "policy")
    shutil.copy(E2E / "tokenizer.model", folder / "tokenizer.model")
    bench = pi0_bench.make_pi0_benchmark(profile(), str(folder), "cpu")
    x = bench.make_inputs(0)[0]
    assert set(x["images"]) == {"top"} and bench.run(x, StageTimer())["actions"].shape == (6, 5)
    assert "write_checkpoint" not in bench.cold_start_ms
    with pytest.raises(ConfigError, match="pi0 checkpoint"):
        pi0_bench.make_pi05_benchmark(profile(), str(folder), "cpu")


@pytest.mark.parametrize("sections, match", [
    ({"shapes": {"preset": "huge"}}, "no preset"),
    ({"shapes": {"views": 4}}, "at most 3"),
    ({"model": {"layers": 3}}, "layers"),
])
def test_refusals(sections, match):
    with pytest.raises(ConfigError, match=match):
        pi0_bench.make_pi0_benchmark(profile(**sections), None, "cpu")
    with pytest.raises(ConfigError, match="fp64"):
        pi0_bench.make_pi0_benchmark(replace(profile(), precision="fp64"), None, "cpu")


def test_int8_run_with_a_float_reference_gated_by_the_recipe(monkeypatch, tmp_path):
    import flashrt.quant.cache

    monkeypatch.setattr(flashrt.quant.cache, "default_root", lambda: tmp_path)  # not the user's cache
    bench = pi0_bench.make_pi05_benchmark(replace(profile(), precision="int8"), None, "cpu")
    try:
        assert bench.loaded.frontend.quantization["cache"] == "calibrated"
        assert "calibration" in bench.cold_start_ms and bench.quality()["min_cosine"] >= 0.995
        assert bench.vs_tolerance("fp32") == (0.5, 0.0) and bench.vs_tolerance("eager") is None
        assert bench.vs_tolerance("onnxrt") == (0.5, 0.0)  # another backend: rounding ties may flip
        x = bench.make_inputs(0)[0]
        fp32 = bench.reference("fp32").run(x, StageTimer())["actions"]
        assert np.abs(bench.run(x, StageTimer())["actions"] - fp32).max() <= 0.5
    finally:
        bench.close()


def test_unknown_and_unavailable_references(pi0):
    with pytest.raises(ReferenceUnavailable, match="offers eager"):
        pi0.reference("openpi")
    try:
        import lerobot  # noqa: F401
    except ImportError:
        with pytest.raises(ReferenceUnavailable, match="lerobot"):
            pi0.reference("lerobot")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_against_eager_on_the_gpu():
    p = profile(device={"kind": "cuda", "threads": 0}, runtime={"backend": "cuda"},
                quality={"atol": 1e-4, "rtol": 1e-4})
    result = run_benchmark("pi05", p, BenchOptions(vs="eager", progress=False))
    assert result.status == "ok" and result.implementation == "flashrt:cuda"
    assert result.gate["passed"] and result.gate["vs"]["passed"]
    assert result.steady["stages"]["replay"].p50 > 0 and result.roofline is not None
