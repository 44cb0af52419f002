"""`flashrt.load_vocoder` on checkpoints as their releases ship them: every committed fixture folder with
no hints (family and config found in the folder; output against the fixture's reference io), model
cards (sizes from the card, weights required), and folders of the wrong family or garbage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import flashrt
from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.vocoders import checkpoint_config, get_family
from flashrt.frontends.vocoders.hifigan import HifiGanConfig
from flashrt.testing.synthetic.vocoders import random_module

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vocoders"
FOLDERS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
TOL = 1e-5

# folder -> (family, the release form it mirrors). Every committed folder must be listed here.
EXPECTED = {
    "bigvgan_tiny_plain": ("bigvgan", "config.json + bigvgan_generator.pt, weight norm removed"),
    "bigvgan_tiny_wn": ("bigvgan", "config.json + bigvgan_generator.pt, weight_g / weight_v"),
    "hifigan_v1_tiny": ("hifigan", "jik876 config.json + {'generator': state_dict} .pt"),
    "hifigan_vits_tiny": ("hifigan", "a bare VITS dec.* state dict: no config ships with it"),
    "snac_24khz_noise_tiny": ("snac", "config.json + pytorch_model.bin, noise blocks"),
    "snac_24khz_tiny": ("snac", "config.json + pytorch_model.bin"),
    "snac_32khz_tiny": ("snac", "config.json + pytorch_model.bin, 4 scales, local attention"),
    "snac_44khz_tiny": ("snac", "config.json + pytorch_model.bin, 4 scales"),
    "speecht5_hifigan_tiny": ("hifigan", "transformers save_pretrained: config.json + model.safetensors"),
    "vocos_encodec_tiny": ("vocos", "config.yaml + pytorch_model.bin, EnCodec codes"),
    "vocos_mel_tiny": ("vocos", "config.yaml + pytorch_model.bin, mel"),
}
NO_CONFIG = {"hifigan_vits_tiny": HifiGanConfig(     # the sizes the generator script used (see its doc)
    in_channels=16, upsample_initial_channel=32, upsample_rates=(4, 2), upsample_kernel_sizes=(8, 4),
    resblock="2", resblock_kernel_sizes=(3, 5), resblock_dilation_sizes=((1, 2), (2, 6)),
    conv_post_bias=False)}


def _reference(name: str) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(inputs, audio (B, N)) of a fixture's io file: mel, SNAC's codes.i, or Vocos-EnCodec's codes
    stacked (B, K, T) as EnCodec gives them (the file stores Vocos' (K, B, T); the highest bandwidth)."""
    io = load_file(str(FIXTURES / f"{name}_io.safetensors"))
    if "mel" in io:
        return (io["mel"],), io["audio"]
    if "audio_bw1" in io:
        return (io["codes"].transpose(0, 1),), io["audio_bw1"]
    return tuple(io[f"codes.{i}"] for i in range(sum(k.startswith("codes.") for k in io))), io["audio"][:, 0]


def _load(path, **kw):
    return flashrt.load_vocoder(path, buckets=(64,), batch=2, **kw)


def test_every_fixture_folder_is_covered():
    assert sorted(EXPECTED) == FOLDERS


@pytest.mark.parametrize("name", [n for n in FOLDERS if n not in NO_CONFIG])
def test_plain_load_detects_family_and_matches_reference(name):
    voc = _load(FIXTURES / name)                                   # no family=, no config=
    assert voc.family.name == EXPECTED[name][0]
    inputs, want = _reference(name)
    if name == "snac_24khz_noise_tiny":   # the reference drew its own noise: feed the module that noise
        io = load_file(str(FIXTURES / f"{name}_io.safetensors"))
        assert voc.config.noise and voc.config.noise_mode == "off"
        z = voc.module.quantizer(inputs)
        got = voc.module.decoder(z, [io[f"noise.{i}"].transpose(1, 2) for i in range(3)])
    else:
        got = voc(*inputs)
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= TOL


@pytest.mark.parametrize("name", [n for n in FOLDERS if n not in NO_CONFIG and "noise" not in n])
def test_spectral_convs_match_reference(name):
    """Every family with every eligible conv forced onto the block-spectral path (`conv="spectral"`)."""
    voc = _load(FIXTURES / name, conv="spectral")
    if EXPECTED[name][0] in ("hifigan", "bigvgan"):                    # SNAC and Vocos have no such convs
        assert "spectral convs" in voc.summary()
    inputs, want = _reference(name)
    got = voc(*inputs)
    assert float((got - want).abs().max()) <= TOL


def test_unknown_conv_policy_is_refused():
    with pytest.raises(ConfigError, match="conv 'fft'"):
        _load(FIXTURES / "hifigan_v1_tiny", conv="fft")


@pytest.mark.parametrize("name", sorted(NO_CONFIG))
def test_weights_without_config_ask_for_one(name):
    """No config ships with the weights: a CheckpointError naming config=, then the family is still found
    from the keys and the given config decodes like the reference."""
    assert checkpoint_config(FIXTURES / name) is None
    with pytest.raises(CheckpointError, match="config="):
        _load(FIXTURES / name)
    voc = _load(FIXTURES / name, config=NO_CONFIG[name])
    inputs, want = _reference(name)
    assert voc.family.name == EXPECTED[name][0]
    assert float((voc(*inputs) - want).abs().max()) <= TOL


def test_vocos_config_yaml_is_read_from_the_folder():
    cfg = checkpoint_config(FIXTURES / "vocos_mel_tiny" / "pytorch_model.bin")   # a file in the folder
    assert cfg["backbone"]["init_args"]["dim"] == 32
    voc = _load(FIXTURES / "vocos_mel_tiny" / "pytorch_model.bin")
    assert voc.family.name == "vocos" and voc.config == get_family("vocos").presets["tiny"]


# -------------------------------------------------------------------------------------------- cards

def test_card_builds_its_family_at_its_sizes(tmp_path):
    """A shipped card (models/hifigan-v1.toml) + a V1-size checkpoint in the release's form: the card's
    family, preset and runtime buckets; the weights are the file's."""
    fam = get_family("hifigan")
    module = random_module(fam, fam.presets["v1"], 0, "cpu", torch.float32)
    torch.save({"generator": module.state_dict()}, tmp_path / "generator.pt")
    voc = flashrt.load_vocoder("hifigan-v1", checkpoint=tmp_path / "generator.pt", capture=False)
    assert voc.family.name == "hifigan" and voc.config == fam.presets["v1"]
    assert {64, 256, 1024} <= set(voc.buckets)
    assert torch.equal(voc.module.conv_pre.weight, module.conv_pre.weight)


def test_card_without_weights_is_refused():
    """Never random or uninitialised weights: a card alone names sizes, not weights."""
    for card in ("hifigan-v1", "vocos-mel-24khz", "snac-24khz", "bigvgan-base-24k-100band"):
        with pytest.raises(CheckpointError, match="checkpoint="):
            flashrt.load_vocoder(card)


def test_card_with_a_weights_path(tmp_path):
    card = tmp_path / "my-vocos.toml"
    card.write_text(f'family = "vocos"\npreset = "tiny"\n[weights]\npath = "{FIXTURES / "vocos_mel_tiny"}"\n'
                    "[runtime]\nbuckets = [64]\n")
    voc = flashrt.load_vocoder(card, batch=2)
    inputs, want = _reference("vocos_mel_tiny")
    assert voc.family.name == "vocos" and float((voc(*inputs) - want).abs().max()) <= TOL


# ------------------------------------------------------------------------------- wrong and garbage

def _folder(tmp_path: Path, files: dict[str, Path | bytes | str]) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name, content in files.items():
        if isinstance(content, Path):
            shutil.copy(content, folder / name)
        else:
            (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return folder


SNAC, VOCOS, HIFI = FIXTURES / "snac_24khz_tiny", FIXTURES / "vocos_mel_tiny", FIXTURES / "hifigan_v1_tiny"
BIN, JSON, YAML = "pytorch_model.bin", "config.json", "config.yaml"
BAD_FOLDERS = {  # case -> (files, what the error says)
    "snac config, vocos weights": ({JSON: SNAC / JSON, BIN: VOCOS / BIN}, "missing"),
    "vocos config, snac weights": ({YAML: VOCOS / YAML, BIN: SNAC / BIN}, "missing"),
    "unknown config": ({JSON: json.dumps({"model_type": "wavenet"}), "generator.pt": HIFI / "generator.pt"},
                       "no known vocoder family"),
    "garbage weights": ({JSON: SNAC / JSON, BIN: b"\x80\x02not a pickle" * 50}, "weights-only"),
    "garbage safetensors": ({YAML: VOCOS / YAML, "model.safetensors": b"\xff" * 64}, "corrupt"),
    "garbage yaml": ({YAML: "backbone: [unclosed\n  - :", BIN: VOCOS / BIN}, "not valid YAML"),
    "json list": ({JSON: "[1, 2]", BIN: SNAC / BIN}, "must be a mapping"),
    "no weights": ({JSON: SNAC / JSON}, "no checkpoint file"),
}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_wrong_family_or_garbage_is_a_checkpoint_error(tmp_path, case):
    files, match = BAD_FOLDERS[case]
    with pytest.raises(CheckpointError, match=match):
        _load(_folder(tmp_path, files))


def test_family_hint_must_agree_with_the_folder():
    with pytest.raises(CheckpointError, match="looks like a vocos checkpoint, not 'snac'"):
        _load(VOCOS, family="snac")
