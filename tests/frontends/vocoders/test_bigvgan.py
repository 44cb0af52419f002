"""BigVGAN: parity with the `bigvgan` package (with and without weight norm), streaming, strictness."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashrt import ops
from flashrt.errors import CheckpointError, InputError
from flashrt.frontends.vocoders.base import CheckpointSource
from flashrt.frontends.vocoders.bigvgan import PRESETS, BigVGAN, BigVGANConfig, detect, receptive_field
from flashrt.io import open_checkpoint
from flashrt.nn.alias_free import SINES, pick_sine
from flashrt.runner.vocoder import load_vocoder

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vocoders"
NAMES = ["bigvgan_tiny_wn", "bigvgan_tiny_plain"]


def _io(name: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / f"{name}_io.safetensors")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend,conv", [("eager", "auto"), ("trace", "auto"), ("eager", "spectral"),
                                          ("trace", "spectral")])
def test_parity_with_bigvgan_package(name, backend, conv):
    io = _io(name)
    voc = load_vocoder(FIXTURES / name, batch=2, buckets=(40,), backend=backend, stream_chunk=4, conv=conv)
    assert voc.family.name == "bigvgan"
    got = voc(io["mel"])
    assert got.shape == io["audio"].shape
    assert (got - io["audio"]).abs().max() <= 1e-5
    assert io["audio"].abs().mean() > 0.1


def test_fixtures_cover_both_weight_forms_and_variants():
    wn = open_checkpoint(FIXTURES / "bigvgan_tiny_wn")
    plain = open_checkpoint(FIXTURES / "bigvgan_tiny_plain")
    assert wn.subkey == "generator" and any(k.endswith("weight_g") for k in wn)
    assert not any(k.endswith("weight_g") for k in plain) and "conv_pre.weight" in plain
    a = BigVGANConfig.from_dict(json.loads((FIXTURES / "bigvgan_tiny_wn" / "config.json").read_text()))
    b = BigVGANConfig.from_dict(json.loads((FIXTURES / "bigvgan_tiny_plain" / "config.json").read_text()))
    flags = lambda c: (c.resblock, c.activation, c.use_tanh_at_final, c.use_bias_at_final)
    assert flags(a) == ("1", "snakebeta", False, False)
    assert flags(b) == ("2", "snake", True, True)


def test_snake_parameters_matter():
    """Negative control: zeroing the log-scale snake parameters moves the output far past tolerance."""
    io = _io("bigvgan_tiny_wn")
    tensors = dict(open_checkpoint(FIXTURES / "bigvgan_tiny_wn").items())
    cfg = load_vocoder(FIXTURES / "bigvgan_tiny_wn", capture=False).config
    flat = {k: (torch.zeros_like(v) if k.endswith(".beta") else v) for k, v in tensors.items()}
    voc = load_vocoder(flat, family="bigvgan", config=cfg, batch=2, buckets=(37,))
    assert (voc(io["mel"]) - io["audio"]).abs().max() > 0.05


@pytest.mark.parametrize("piece,chunk,conv", [(5, 6, "auto"), (37, 8, "auto"), (1, 37, "auto"),
                                              (5, 6, "spectral"), (37, 8, "spectral")])
def test_stream_equals_one_shot(piece, chunk, conv):
    io = _io("bigvgan_tiny_wn")
    voc = load_vocoder(FIXTURES / "bigvgan_tiny_wn", batch=2, buckets=(37,), stream_chunk=chunk, conv=conv)
    mel = io["mel"]
    parts = list(voc.stream(mel[..., i:i + piece] for i in range(0, 37, piece)))
    assert (torch.cat(parts, -1) - io["audio"]).abs().max() <= 1e-5


@pytest.mark.parametrize("piece,chunk,backend", [(5, 6, "eager"), (37, 8, "trace"), (1, 37, "eager")])
def test_default_stream_equals_one_shot_bit_for_bit(piece, chunk, backend):
    """BigVGAN's default conv policy ("invariant") computes each sample in the same order in every
    window, so the stream is the one-shot output exactly, not just within 1e-5."""
    io = _io("bigvgan_tiny_wn")
    voc = load_vocoder(FIXTURES / "bigvgan_tiny_wn", batch=2, buckets=(37,), stream_chunk=chunk,
                       backend=backend)
    assert "phase-split dilated convs" in voc.summary() and "spectral" not in voc.summary()
    mel = io["mel"]
    parts = list(voc.stream(mel[..., i:i + piece] for i in range(0, 37, piece)))
    assert torch.equal(torch.cat(parts, -1), voc(mel))


@pytest.mark.parametrize("sine", SINES)
def test_either_sine_streams_bit_for_bit_and_matches_the_package(sine):
    """The snakes' host sine (NumPy's, where it measured faster at load) and ATen's: both keep the stream
    equal to the one-shot call exactly and the output within the package's tolerance; a float32 CPU load
    takes the measured one."""
    io = _io("bigvgan_tiny_wn")
    voc = load_vocoder(FIXTURES / "bigvgan_tiny_wn", batch=2, buckets=(37,), stream_chunk=6)
    assert set(ops.choices(voc.module)["snake_sine"]) == {pick_sine()}
    ops.select(voc.module, "cpu", prefer={"snake_sine": sine})
    mel = io["mel"]
    one_shot = voc(mel)
    assert (one_shot - io["audio"]).abs().max() <= 1e-5
    parts = list(voc.stream(mel[..., i:i + 5] for i in range(0, 37, 5)))
    assert torch.equal(torch.cat(parts, -1), one_shot)


def test_declared_context_covers_measured_receptive_field():
    """Perturb one frame: no output farther than the declared context may move."""
    torch.manual_seed(0)
    cfg = PRESETS["tiny-snake2"]
    module = BigVGAN(cfg).eval()
    for sub in reversed(list(module.modules())):
        if hasattr(sub, "reset_derived"):
            sub.reset_derived()
    mel = torch.randn(1, 20, 60)
    moved = mel.clone()
    moved[..., 30] += 5.0
    with torch.no_grad():
        d = (module(moved) - module(mel)).abs().flatten()
    hop = cfg.hop_length
    frames = torch.nonzero(d > 0).flatten() // hop
    reach = receptive_field(cfg)
    assert 30 - int(frames.min()) <= reach.right and int(frames.max()) - 30 <= reach.left
    assert int(frames.max()) - 30 >= 1


def test_bad_input_then_good_call():
    io = _io("bigvgan_tiny_plain")
    voc = load_vocoder(FIXTURES / "bigvgan_tiny_plain", batch=2, buckets=(40,))
    for bad, match in [(io["mel"][:, :19], "channels"), (io["mel"] * float("nan"), "NaN"),
                       (io["mel"][..., :0], "empty")]:
        with pytest.raises(InputError, match=match):
            voc(bad)
        assert (voc(io["mel"]) - io["audio"]).abs().max() <= 1e-5


def test_bf16_runs_with_derived_filters_in_bf16():
    io = _io("bigvgan_tiny_wn")
    voc = load_vocoder(FIXTURES / "bigvgan_tiny_wn", batch=2, buckets=(40,), precision="bf16")
    got = voc(io["mel"])
    assert got.dtype == torch.float32 and (got - io["audio"]).abs().max() < 0.2
    act = voc.module.activation_post
    assert act.upsample.filter_rows.dtype == act.downsample.filter_rows.dtype == torch.bfloat16


def test_wrong_checkpoint_is_reported():
    with pytest.raises(CheckpointError, match="looks like a hifigan checkpoint"):
        load_vocoder(FIXTURES / "speecht5_hifigan_tiny", family="bigvgan")
    tensors = dict(open_checkpoint(FIXTURES / "bigvgan_tiny_plain").items())
    cfg = load_vocoder(FIXTURES / "bigvgan_tiny_wn", capture=False).config      # other variant's sizes
    with pytest.raises(CheckpointError, match="missing|mis-shaped"):
        load_vocoder(tensors, family="bigvgan", config=cfg)


def test_detection():
    keys = frozenset(open_checkpoint(FIXTURES / "bigvgan_tiny_wn").keys())
    assert detect(CheckpointSource(None, None, keys))
    assert detect(CheckpointSource(None, {"activation": "snakebeta", "upsample_rates": [4]}, frozenset()))
    assert not detect(CheckpointSource(None, {"model_type": "hifigan"}, frozenset()))


@pytest.mark.parametrize("name,millions", [("base-24k-100band", 14.02), ("v2-24k-100band-256x", 112.41)])
def test_real_size_presets(name, millions):
    with torch.device("meta"):
        module = BigVGAN(PRESETS[name])
    assert abs(sum(p.numel() for p in module.parameters()) / 1e6 - millions) < 0.01


def test_invariant_policy_makes_a_wider_stream_exact():
    """At these sizes oneDNN's dilated/transposed kernels round by position (negative control: the
    `direct` policy's stream differs from its one-shot output); the default `invariant` does not."""
    from flashrt.frontends.vocoders import get_family
    from flashrt.nn.conv_policy import POLICIES, apply_conv_policy
    from flashrt.runner.vocoder import Vocoder
    from flashrt.testing.synthetic.vocoders import random_module

    fam = get_family("bigvgan")
    cfg = BigVGANConfig(num_mels=20, upsample_initial_channel=128, upsample_rates=(8, 8),
                        upsample_kernel_sizes=(16, 16), resblock_kernel_sizes=(3, 11),
                        resblock_dilation_sizes=((1, 3, 5), (1, 3, 5)))
    module = random_module(fam, cfg, 0, "cpu", torch.float32)
    mel = torch.randn(1, 20, 60, generator=torch.Generator().manual_seed(0))
    delta = {}
    for policy in ("direct", "invariant"):
        apply_conv_policy(module, POLICIES[policy])
        voc = Vocoder(fam, cfg, module, buckets=(60,), stream_chunk=8).capture()
        parts = list(voc.stream(mel[..., i:i + 7] for i in range(0, 60, 7)))
        delta[policy] = float((torch.cat(parts, -1) - voc(mel)).abs().max())
    # the negative control is CPU-dependent (oneDNN picks its kernels per ISA): 4e-6 on the dev CPU
    assert delta["invariant"] == 0.0, delta


def test_native_activations_stream_bit_for_bit_and_match_the_torch_form():
    """A float32 CPU load runs the anti-aliased activations in the native kernel (where this machine
    builds it): the stream stays the one-shot output exactly, and the output stays within fp32 noise of
    the torch form's."""
    from flashrt.frontends.vocoders import get_family, prepare_module
    from flashrt.ops import csrc_cpu
    from flashrt.runner.vocoder import Vocoder
    from flashrt.testing.synthetic.vocoders import random_module

    if csrc_cpu.load() is None:
        pytest.skip("the CPU kernels cannot be built here (no C compiler)")
    fam = get_family("bigvgan")
    cfg = BigVGANConfig(num_mels=20, upsample_initial_channel=128, upsample_rates=(8, 4),
                        upsample_kernel_sizes=(16, 8), resblock_kernel_sizes=(3, 11),
                        resblock_dilation_sizes=((1, 3, 5), (1, 3, 5)))
    module = prepare_module(fam, random_module(fam, cfg, 0, "cpu", torch.float32), "cpu", torch.float32)
    voc = Vocoder(fam, cfg, module, buckets=(60,), stream_chunk=8).capture()
    # 2 stages x 2 blocks x 6, and the last one
    assert "25 anti-aliased activations in the native CPU kernel" in voc.summary()
    mel = torch.randn(1, 20, 60, generator=torch.Generator().manual_seed(0))
    one_shot = voc(mel)
    parts = list(voc.stream(mel[..., i:i + 7] for i in range(0, 60, 7)))
    assert torch.equal(torch.cat(parts, -1), one_shot)
    ops.select(module, "cpu", prefer={"aa_snake": "torch"})
    torch_form = voc(mel)
    assert 0 < float((one_shot - torch_form).abs().max()) <= 5e-5      # 8e-6 on the dev CPU
