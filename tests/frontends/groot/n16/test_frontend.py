"""GR00T N1.6 (Isaac-GR00T layout) vs Isaac-GR00T's own N1.6 code (tests/fixtures/gen/gen_groot_n16.py):
the Eagle 3 VL backbone features (``EagleBackbone.forward``) and the actions (``Gr00tN1d6.get_action``)
from the processor's own tensors; then end to end through `flashrt.load_policy` (raw observation ->
the processor's token ids, pixels and state, the decoded actions); trace replay == eager bit for bit;
bad inputs; the checkpoint folder's config reading and its refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support.groot import assert_trace_replays_eager, fixture_obs, infer

import flashrt
from flashrt.errors import CheckpointError, InputError
from flashrt.frontends.groot import family
from flashrt.frontends.groot.n16 import frontend as n16_frontend
from flashrt.frontends.groot.n16 import model as n16
from flashrt.io import open_checkpoint

FIX = Path(__file__).resolve().parents[3] / "fixtures" / "groot"
CK = FIX / "n16_tiny"
IO = load_file(str(FIX / "n16_io.safetensors"))
META = json.loads((FIX / "n16_io.json").read_text())
CASES = ("one_cam", "two_cams")
TOL = 1e-5


@pytest.fixture(scope="module")
def model(one_thread):
    config, _ = n16.n16_config(CK, json.loads((CK / "config.json").read_text()))
    with open_checkpoint(CK / "model.safetensors") as weights:
        return n16.load_n16(config, weights)


def _run(model, case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(features (L, W), normalized actions (T, A)) from the processor's input_ids / pixel_values."""
    ids, px = IO[f"{case}/input_ids"][None], IO[f"{case}/pixel_values"]
    plan = model.plan(ids.shape[1], tuple(px.shape[-2:]), int(IO[f"{case}/embodiment_id"][0]))
    out = torch.zeros(1, *IO[f"{case}/noise"].shape)
    with torch.inference_mode():
        features = model.features(px, ids, plan)
        mask = torch.ones_like(ids, dtype=torch.bool)
        state, noise = IO[f"{case}/state_norm"][None], IO[f"{case}/noise"][None]
        model.sample_actions(px, ids, mask, state, noise, out, plan)
    return features[0], out[0]


@pytest.mark.parametrize("case", CASES)
def test_backbone_and_actions_match_isaac_gr00t(model, case):
    features, actions = _run(model, case)
    assert (features - IO[f"{case}/backbone_features"]).abs().max().item() <= TOL
    assert (actions - IO[f"{case}/actions_norm"]).abs().max().item() <= TOL


# --------------------------------------------------------------------------------- end to end
def _load(case: str, **kw):
    return family.load(CK, embodiment=META[case]["embodiment"], **kw)


def _obs(case: str) -> dict:
    return fixture_obs(IO, META, case)


@pytest.fixture(scope="module")
def fronts(one_thread):
    return {case: _load(case) for case in CASES}


def test_tokenizer_matches_transformers_qwen2():
    """vocab.json + merges.txt + tokenizer_config.json (no tokenizer.json, as Eagle-Block2A-2B-v2 ships)."""
    tok = n16_frontend.eagle_tokenizer(CK / "backbone")
    for i, text in enumerate(META["tok"]):
        assert tok.encode(text, add_special_tokens=False).ids == IO[f"tok/{i}"].tolist(), text


@pytest.mark.parametrize("case", CASES)
def test_end_to_end_matches_isaac_gr00t(fronts, case):
    """A letter-boxed 96x128 camera (second embodiment: 7-dim state with a constant dimension, 9-dim
    action); two cameras of different non-square sizes; punctuation and capitals in the prompt."""
    f = fronts[case]
    bucket, checked = f.check(_obs(case), IO[f"{case}/noise"])
    assert checked.tokens == IO[f"{case}/input_ids"].tolist()
    assert torch.equal(checked.pixels, IO[f"{case}/pixel_values"])
    np.testing.assert_array_equal(checked.state[None], IO[f"{case}/state_norm"].numpy())
    f.write(bucket, checked)
    f.replay(bucket)
    assert (f.buffers["expert_actions"][0] - IO[f"{case}/actions_norm"]).abs().max().item() <= TOL
    actions = f.read(checked)
    assert actions.shape == tuple(IO[f"{case}/actions"].shape) and actions.dtype == np.float32
    assert np.abs(actions - IO[f"{case}/actions"].numpy()).max() <= TOL


def test_load_policy_infer_step_reset(one_thread):
    case = "two_cams"
    policy = flashrt.load_policy(CK, embodiment=META[case]["embodiment"])
    info = policy.info()
    assert info["family"] == "groot" and info["version"] == "n1.6" and info["cameras"] == ["front", "wrist"]
    obs = _obs(case)
    out = policy.infer(obs, noise=IO[f"{case}/noise"].numpy())
    assert np.abs(out["actions"] - IO[f"{case}/actions"].numpy()).max() <= TOL
    chunk = policy.infer(obs, seed=5)["actions"]
    policy.reset()
    steps = [policy.step(obs, seed=5) for _ in range(policy.n_action_steps)]
    assert np.array_equal(np.stack(steps), chunk[: policy.n_action_steps])


def test_trace_replay_equals_eager_bit_for_bit(one_thread):
    """The trace backend records the whole step (SigLIP2, unshuffle, mlp1, Qwen3 layers, every flow
    step; the image slots found from the token ids on the device) and replays it bit for bit, in two
    buckets whose image tokens sit at different positions."""
    trace, eager = _load("two_cams", backend="trace"), _load("two_cams")
    assert_trace_replays_eager(trace, eager, _obs("two_cams"))


BAD = {
    "missing camera": lambda o: {**o, "images": {"front": o["images"]["front"]}},
    "image shape": lambda o: {**o, "images": {**o["images"], "wrist": np.zeros((4, 4), np.uint8)}},
    "image nan": lambda o: {**o, "images": {**o["images"], "wrist": np.full((8, 8, 3), np.nan, np.float32)}},
    "state size": lambda o: {**o, "state": np.zeros(3, np.float32)},
    "state nan": lambda o: {**o, "state": np.full(6, np.nan, np.float32)},
    "prompt type": lambda o: {**o, "prompt": 3},
    "prompt too long": lambda o: {**o, "prompt": "stack the blocks " * 40},
    "chat token in prompt": lambda o: {**o, "prompt": "hi <IMG_CONTEXT>"},
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_then_next_call_equals_fresh(fronts, name):
    f, obs = fronts["two_cams"], _obs("two_cams")
    if name == "chat token in prompt":  # formalize_language strips '<' and '>': turn it off
        f = _load("two_cams")
        f.options = type(f.options)(formalize_language=False)
    with pytest.raises(InputError):
        f.check(BAD[name](obs))
    fresh = _load("two_cams")
    fresh.options = f.options
    assert np.array_equal(infer(f, obs, seed=7), infer(fresh, obs, seed=7))


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "n16"
    shutil.copytree(CK, folder)
    return folder


@pytest.mark.parametrize("flag", ["use_windows_attn", "use_rope"])
def test_refuses_windowed_or_rope_siglip2(tmp_path, flag):
    folder = _copy(tmp_path)
    bb = json.loads((folder / "backbone" / "config.json").read_text())
    bb["vision_config"][flag] = True
    (folder / "backbone" / "config.json").write_text(json.dumps(bb))
    with pytest.raises(CheckpointError, match=flag):
        n16.n16_config(folder, json.loads((folder / "config.json").read_text()))


def test_published_backbone_name_reads_the_builtin_config():
    g = {**json.loads((CK / "config.json").read_text()), "model_name": n16.EAGLE3_NAME, "select_layer": 16}
    g["backbone_embedding_dim"] = 2048
    config, bb_dir = n16.n16_config(CK, g)
    assert bb_dir is None
    assert (config.eagle.text_width, config.eagle.layers, config.eagle.image_token) == (2048, 16, 151669)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda kw: kw.update(use_albumentations=False), "use_albumentations"),
        (lambda kw: kw["modality_configs"]["tag_a"]["video"].update(delta_indices=[-1, 0]), "video frames"),
    ],
)
def test_refuses_unsupported_processor_configs(tmp_path, edit, match):
    folder = _copy(tmp_path)
    cfg = json.loads((folder / "processor_config.json").read_text())
    edit(cfg["processor_kwargs"])
    (folder / "processor_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        family.load(folder, embodiment="tag_a")


def test_detected_as_groot_and_unknown_embodiment_names_the_choices():
    from flashrt.errors import ConfigError

    assert family.detect(CK) is None
    with pytest.raises(ConfigError, match="tag_a"):
        family.load(CK, embodiment="nope")
