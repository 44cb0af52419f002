"""GR00T N1.5 end to end vs lerobot 0.5.1 (fixtures from tests/fixtures/gen/gen_groot_n15.py): the
lerobot policy folder through flashrt.load_policy, raw observation in, un-normalized actions out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support.groot import make_policy

import flashrt
from flashrt.errors import CheckpointError, ConfigError, InputError
from flashrt.frontends.groot import family

FIX = Path(__file__).resolve().parents[3] / "fixtures" / "groot"
IO = load_file(str(FIX / "n15_e2e.safetensors"))
META = json.loads((FIX / "n15_e2e.json").read_text())
CASES = tuple(META)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, one_thread):
    return make_policy(tmp_path_factory.mktemp("n15"))


@pytest.fixture(scope="module")
def policy(folder):
    return flashrt.load_policy(folder)


def obs(case: str, as_float: bool = True) -> dict:
    """The case's raw observation as lerobot got it (float frames = uint8 / 255, CHW)."""
    out = {
        f"observation.images.{c}": IO[f"{case}/frame_{c}"].permute(2, 0, 1).float() / 255.0
        if as_float
        else IO[f"{case}/frame_{c}"].numpy()
        for c in META[case]["cameras"]
    }
    out["observation.state"] = IO[f"{case}/raw_state"].numpy()
    out["task"] = META[case]["task"]
    return out


def _policy_for(folder: Path, case: str, cache: dict):
    tag = META[case]["embodiment"]
    if tag not in cache:
        cache[tag] = flashrt.load_policy(folder, embodiment=tag)
    return cache[tag]


_CACHE: dict = {}


@pytest.mark.parametrize("case", CASES)
def test_preprocessing_matches_lerobot_051(folder, case):
    """Token ids, pixels and the normalized padded state exact; the embodiment id."""
    p = _policy_for(folder, case, _CACHE)
    fe = p.frontend
    bucket, checked = fe.check(obs(case))
    assert checked.tokens == IO[f"{case}/eagle_input_ids"].tolist()
    assert torch.equal(checked.pixels, IO[f"{case}/eagle_pixel_values"])
    assert np.array_equal(checked.state, IO[f"{case}/state"].numpy())
    assert fe.embodiment.id == int(IO[f"{case}/embodiment_id"][0])
    assert bucket >= len(checked.tokens)


@pytest.mark.parametrize("case", CASES)
def test_actions_match_lerobot_051(folder, case):
    p = _policy_for(folder, case, _CACHE)
    actions = p.infer(obs(case), noise=IO[f"{case}/noise"].numpy())["actions"]
    ref = IO[f"{case}/actions"].numpy()
    assert actions.shape == ref.shape == (8, 5)
    assert np.abs(actions - ref).max() <= 1e-5
    norm = p.frontend.buffers["expert_actions"][0]
    assert (norm - IO[f"{case}/action_pred"]).abs().max().item() <= 1e-5


def test_trace_equals_eager_bit_for_bit(folder, policy):
    eager = flashrt.load_policy(folder, backend="eager")
    noise = IO["so100/noise"].numpy()
    got = [p.infer(obs("so100"), noise=noise)["actions"] for p in (policy, eager)]
    assert np.array_equal(*got)
    assert policy.frontend.describe()["version"] == "n1.5"


def test_step_queue_and_reset(policy):
    """step() executes n_action_steps (6) actions of each chunk, then infers again; reset() drops the rest."""
    o = obs("so100")
    chunk = policy.infer(o, seed=3)["actions"]
    first = [policy.step(o, seed=3) for _ in range(6)]
    assert np.array_equal(np.stack(first), chunk[:6])
    policy.reset()
    assert np.array_equal(policy.step(o, seed=3), chunk[0])


def test_bad_inputs_then_good_call_is_unchanged(folder, policy):
    o, noise = obs("so100"), IO["so100/noise"].numpy()
    fresh = flashrt.load_policy(folder).infer(o, noise=noise)["actions"]
    bad = [
        {k: v for k, v in o.items() if k != "observation.images.wrist"},
        {**o, "observation.state": np.zeros(4, np.float32)},
        {**o, "observation.state": np.full(6, np.nan, np.float32)},
        {**o, "observation.images.front": np.zeros((5, 5), np.uint8)},
        {**o, "task": 3},
        {**o, "task": "put <IMG_CONTEXT> here"},
        {**o, "task": "see <image-1>"},
        {**o, "task": "word " * 200},
    ]
    for b in bad:
        with pytest.raises(InputError):
            policy.infer(b, noise=noise)
    with pytest.raises(InputError):
        policy.infer(o, noise=np.zeros((3, 3), np.float32))
    assert np.array_equal(policy.infer(o, noise=noise)["actions"], fresh)


def test_uint8_frames_and_prompt_key(policy):
    """uint8 HxWx3 frames are taken as they are (no float truncation); "prompt" is read like "task"."""
    fe = policy.frontend
    o = obs("unitree_g1", as_float=False)
    _, checked = fe.check({**{k: v for k, v in o.items() if k != "task"}, "prompt": o["task"]})
    _, ref = fe.check(obs("unitree_g1"))
    assert checked.tokens == ref.tokens
    assert checked.pixels.shape == ref.pixels.shape


def test_detect_and_refusals(folder, tmp_path):
    family.detect(folder)
    with pytest.raises(CheckpointError, match="bare GR00T N1.5"):
        flashrt.load_policy(FIX / "n15_tiny")
    with pytest.raises(ConfigError, match="so100"):
        flashrt.load_policy(folder, embodiment="robot_x")
    with pytest.raises(ConfigError, match="cameras"):
        flashrt.load_policy(folder, cameras=("top",))
    assert flashrt.load_policy(folder, embodiment=1).frontend.embodiment.id == 1
    broken = make_policy(tmp_path)
    (broken / "policy_preprocessor.json").unlink()
    with pytest.raises(CheckpointError, match="policy_preprocessor"):
        flashrt.load_policy(broken)


def test_eagle_folder_from_option_or_lerobot_cache(tmp_path, monkeypatch):
    """Without <base>/backbone the Eagle processor folder comes from tokenizer= or lerobot's cache."""
    policy = make_policy(tmp_path)
    assets = tmp_path / "eagle"
    shutil.move(str(tmp_path / "n15_tiny" / "backbone"), assets)
    monkeypatch.setenv("HF_LEROBOT_HOME", str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="tokenizer=PATH"):
        flashrt.load_policy(policy)
    o, noise = obs("so100"), IO["so100/noise"].numpy()
    ref = IO["so100/actions"].numpy()
    got = flashrt.load_policy(policy, tokenizer=assets / "vocab.json").infer(o, noise=noise)["actions"]
    assert np.abs(got - ref).max() <= 1e-5
    cache = tmp_path / "home" / "lerobot" / "eagle2hg-processor-groot-n1p5"
    shutil.copytree(assets, cache)
    monkeypatch.setenv("HF_LEROBOT_HOME", str(tmp_path / "home"))
    assert np.array_equal(flashrt.load_policy(policy).infer(o, noise=noise)["actions"], got)


def test_camera_subset(folder):
    """cameras= picks a subset of the policy's cameras (fed in lerobot's sorted order)."""
    p = flashrt.load_policy(folder, cameras=("front",))
    assert p.frontend.cameras == ("front",) and p.frontend.describe()["cameras"] == ["front"]
    o = {k: v for k, v in obs("so100").items() if k != "observation.images.wrist"}
    _, checked = p.frontend.check(o)
    assert checked.pixels.shape == (1, 3, 28, 28)
    assert checked.tokens.count(500) == 4
    out = p.infer(o, seed=0)["actions"]
    assert out.shape == (8, 5) and np.isfinite(out).all()
