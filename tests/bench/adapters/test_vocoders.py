"""The `hifigan` / `bigvgan` / `vocos` / `snac` benchmark adapters on the tiny presets: registration,
seeded random weights through the one loading path, stage mapping against the one-shot decode, the quality
gate through the harness, FLOP accounting (pinned for HiFi-GAN against a hand count of its convolutions),
a saved checkpoint, refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flashrt.bench.adapters import vocoders as vb
from flashrt.bench.harness import BenchOptions, run_benchmark
from flashrt.bench.profiles import parse_profile
from flashrt.bench.registry import ReferenceUnavailable, available, discover
from flashrt.errors import ConfigError
from flashrt.frontends.vocoders import get_family
from flashrt.io import build_on_meta, reset_derived
from flashrt.profile.timers import StageTimer
from flashrt.runner.vocoder import load_vocoder

FAMILIES = tuple(vb.SPECS)


def profile(**sections):
    data = {"device": {"kind": "cpu", "threads": 1}, "shapes": {"preset": "tiny"},
            "bench": {"warmup": 1, "iters": 4, "trace_len": 2, "target_rate_hz": 10.0},
            "quality": {"atol": 1e-5, "rtol": 1e-5}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return parse_profile(data, "vocoder-test")


@pytest.fixture(scope="module")
def benches():
    made = {name: vb.FACTORIES[name](profile(), None, "cpu") for name in FAMILIES}
    yield made
    for bench in made.values():
        bench.close()


def test_registry_finds_every_family():
    assert set(FAMILIES) <= set(available())
    assert "flashrt.bench.adapters.vocoders" not in discover()


@pytest.mark.parametrize("name", FAMILIES)
def test_run_maps_the_stages_and_equals_the_one_shot_decode(benches, name):
    bench = benches[name]
    inputs = bench.make_inputs(0)
    timer = StageTimer()
    out = bench.run(inputs[0], timer)["audio"]
    assert [r.stage for r in timer.records()] == ["validate", "h2d", "replay", "d2h"]
    names = [s.name for s in bench.voc.signature.inputs]
    want = bench.voc(*[inputs[0][n] for n in names])
    assert out.shape == want.shape == (1, bench.voc.signature.samples(bench.frames))
    assert torch.equal(out, want) and out.dtype == torch.float32 and out.device.type == "cpu"
    assert not torch.allclose(bench.run(inputs[1], timer)["audio"], out)


@pytest.mark.parametrize("name", FAMILIES)
def test_random_weights_are_seeded(name):
    fam, cfg = get_family(name), vb.bench_config(vb.SPECS[name], profile())
    a = vb.random_module(fam, cfg, 5, "cpu", torch.float32).state_dict()
    b = vb.random_module(fam, cfg, 5, "cpu", torch.float32).state_dict()
    c = vb.random_module(fam, cfg, 6, "cpu", torch.float32).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


def test_benched_modules_run_the_family_conv_policy(benches):
    """Random weights (no package) or the package's checkpoint: the module benched is the one
    `load_vocoder` would give, with the family's default conv policy (BigVGAN: invariant forms)."""
    from flashrt.nn.audio import ConvTranspose1d

    ups = [m for m in benches["bigvgan"].voc.module.modules() if isinstance(m, ConvTranspose1d)]
    assert get_family("bigvgan").conv == "invariant" and ups and all(m.polyphase for m in ups)


def test_hifigan_flops_match_a_hand_count(benches):
    """2 x multiply-adds of every convolution of the tiny HiFi-GAN at its frame count (biases excluded)."""
    bench = benches["hifigan"]
    cfg, t = bench.voc.config, bench.frames
    flops = 2 * t * 7 * cfg.in_channels * cfg.upsample_initial_channel  # conv_pre, k = 7
    ch, length = cfg.upsample_initial_channel, t
    for rate, kernel in zip(cfg.upsample_rates, cfg.upsample_kernel_sizes):
        flops += 2 * length * kernel * ch * (ch // 2)  # transposed conv: every input tap x kernel
        ch, length = ch // 2, length * rate
        convs = sum(2 * len(d) * k for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
        flops += 2 * length * ch * ch * convs  # ResBlock1: convs1 + convs2 per dilation
    flops += 2 * length * 7 * ch  # conv_post
    got, nbytes = bench.flops_bytes()
    assert got == flops
    assert nbytes > bench.memory()["weights"] > 0


def test_fused_cpu_kernels_are_counted_like_their_plain_ops(benches):
    """Vocos on the CPU runs oneDNN fused linears; on meta the plain F.linear path: same FLOPs."""
    bench = benches["vocos"]
    module = build_on_meta(lambda: bench.voc.family.build(bench.voc.config))
    reset_derived(module, "meta")
    x = bench.make_inputs(0)[0]["features"]
    assert vb.count_flops(module, [x.to("meta")]) == bench.flops_bytes()[0] > 0


@pytest.mark.parametrize("name", ["vocos", "snac"])
def test_gate_trace_against_eager_through_the_harness(name):
    options = BenchOptions(vs="eager", progress=False)
    result = run_benchmark(name, profile(runtime={"backend": "trace"}), options)
    assert result.status == "ok" and result.implementation == "flashrt:trace"
    assert result.gate["passed"] and result.gate["vs"]["passed"] and result.gate["max_abs"] == 0.0
    assert list(result.steady["stages"]) == ["validate", "h2d", "replay", "d2h"]
    assert result.roofline["flops_per_call"] > 0


def test_snac_on_onnxrt_passes_the_gate_on_the_random_weights():
    """`bench snac --vs onnxrt`: the random SNAC weights have the package's init variance (`WEIGHT_GAIN`), so
    activations stay in the range real weights give; with N(0, 1/fan_in) the export's unfused linear + add
    rounded 3e-4 off the fused eager step and the gate (1e-5) refused the comparison."""
    result = run_benchmark("snac", profile(), BenchOptions(vs="onnxrt", iters=2, warmup=1, progress=False))
    assert result.status == "ok" and result.gate["vs"]["passed"], result.gate["vs"]
    assert result.gate["vs"]["max_abs"] < 1e-5


def test_saved_checkpoint_loads_the_same_weights(benches, tmp_path):
    """--checkpoint: a saved flashrt-layout HiFi-GAN (jik876 keys) decodes like the in-memory one."""
    bench = benches["hifigan"]
    folder = tmp_path / "hifigan"
    folder.mkdir()
    torch.save(bench.voc.module.state_dict(), folder / "generator.pt")
    loaded = vb.FACTORIES["hifigan"](profile(), str(folder / "generator.pt"), "cpu")
    x = bench.make_inputs(3)[0]
    assert torch.equal(loaded.run(x, StageTimer())["audio"], bench.run(x, StageTimer())["audio"])
    # the bench writes transformers' layout where transformers imports: the saved state dict is jik876's
    saved = load_vocoder(folder / "generator.pt", family="hifigan", config="tiny").config
    assert saved == replace(bench.voc.config, layout="generator")


def test_buckets_and_frames_from_the_profile():
    bench = vb.FACTORIES["vocos"](profile(shapes={"chunk": 20, "buckets": [24, 48]}), None, "cpu")
    assert bench.frames == 20 and {24, 48} <= set(bench.voc.buckets)
    x = bench.make_inputs(0)[0]
    assert x["features"].shape == (1, 20, 20)
    assert bench.run(x, StageTimer())["audio"].shape[-1] == 20 * 64 - 64  # hop 64, center padding trims one


@pytest.mark.parametrize("sections, match", [
    ({"shapes": {"preset": "huge"}}, "no preset"),
    ({"model": {"layers": 3}}, "layers"),
])
def test_refusals(sections, match):
    with pytest.raises(ConfigError, match=match):
        vb.FACTORIES["snac"](profile(**sections), None, "cpu")
    with pytest.raises(ConfigError, match="int8"):
        vb.FACTORIES["snac"](replace(profile(), precision="int8"), None, "cpu")


def test_snac_noise_seeded_decodes_with_the_noise_blocks():
    """`[model] noise_mode = "seeded"` (`bench snac --snac-noise seeded`): the decoder with its noise blocks,
    reproducible call to call; the snac package (unseeded noise) is no reference; other families refuse."""
    bench = vb.FACTORIES["snac"](profile(model={"noise_mode": "seeded"}), None, "cpu")
    try:
        assert bench.voc.config.noise and bench.voc.config.noise_mode == "seeded"
        assert "noise seeded" in bench.voc.summary()
        x = bench.make_inputs(0)[0]
        assert torch.equal(bench.run(x, StageTimer())["audio"], bench.run(x, StageTimer())["audio"])
        with pytest.raises(ReferenceUnavailable, match="unseeded noise"):
            bench.reference("snac")
    finally:
        bench.close()
    with pytest.raises(ConfigError, match="SNAC option"):
        vb.FACTORIES["hifigan"](profile(model={"noise_mode": "seeded"}), None, "cpu")
    with pytest.raises(ConfigError, match="'off' or 'seeded'"):
        vb.FACTORIES["snac"](profile(model={"noise_mode": "loud"}), None, "cpu")


def test_unknown_and_unavailable_references(benches):
    with pytest.raises(ReferenceUnavailable, match="offers eager"):
        benches["snac"].reference("encodec")
    for name, bench in benches.items():
        if bench.folder is None:  # the package is not importable here
            with pytest.raises(ReferenceUnavailable, match=vb.SPECS[name].package):
                bench.reference(vb.SPECS[name].package)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", FAMILIES)
def test_cuda_graph_replay_against_eager_on_the_gpu(name):
    p = profile(device={"kind": "cuda", "threads": 0}, runtime={"backend": "cuda"},
                quality={"atol": 1e-4, "rtol": 1e-4})
    result = run_benchmark(name, p, BenchOptions(vs="eager", progress=False))
    assert result.status == "ok" and result.implementation == "flashrt:cuda"
    assert result.gate["passed"] and result.gate["vs"]["passed"]
    assert result.steady["stages"]["replay"].p50 > 0
