"""The shared Vocoder frontend: buckets (pad + trim), streaming == one-shot, bad input, registry, cards."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flashrt.errors import CheckpointError, ConfigError, InputError
from flashrt.frontends.vocoders import (
    config_for,
    families,
    get_family,
    read_card,
    register_vocoder,
)
from flashrt.frontends.vocoders.hifigan import PRESETS, HifiGan
from flashrt.io import reset_derived
from flashrt.nn.audio import EXACT
from flashrt.profile import StageTimer
from flashrt.resources import list_data
from flashrt.runner.vocoder import Vocoder, load_vocoder

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vocoders"


def _weights(preset: str = "tiny", seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    module = HifiGan(PRESETS[preset])
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(2.0)                       # outputs ~0.4, unsaturated
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return _weights()


@pytest.fixture(scope="module")
def reference(weights):
    """The same HiFi-GAN module run unpadded, without the frontend (what one-shot must reproduce)."""
    module = HifiGan(PRESETS["tiny"]).eval()
    module.load_state_dict(weights)
    reset_derived(module, "cpu")                  # what load_module does after assigning weights
    return lambda x: module(x).detach()


@pytest.fixture(scope="module")
def voc(weights):
    return load_vocoder(weights, family="hifigan", config="tiny", buckets=(16, 64), stream_chunk=10, batch=2)


def _mel(frames: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 16, frames, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ one-shot

@pytest.mark.parametrize("frames", [1, 5, 16, 17, 50, 64])
def test_one_shot_pads_and_trims_exactly(voc, reference, frames):
    mel = _mel(frames)
    with torch.no_grad():
        want = reference(mel)
    got = voc(mel)
    assert got.shape == (1, frames * 16) and got.dtype == torch.float32
    assert (got - want).abs().max() <= 1e-5


def test_unbatched_numpy_and_batched_inputs(voc, reference):
    mel = _mel(20, batch=2)
    with torch.no_grad():
        want = reference(mel)
    assert (voc(mel) - want).abs().max() <= 1e-5
    one = voc(mel[1].numpy())                                   # (C, T) numpy -> batch of one
    assert one.shape == (1, 320) and (one - want[1:]).abs().max() <= 1e-5


def test_trace_backend_equals_eager(weights, voc):
    traced = load_vocoder(weights, family="hifigan", config="tiny", buckets=(24,), backend="trace",
                          stream_chunk=4)
    eager = load_vocoder(weights, family="hifigan", config="tiny", buckets=(24,), stream_chunk=4)
    mel = _mel(24)   # the bucket's own length: the same shapes on both sides, bit for bit
    assert torch.equal(traced(mel), eager(mel))
    short = _mel(21)  # eager runs 21 frames, the trace the padded bucket: equal up to conv rounding
    assert (traced(short) - eager(short)).abs().max() <= 1e-6
    assert traced.report()["graphs"]["backend"] == "trace"


# ---------------------------------------------------------------------------------------- streaming

@pytest.mark.parametrize("piece", [1, 5, 7, 10, 50])
def test_stream_equals_one_shot(voc, piece):
    """50 frames fed in pieces that do (1, 5, 10, 50) and do not (7) divide the length; chunk 10."""
    mel = _mel(50, batch=2, seed=3)
    whole = voc(mel)
    parts = list(voc.stream(mel[..., i:i + piece] for i in range(0, 50, piece)))
    assert len(parts) >= 2
    assert (torch.cat(parts, dim=-1) - whole).abs().max() <= 1e-5
    report = voc.report()
    assert report["mode"] == "stream" and report["frames"] == 50 and report["ttfa_ms"] > 0
    assert report["rtf"] > 0 and report["windows"] == len(parts)


@pytest.mark.parametrize("frames,chunk", [(53, 13), (39, 13), (3, 13), (30, 7)])
def test_stream_chunk_sizes(weights, frames, chunk):
    """Stream chunks that do and do not divide the input length (and inputs shorter than one chunk)."""
    voc = load_vocoder(weights, family="hifigan", config="tiny", buckets=(64,), stream_chunk=chunk)
    mel = _mel(frames, seed=frames)
    parts = list(voc.stream([mel[..., :frames // 2], mel[..., frames // 2:]]))
    assert (torch.cat(parts, dim=-1) - voc(mel)).abs().max() <= 1e-5
    sizes = [p.shape[-1] for p in parts]
    assert all(s == chunk * 16 for s in sizes[:-1]) and sum(sizes) == frames * 16


def test_stream_is_lazy(voc):
    """The first audio arrives before the producer is exhausted (after chunk + right context frames)."""
    seen = []

    def producer():
        for i in range(10):
            seen.append(i)
            yield _mel(5, seed=i)

    first = next(iter(voc.stream(producer())))
    left, right = voc.signature.context
    assert first.shape[-1] == 10 * 16
    assert len(seen) == math.ceil((10 + right) / 5) < 10


def test_stream_window_is_a_bucket(voc):
    left, right = voc.signature.context
    assert voc.stream_window == left + 10 + right and voc.stream_window in voc.buckets


# ---------------------------------------------------------------------------------------- bad input

BAD_INPUTS = {
    "wrong mel bins": (lambda: _mel(20)[:, :12], "channels"),
    "nan": (lambda: _mel(20).index_fill(-1, torch.tensor([3]), float("nan")), "NaN"),
    "inf": (lambda: _mel(20).index_fill(-1, torch.tensor([7]), float("inf")), "NaN or inf"),
    "empty": (lambda: torch.zeros(1, 16, 0), "empty"),
    "too long": (lambda: _mel(200), "largest bucket"),
    "integer": (lambda: torch.ones(1, 16, 20, dtype=torch.int64), "floating"),
    "4-d": (lambda: torch.zeros(1, 1, 16, 20), "shape"),
    "batch too large": (lambda: _mel(20, batch=3), "batch"),
    "nested list": (lambda: [[0.0] * 20] * 16, "expected 1 input"),
    "not an array": (lambda: "mel.npy", "tensor or numpy"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_then_good_call(voc, reference, case):
    make, match = BAD_INPUTS[case]
    good = _mel(33, seed=5)
    before = voc(good)
    with pytest.raises(InputError, match=match):
        voc(make())
    after = voc(good)
    assert torch.equal(before, after)
    with torch.no_grad():
        assert (after - reference(good)).abs().max() <= 1e-5


def test_bad_chunk_mid_stream_then_good_stream(voc):
    mel = _mel(40, seed=6)
    want = voc(mel)
    bad = mel[..., 20:].clone()
    bad[0, 0, 3] = float("nan")
    with pytest.raises(InputError, match="NaN"):
        list(voc.stream([mel[..., :20], bad]))
    with pytest.raises(InputError, match="batch"):
        list(voc.stream([mel[..., :20], _mel(20, batch=2)]))
    assert (torch.cat(list(voc.stream([mel[..., :20], mel[..., 20:]])), -1) - want).abs().max() <= 1e-5


# ----------------------------------------------------------------------------- registry and loading

def test_registry_lists_and_refuses_duplicates():
    fams = families()
    assert {"hifigan", "bigvgan"} <= set(fams)
    with pytest.raises(ConfigError, match="already registered"):
        register_vocoder(__import__("dataclasses").replace(fams["hifigan"], doc="other"))
    with pytest.raises(ConfigError, match="unknown vocoder family"):
        get_family("wavenet")


def test_config_overrides_are_checked():
    fam = get_family("hifigan")
    cfg = config_for(fam, "tiny", {"upsample_rates": [4, 2], "upsample_kernel_sizes": [8, 4]})
    assert cfg.upsample_rates == (4, 2) and cfg.hop_length == 8
    with pytest.raises(ConfigError, match="unknown config keys"):
        config_for(fam, "tiny", {"num_mels": 80})
    with pytest.raises(ConfigError, match="unknown preset"):
        config_for(fam, "v9")


def test_precision_and_unknown_family_errors(weights):
    with pytest.raises(ConfigError, match="precision"):
        load_vocoder(weights, family="hifigan", config="tiny", precision="int4")
    with pytest.raises(CheckpointError, match="no known vocoder family"):
        load_vocoder({"w": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="no config.json"):
        load_vocoder(weights)                                   # detected as hifigan, sizes unknown


def test_wrong_family_is_a_checkpoint_error():
    with pytest.raises(CheckpointError, match="looks like a hifigan checkpoint, not 'bigvgan'"):
        load_vocoder(FIXTURES / "hifigan_v1_tiny", family="bigvgan")
    with pytest.raises(CheckpointError, match="looks like a bigvgan checkpoint"):
        load_vocoder(FIXTURES / "bigvgan_tiny_wn", family="hifigan")


def test_bf16_precision_runs(weights, reference):
    voc = load_vocoder(weights, family="hifigan", config="tiny", precision="bf16", buckets=(32,))
    mel = _mel(30)
    got = voc(mel)
    assert got.dtype == torch.float32 and voc.buffers["features"].dtype == torch.bfloat16
    with torch.no_grad():
        assert (got - reference(mel)).abs().max() < 0.1


def test_buffers_are_declared_once(voc):
    names = {s.name: s for s in voc.buffer_specs()}
    assert set(names) == {"features", "length", "offset", "audio"}
    assert names["audio"].shape == (2, voc.max_frames * 16)
    assert "features" in voc.buffers.summary() and voc.buffers.nbytes() > 0
    assert "hifigan vocoder" in voc.summary()


# -------------------------------------------------------------------------------------------- cards

VOCODER_CARDS = sorted(n for n, p in list_data("models").items() if n.startswith(("hifigan", "bigvgan")))


@pytest.mark.parametrize("name", VOCODER_CARDS)
def test_card_resolves_to_a_buildable_config(name):
    card = read_card(name)
    fam = get_family(card["family"])
    cfg = config_for(fam, card["preset"], card.get("config"))
    sig = fam.signature(cfg)
    assert sig.hop_length == 256 and min(sig.context) > 0
    with torch.device("meta"):
        module = fam.build(cfg)
    assert sum(p.numel() for p in module.parameters()) > 1e6


def test_card_without_weights_asks_for_a_checkpoint():
    assert len(VOCODER_CARDS) >= 5
    with pytest.raises(CheckpointError, match="checkpoint="):
        load_vocoder("hifigan-v1")


def test_card_with_checkpoint_loads(tmp_path):
    """A card plus a checkpoint: the card's config decides the sizes (here mismatched: strict error)."""
    with pytest.raises(CheckpointError, match="mis-shaped|missing"):
        load_vocoder("hifigan-v1", checkpoint=FIXTURES / "hifigan_v1_tiny")


def test_numpy_roundtrip_types(voc):
    out = voc(np.zeros((16, 8), dtype=np.float32))
    assert out.shape == (1, 128)


# ------------------------------------------------------------------------------------ stage timing

def test_call_times_its_stages_into_a_given_timer(voc, reference):
    timer = StageTimer()
    mel = _mel(20)
    got = voc(mel, timer=timer)
    assert [r.stage for r in timer.records()] == ["validate", "h2d", "replay", "d2h"]
    with torch.no_grad():
        assert (got - reference(mel)).abs().max() <= 1e-5
    assert got.device.type == "cpu" and voc.report()["compute_ms"] == sum(r.ms for r in timer.records())
    with pytest.raises(InputError):
        voc(_mel(20)[:, :3], timer=timer)
    assert [r.stage for r in timer.records()][4:] == ["validate"]      # refused before any buffer is touched
    parts = list(voc.stream([mel[..., :12], mel[..., 12:]], timer=timer))
    stages = [r.stage for r in timer.records()][5:]
    assert stages[:2] == ["validate", "validate"] and stages.count("replay") == len(parts)
    assert voc.report()["ttfa_ms"] > 0 and voc.report()["windows"] == len(parts)


# ------------------------------------------------------------------- eager: every call at its own length

def test_eager_runs_each_call_at_its_own_length(voc, weights, monkeypatch):
    """The eager backend runs the module on exactly the call's frames and rows with EXACT (no padding, no
    fix-ups, between buckets too); the trace backend (a recorded program) runs the bucket and reads the
    length buffer, to the same values."""
    seen = []
    forward = voc.module.forward
    spy = lambda *x, valid: seen.append((tuple(x[0].shape), valid)) or forward(*x, valid=valid)
    monkeypatch.setattr(voc.module, "forward", spy)
    full, short = voc(_mel(16)), voc(_mel(15))
    assert seen == [((1, 16, 16), EXACT), ((1, 16, 15), EXACT)]
    assert full.shape[-1] == 16 * 16 and short.shape[-1] == 15 * 16
    traced = load_vocoder(weights, family="hifigan", config="tiny", buckets=(16,), backend="trace",
                          stream_chunk=4)
    assert (traced(_mel(16)) - full).abs().max() <= 1e-6     # the same values through the padded path
    assert (traced(_mel(15)) - short).abs().max() <= 1e-6


# ------------------------------------------------------------------------------------- stacked codes

ENC = FIXTURES / "vocos_encodec_tiny"


def test_stacked_codes_equal_separate_codebooks():
    """Vocos-EnCodec: K codebook inputs given as one (B, K, T) tensor (EnCodec's layout) or as K tensors."""
    voc = load_vocoder(ENC, buckets=(32,), batch=2, stream_chunk=4)
    io = load_file(str(ENC.parent / "vocos_encodec_tiny_io.safetensors"))
    stacked = io["codes"].transpose(0, 1).contiguous()          # the file keeps Vocos' (K, B, T)
    want = io["audio_bw1"]
    assert (voc(stacked) - want).abs().max() <= 1e-5
    assert torch.equal(voc(stacked), voc(*stacked.unbind(1)))
    assert torch.equal(voc(stacked.numpy()), voc(stacked))
    parts = list(voc.stream(stacked[..., i:i + 7] for i in range(0, 30, 7)))
    assert (torch.cat(parts, -1) - want).abs().max() <= 1e-5
    for bad in (stacked[:, :1], stacked.float(), stacked + 1024):
        with pytest.raises(InputError):
            voc(bad)
    assert (voc(stacked) - want).abs().max() <= 1e-5


# ----------------------------------------------------------------------------------- exact_stream


def test_exact_stream_one_shot_equals_the_stream_bit_for_bit(one_thread):
    """Mid-size BigVGAN (base layout, 128 channels, random weights): oneDNN's shape-dependent summation
    order made stream vs one-shot differ by 1.3e-5 here (1.6e-5 to 5e-5 at the released size). With
    exact_stream the one-shot runs the stream's windows: equal bit for bit, and within rounding of the
    single-graph one-shot. Also decodes past the largest bucket (windows fit)."""
    from flashrt.testing.synthetic.vocoders import random_module

    fam = get_family("bigvgan")
    cfg = replace(fam.presets["base-24k-100band"], upsample_initial_channel=128)
    module = random_module(fam, cfg, 1, "cpu", torch.float32)
    plain, exact = (Vocoder(fam, cfg, module, buckets=(100,), stream_chunk=16, exact_stream=e).capture()
                    for e in (False, True))
    mel = torch.randn(1, 100, 100, generator=torch.Generator().manual_seed(1))
    one, streamed = exact(mel), torch.cat(list(exact.stream(mel[..., i:i + 8] for i in range(0, 100, 8))), -1)
    assert torch.equal(one, streamed) and exact.report()["windows"] > 1
    assert (one - plain(mel)).abs().max() <= 1e-4
    assert torch.equal(torch.cat(list(plain.stream([mel])), -1), one)       # the same windows either way
    longer = torch.cat([mel, mel[..., :30]], -1)                            # 130 frames > bucket 100
    assert torch.equal(exact(longer), torch.cat(list(exact.stream([longer])), -1))
    with pytest.raises(InputError, match="largest bucket"):
        plain(longer)
