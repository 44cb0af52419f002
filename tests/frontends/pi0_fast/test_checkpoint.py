"""Pi0-FAST checkpoint dirs: what is read, and malformed dirs refused with a CheckpointError naming the
file or field (never a raw Python error, never a later surprise)."""

from __future__ import annotations

import json
import shutil

import pytest
from support.pi0_fast import ROOT, TOKENIZER

from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.pi0_fast import family
from flashrt.frontends.pi0_fast.checkpoint import load_checkpoint

POLICY = ROOT / "cam1" / "policy"


def test_reads_the_fixture():
    ck = load_checkpoint(POLICY, tokenizer=TOKENIZER)
    info = json.loads((ROOT / "cam1" / "io.json").read_text())
    assert ck.cameras == tuple(info["cameras"]) and ck.resolution == info["resolution"]
    assert (ck.state_dim, ck.action_dim) == (info["state_dim"], info["action_dim"])
    assert (ck.chunk_size, ck.n_action_steps) == (info["chunk_size"], info["n_action_steps"])
    assert ck.model_config.max_decoding_steps == info["max_decoding_steps"]
    assert ck.max_prompt_len == info["tokenizer_max_length"] and not ck.check_prefix
    assert ck.fast_path == POLICY / "fast_tokenizer" and ck.temperature == 0.0


def _copy(tmp_path):
    folder = tmp_path / "policy"
    shutil.copytree(POLICY, folder)
    return folder


def _edit(folder, name, **changes):
    path = folder / name
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("changes, match", [
    ({"type": "pi0"}, "not 'pi0_fast'"),
    ({"max_decoding_steps": "many"}, "max_decoding_steps"),
    ({"max_decoding_steps": 10**9}, "max_decoding_steps"),
    ({"temperature": -1}, "temperature"),
    ({"validate_action_token_prefix": "yes"}, "validate_action_token_prefix"),
    ({"n_action_steps": 99}, "n_action_steps"),
    ({"image_resolution": [56, 56]}, "image_resolution"),
    ({"output_features": {}}, "action"),
])
def test_bad_config_fields(tmp_path, changes, match):
    folder = _copy(tmp_path)
    _edit(folder, "config.json", **changes)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(folder, tokenizer=TOKENIZER)


def test_unknown_processor_step_is_refused(tmp_path):
    folder = _copy(tmp_path)
    path = folder / "policy_preprocessor.json"
    data = json.loads(path.read_text())
    data["steps"].append({"registry_name": "mystery_step", "config": {}})
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="mystery_step"):
        load_checkpoint(folder, tokenizer=TOKENIZER)


def test_missing_preprocessor_is_declined(tmp_path):
    folder = _copy(tmp_path)
    (folder / "policy_preprocessor.json").unlink()
    with pytest.raises(CheckpointError, match="policy_preprocessor.json"):
        family.detect(folder)


def test_bad_fast_config(tmp_path):
    folder = _copy(tmp_path)
    _edit(folder / "fast_tokenizer", "processor_config.json", scale=0)
    with pytest.raises(CheckpointError, match="scale"):
        family.load(folder, tokenizer=TOKENIZER)


def test_tokenizer_of_another_vocabulary(tmp_path):
    other = ROOT.parent / "pi0_e2e" / "tokenizer.model"  # 395 pieces, the model embeds 1,024
    with pytest.raises(CheckpointError, match="vocabulary"):
        family.load(POLICY, tokenizer=other)


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_bad_options(value):
    with pytest.raises(ConfigError):
        family.load(POLICY, tokenizer=TOKENIZER, sync_every=value)


def test_relative_actions_add_the_raw_state(tmp_path):
    """lerobot's use_relative_actions: the network's chunk is relative to the raw state; the
    postprocessor adds the state back on the relative dims (here: every dim; names unknown)."""
    import numpy as np
    from support.pi0_fast import observation

    import flashrt

    folder = _copy(tmp_path)
    path = folder / "policy_preprocessor.json"
    data = json.loads(path.read_text())
    for step in data["steps"]:
        if step["registry_name"] == "relative_actions_processor":
            step["config"].update(enabled=True, exclude_joints=[])
    path.write_text(json.dumps(data))
    obs = observation("cam1", 0)
    plain = flashrt.load_policy(POLICY, tokenizer=TOKENIZER).infer(obs)["actions"]
    relative = flashrt.load_policy(folder, tokenizer=TOKENIZER).infer(obs)["actions"]
    action_dim = plain.shape[1]
    np.testing.assert_allclose(relative - plain, np.broadcast_to(obs["state"][:action_dim], plain.shape),
                               atol=1e-5)
