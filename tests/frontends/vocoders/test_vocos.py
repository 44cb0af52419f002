"""Vocos frontend: parity with the `vocos` package (fixtures from tests/fixtures/gen/gen_vocoders_b.py),
streaming == one-shot, receptive field, config.yaml parsing, strict loading, bad input."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashrt.errors import CheckpointError, ConfigError, InputError
from flashrt.frontends.vocoders import config_for, get_family, read_card
from flashrt.frontends.vocoders.vocos import PRESETS, Vocos, VocosConfig, load_config, signature, weight_map
from flashrt.io import load_module, open_checkpoint
from flashrt.runner.vocoder import load_vocoder

pytestmark = pytest.mark.usefixtures("one_thread")

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vocoders"
MEL, ENC = FIXTURES / "vocos_mel_tiny", FIXTURES / "vocos_encodec_tiny"
TOL = 1e-5


def _io(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path.parent / f"{path.name}_io.safetensors"))


@pytest.fixture(scope="module")
def mel_voc():
    return load_vocoder(MEL, config=load_config(MEL), buckets=(16, 64), batch=2, stream_chunk=5)


@pytest.fixture(scope="module")
def enc_voc():
    return load_vocoder(ENC, config=load_config(ENC), buckets=(16, 64), batch=2, stream_chunk=4)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


# ------------------------------------------------------------------------------------------ parity

def test_mel_parity_with_reference(mel_voc):
    io = _io(MEL)
    assert _max_diff(mel_voc(io["mel"]), io["audio"]) <= TOL
    assert _max_diff(mel_voc(io["mel_short"]), io["audio_short"]) <= TOL   # a bucket with padding
    assert float(io["audio"].abs().max()) > 1.0                             # the check means something


def test_encodec_codes_parity_with_reference(enc_voc):
    io = _io(ENC)
    codes = list(io["codes"].unbind(0))  # Vocos' (K, B, T) -> K tensors (B, T)
    assert enc_voc.signature.inputs[0].name == "codes.0" and len(enc_voc.signature.inputs) == 2
    assert _max_diff(enc_voc(codes), io["audio_bw1"]) <= TOL


@pytest.mark.parametrize("bandwidth_id", [0, 1])
def test_encodec_features_parity_per_bandwidth(bandwidth_id):
    cfg = dataclasses.replace(load_config(ENC), input="features", bandwidth_id=bandwidth_id)
    voc = load_vocoder(ENC, config=cfg, buckets=(32,), batch=2)
    io = _io(ENC)
    assert _max_diff(voc(io["features"]), io[f"audio_bw{bandwidth_id}"]) <= TOL
    other = io[f"audio_bw{1 - bandwidth_id}"]
    assert _max_diff(io[f"audio_bw{bandwidth_id}"], other) > 1e-2  # the AdaLayerNorm id matters


def test_codes_to_features_uses_the_checkpoint_codebooks():
    cfg = load_config(ENC)
    ckpt = open_checkpoint(ENC)
    module = load_module(lambda: Vocos(cfg), ckpt, weight_map(cfg, ckpt))
    io = _io(ENC)
    feats = module.codes_to_features(list(io["codes"].unbind(0))).transpose(1, 2)
    assert _max_diff(feats, io["features"]) <= 1e-6
    feats1 = module.codes_to_features(list(io["codes_k1"].unbind(0))).transpose(1, 2)
    assert _max_diff(feats1, io["features_k1"]) <= 1e-6


def test_trace_backend_equals_reference():
    voc = load_vocoder(MEL, config=load_config(MEL), buckets=(64,), batch=2, backend="trace")
    io = _io(MEL)
    assert _max_diff(voc(io["mel"]), io["audio"]) <= TOL


# --------------------------------------------------------------------------------------- streaming

def _chunks(x: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [x[..., i:i + size] for i in range(0, x.shape[-1], size)]


@pytest.mark.parametrize("chunk", [1, 4, 5, 7, 50])
def test_mel_stream_equals_one_shot(mel_voc, chunk):
    mel = torch.randn(2, 20, 50, generator=torch.Generator().manual_seed(chunk)) - 2
    one = mel_voc(mel)
    parts = list(mel_voc.stream(_chunks(mel, chunk)))
    assert len(parts) >= 5  # stream_chunk 5: many windows, each with real left/right context
    assert _max_diff(torch.cat(parts, -1), one) <= TOL
    assert mel_voc.report()["mode"] == "stream" and mel_voc.report()["ttfa_ms"] > 0


@pytest.mark.parametrize("chunk", [3, 8])
def test_encodec_stream_equals_one_shot(enc_voc, chunk):
    codes = [torch.randint(0, 1024, (1, 41), generator=torch.Generator().manual_seed(k)) for k in range(2)]
    one = enc_voc(codes)
    pieces = [tuple(c[..., i:i + chunk] for c in codes) for i in range(0, 41, chunk)]
    assert _max_diff(torch.cat(list(enc_voc.stream(pieces)), -1), one) <= TOL


def test_declared_context_is_needed():
    """With one frame less of right context the stream no longer equals one-shot (the test can fail)."""
    cfg = load_config(MEL)
    ckpt = open_checkpoint(MEL)
    module = load_module(lambda: Vocos(cfg), ckpt, weight_map(cfg, ckpt))
    left, right = signature(cfg).context
    mel = torch.randn(1, 20, 40, generator=torch.Generator().manual_seed(3))
    full = module(mel)
    hop = cfg.hop_length
    # frames [20, 25): decode [20 - left, 25 + r) and keep the samples of frames 20..24
    for r, exact in ((right, True), (right - 3, False)):
        piece = module(mel[..., 20 - left:25 + r])[:, left * hop:(left + 5) * hop]
        assert (_max_diff(piece, full[:, 20 * hop:25 * hop]) <= TOL) == exact


def test_receptive_field_covers_measured_influence():
    cfg = load_config(MEL)
    ckpt = open_checkpoint(MEL)
    module = load_module(lambda: Vocos(cfg), ckpt, weight_map(cfg, ckpt))
    mel = torch.randn(1, 20, 60, generator=torch.Generator().manual_seed(4))
    base, k = module(mel), 30
    bumped = mel.clone()
    bumped[..., k] += 1.0
    moved = ((module(bumped) - base).abs()[0] > 1e-6).nonzero().flatten()
    first, last = int(moved.min()) // cfg.hop_length, int(moved.max()) // cfg.hop_length
    left, right = signature(cfg).context
    assert k - first <= right and last - k <= left          # frames whose audio moved lie within reach
    assert k - first >= right - 3 and last - k >= left - 3   # and the declared reach is not loose


# ------------------------------------------------------------------------------- config and loading

def test_config_yaml_parsing():
    cfg = load_config(MEL)
    assert (cfg.variant, cfg.input_channels, cfg.n_fft, cfg.hop_length) == ("mel", 20, 256, 64)
    assert cfg.padding == "center"
    enc = load_config(ENC / "config.yaml")
    assert (enc.variant, enc.bandwidths, enc.n_codebooks, enc.padding) == ("encodec", (0.75, 1.5), 2, "same")
    assert dataclasses.replace(enc, bandwidth_id=0).n_codebooks == 1
    with pytest.raises(ConfigError):
        VocosConfig.from_dict({"backbone": {}})
    with pytest.raises(CheckpointError, match="config.yaml"):
        load_config(FIXTURES / "snac_24khz_tiny")


def test_presets_have_the_released_shapes():
    mel, enc = PRESETS["mel-24khz"], PRESETS["encodec-24khz"]
    assert (mel.dim, mel.intermediate_dim, mel.num_layers, mel.n_fft, mel.hop_length, mel.input_channels) == \
        (512, 1536, 8, 1024, 256, 100)
    assert (enc.dim, enc.n_codebooks, enc.table_codebooks, enc.hop_length) == (384, 16, 16, 320)
    assert signature(mel).trim_samples == 256 and signature(enc).trim_samples == 0
    with pytest.raises(ConfigError):
        dataclasses.replace(enc, bandwidth_id=7)


def test_safetensors_checkpoint_loads_the_same(tmp_path):
    sd = torch.load(MEL / "pytorch_model.bin", weights_only=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    shutil.copy(MEL / "config.yaml", tmp_path / "config.yaml")
    voc = load_vocoder(tmp_path, config=load_config(tmp_path), buckets=(64,), batch=2)
    io = _io(MEL)
    assert _max_diff(voc(io["mel"]), io["audio"]) <= TOL


def test_wrong_family_and_wrong_shapes_are_checkpoint_errors():
    with pytest.raises(CheckpointError):
        load_vocoder(FIXTURES / "snac_24khz_tiny", family="vocos", config="tiny")
    wrong = dataclasses.replace(load_config(MEL), dim=48)
    with pytest.raises(CheckpointError, match="mis-shaped"):
        load_vocoder(MEL, config=wrong, family="vocos")


def test_unsafe_pickle_is_refused(tmp_path):
    (tmp_path / "config.yaml").write_text((MEL / "config.yaml").read_text())
    torch.save({"x": torch.zeros(1), "obj": argparse.Namespace(a=1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError):
        load_vocoder(tmp_path, config=load_config(tmp_path), family="vocos")


# -------------------------------------------------------------------------------------- bad input

def test_bad_inputs_raise_and_next_call_is_correct(mel_voc, enc_voc):
    io = _io(MEL)
    bad = [torch.randn(1, 21, 10), torch.full((1, 20, 10), float("nan")),
           torch.full((1, 20, 10), float("inf")), torch.zeros(1, 20, 0), torch.zeros(1, 20, 65),
           torch.zeros(3, 20, 10)]
    for x in bad:
        with pytest.raises(InputError):
            mel_voc(x)
    assert _max_diff(mel_voc(io["mel"]), io["audio"]) <= TOL
    eio = _io(ENC)
    codes = list(eio["codes"].unbind(0))
    for c in ([codes[0], codes[1] + 1024], [codes[0], -codes[1] - 1], [codes[0]], [codes[0], codes[1][:, :5]],
              [codes[0].float(), codes[1]]):
        with pytest.raises(InputError):
            enc_voc(c)
    assert _max_diff(enc_voc(codes), eio["audio_bw1"]) <= TOL


# ----------------------------------------------------------------------------------- precision, cards

def test_bf16_precision_stays_close_to_the_fp32_reference():
    voc = load_vocoder(MEL, config=load_config(MEL), precision="bf16", buckets=(64,), batch=2)
    io = _io(MEL)
    out = voc(io["mel"])
    assert out.dtype == torch.float32
    assert float((out - io["audio"]).norm() / io["audio"].norm()) < 0.05  # measured 0.011


@pytest.mark.parametrize("card", ["vocos-mel-24khz", "vocos-encodec-24khz"])
def test_model_cards_resolve_to_released_sizes(card):
    c = read_card(card)
    cfg = config_for(get_family(c["family"]), c["preset"], c.get("config"))
    assert cfg == dataclasses.replace(PRESETS[c["preset"]], **c.get("config", {}))
    with pytest.raises(CheckpointError, match="mis-shaped"):  # the tiny fixture is not these sizes
        load_vocoder(card, checkpoint=MEL if cfg.variant == "mel" else ENC)
