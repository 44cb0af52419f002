"""Vocoder config files (#28.5, #28.8): a config.json / config.yaml that is there but not a regular file is
refused naming it (never skipped, which loaded the checkpoint without its config); Vocos' config.yaml is
read size-capped; every config field of the wrong type or an absurd size is a ConfigError naming the
field at load (never a TypeError / ZeroDivisionError / negative-dimension error inside the build)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.vocoders import checkpoint_config
from flashrt.frontends.vocoders.vocos import load_config as vocos_config
from flashrt.runner.vocoder import load_vocoder
from flashrt.testing.hostile import bounded_call, make_hostile

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vocoders"


def _copy(tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


@pytest.mark.parametrize("name, file", [("hifigan_v1_tiny", "config.json"),
                                        ("vocos_mel_tiny", "config.yaml")])
@pytest.mark.parametrize("kind, word", [("fifo", "FIFO"), ("dev-zero", "character device"),
                                        ("directory", "directory")])
def test_a_config_that_is_not_a_regular_file_is_refused_not_skipped(tmp_path, name, file, kind, word):
    folder = _copy(tmp_path, name)
    (folder / file).unlink()
    path = make_hostile(folder / file, kind)
    exc = bounded_call(lambda: checkpoint_config(folder), timeout_s=20.0, fifos=[path])
    assert isinstance(exc, CheckpointError) and str(path) in str(exc) and word in str(exc), repr(exc)


def test_vocos_config_yaml_is_size_capped_and_parsed_safely(tmp_path, monkeypatch):
    folder = _copy(tmp_path, "vocos_mel_tiny")
    assert vocos_config(folder).dim > 0
    (folder / "config.yaml").write_text("head: [unclosed\n")
    with pytest.raises(CheckpointError, match="config.yaml.*not valid YAML"):
        vocos_config(folder)
    monkeypatch.setattr("flashrt.io.files.read_yaml.__defaults__", (CheckpointError, 8, dict))
    with pytest.raises(CheckpointError, match="more than the 8"):
        vocos_config(folder)


def _edit(folder: Path, file: str, change) -> None:
    path = folder / file
    load, dump = (json.loads, json.dumps) if file.endswith(".json") else (yaml.safe_load, yaml.safe_dump)
    cfg = load(path.read_text())
    change(cfg)
    path.write_text(dump(cfg))


FIELD_CASES = {
    "hifigan num_mels a string": ("hifigan_v1_tiny", "config.json", lambda c: c.update(num_mels="16"),
                                  "in_channels"),
    "hifigan rates a string": ("hifigan_v1_tiny", "config.json", lambda c: c.update(upsample_rates="44"),
                               "upsample_rates"),
    "hifigan channels a float": ("hifigan_v1_tiny", "config.json",
                                 lambda c: c.update(upsample_initial_channel=32.5),
                                 "upsample_initial_channel"),
    "hifigan rate a string": ("hifigan_v1_tiny", "config.json", lambda c: c.update(sampling_rate="x"),
                              "sample_rate"),
    "hifigan dilation a string": ("hifigan_v1_tiny", "config.json",
                                  lambda c: c.update(resblock_dilation_sizes=[[1, "a"], [1, 3]]),
                                  "resblock_dilation_sizes"),
    "bigvgan negative mels": ("bigvgan_tiny_plain", "config.json", lambda c: c.update(num_mels=-1),
                              "num_mels"),
    "bigvgan rate null": ("bigvgan_tiny_plain", "config.json", lambda c: c.update(sampling_rate=None),
                          "sample_rate"),
    "snac dim a string": ("snac_24khz_tiny", "config.json", lambda c: c.update(decoder_dim="32"),
                          "decoder_dim"),
    "snac zero stride": ("snac_24khz_tiny", "config.json", lambda c: c.update(vq_strides=[0]), "vq_strides"),
    "snac noise a string": ("snac_24khz_tiny", "config.json", lambda c: c.update(noise="yes"), "noise"),
    "snac codebook a float": ("snac_24khz_tiny", "config.json", lambda c: c.update(codebook_size=2.5),
                              "codebook_size"),
    "snac absurd rate": ("snac_24khz_tiny", "config.json", lambda c: c.update(decoder_rates=[1 << 30]),
                         "decoder_rates"),
    "vocos dim a string": ("vocos_mel_tiny", "config.yaml",
                           lambda c: c["backbone"]["init_args"].update(dim="32"), "dim"),
    "vocos negative n_fft": ("vocos_mel_tiny", "config.yaml",
                             lambda c: c["head"]["init_args"].update(n_fft=-4), "n_fft"),
}


@pytest.mark.parametrize("name, file, change, field", FIELD_CASES.values(), ids=list(FIELD_CASES))
def test_each_bad_config_field_is_named_at_load(tmp_path, name, file, change, field):
    folder = _copy(tmp_path, name)
    _edit(folder, file, change)
    with pytest.raises(ConfigError, match=f": {field}: expected "):
        load_vocoder(folder, buckets=(8,))
