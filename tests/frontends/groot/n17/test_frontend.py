"""GR00T N1.7 end to end vs lerobot 0.6.1 (fixtures from tests/fixtures/gen/gen_groot_n17.py): raw
observations in, un-normalized actions out; trace replay == eager bit for bit; bad inputs; detection."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support.groot import assert_trace_replays_eager, fixture_obs, infer

from flashrt.errors import CheckpointError, ConfigError, InputError
from flashrt.frontends.groot import family
from flashrt.frontends.registry import policy_families
from flashrt.runtime.frontend import PolicyFrontend

FIX = Path(__file__).resolve().parents[3] / "fixtures" / "groot"
CKPT = FIX / "n17_tiny"
IO = load_file(str(FIX / "n17_io.safetensors"))
META = json.loads((FIX / "n17_io.json").read_text())
TOL = 1e-4


def _load(case: str, **kw):
    m = META[case]
    return family.load(CKPT, embodiment=m["embodiment"], cameras=m["cameras"], **kw)


def _obs(case: str) -> dict:
    return fixture_obs(IO, META, case)


@pytest.fixture(scope="module")
def fronts(one_thread):
    return {case: _load(case) for case in META}


@pytest.mark.parametrize("case", list(META))
def test_end_to_end_matches_lerobot(fronts, case):
    """1 camera; 2 non-square cameras; a second embodiment (other state/action sizes and id); relative
    actions (an end-effector pose and joints made absolute against the state, per-step statistics); a
    video horizon of 2 (every camera fed twice)."""
    f = fronts[case]
    bucket, checked = f.check(_obs(case), IO[f"{case}/noise"])
    assert checked.tokens == IO[f"{case}/input_ids"].tolist()
    np.testing.assert_array_equal(checked.state, IO[f"{case}/state_norm"].numpy())
    f.write(bucket, checked)
    f.replay(bucket)
    norm = f.buffers["expert_actions"][0]
    assert (norm - IO[f"{case}/actions_norm"]).abs().max().item() <= TOL
    actions = f.read(checked)
    assert actions.shape == (f.chunk_size, IO[f"{case}/actions"].shape[1]) and actions.dtype == np.float32
    assert np.abs(actions - IO[f"{case}/actions"].numpy()).max() <= TOL


def test_the_loader_selects_the_kernel_row(fronts):
    """"auto" on the CPU is the ATen references; "fused" runs the text layers' norms, RoPE and SwiGLU on
    the ``flashrt::`` ops (their references on the CPU): the same actions, bit for bit."""
    case = next(iter(META))
    fused = _load(case, kernels="fused")
    assert fronts[case].describe()["kernels"] == "aten" and fused.describe()["kernels"] == "fused"
    chosen = fused.describe()["ops"]  # the one select pass: every text-layer op on its fused form
    assert all(set(chosen[n]) == {"fused"} for n in ("rms_norm", "add_rms_norm", "rope_qkv", "silu_mul"))
    obs = _obs(case)
    assert np.array_equal(infer(fused, obs, seed=3), infer(fronts[case], obs, seed=3))
    with pytest.raises(ConfigError, match="kernels="):
        _load(case, kernels="triton")


def test_pixels_match_qwen3vl_processor(fronts):
    """Our resize/crop/normalize, laid out as Qwen's flattened (C, 2, P, P) patches in merge order."""
    case = "two_cams"
    _, checked = fronts[case].check(_obs(case))
    px = checked.pixels  # (I, 3, R, Q)
    i, _, r, q = px.shape
    x = px[:, None].expand(i, 2, 3, r, q).reshape(i, 2, 3, r // 32, 2, 16, q // 32, 2, 16)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(-1, 3 * 2 * 16 * 16)
    assert (x - IO[f"{case}/pixel_values"]).abs().max().item() <= 1e-6


def test_frontend_protocol_and_describe(fronts):
    f = fronts["two_cams"]
    assert isinstance(f, PolicyFrontend)
    d = f.describe()
    assert d["embodiment"] == "tag_a" and d["cameras"] == ["front", "wrist"] and d["action_dim"] == 6
    assert f.report()["captured"] == list(f.buckets)


@pytest.mark.parametrize("case", ["two_cams", "two_frames"])
def test_trace_replay_equals_eager_bit_for_bit(one_thread, case):
    """The trace backend records the whole step (vision, Qwen3 layers, VL self-attention, every flow
    step) refusing host syncs and data-dependent shapes, and replays it bit for bit, in two buckets."""
    trace = _load(case, backend="trace")
    eager = _load(case)
    assert_trace_replays_eager(trace, eager, _obs(case))


BAD = {
    "missing camera": lambda o: {**o, "images": {"front": o["images"]["front"]}},
    "image shape": lambda o: {**o, "images": {**o["images"], "wrist": np.zeros((4, 4), np.uint8)}},
    "image nan": lambda o: {**o, "images": {**o["images"], "wrist": np.full((8, 8, 3), np.nan, np.float32)}},
    "state size": lambda o: {**o, "state": np.zeros(3, np.float32)},
    "state nan": lambda o: {**o, "state": np.full(7, np.nan, np.float32)},
    "state missing": lambda o: {k: v for k, v in o.items() if k != "state"},
    "prompt type": lambda o: {**o, "prompt": 3},
    "prompt too long": lambda o: {**o, "prompt": "stack the blocks " * 40},
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_then_next_call_equals_fresh(fronts, name):
    f = fronts["two_cams"]
    obs = _obs("two_cams")
    with pytest.raises(InputError):
        f.check(BAD[name](obs))
    fresh = _load("two_cams")
    assert np.array_equal(infer(f, obs, seed=7), infer(fresh, obs, seed=7))


def test_bad_noise_is_input_error(fronts):
    f = fronts["one_cam"]
    with pytest.raises(InputError):
        f.check(_obs("one_cam"), np.zeros((3, 3), np.float32))
    with pytest.raises(InputError):
        f.check(_obs("one_cam"), np.full((8, 16), np.inf, np.float32))


def test_seed_reproducible_and_noise_matters(fronts):
    f = fronts["one_cam"]
    a, b, c = (infer(f, _obs("one_cam"), seed=s) for s in (3, 3, 4))
    assert np.array_equal(a, b) and np.abs(a - c).max() > 1e-3


def test_embodiment_and_detection_errors(tmp_path):
    with pytest.raises(ConfigError, match="tag_a"):
        family.load(CKPT, embodiment="nope")
    with pytest.raises(ConfigError, match="tag_b"):
        family.load(CKPT, embodiment=7)
    with pytest.raises(ConfigError, match="front"):
        family.load(CKPT, embodiment="tag_a", cameras=["top"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "pi0"}))
    with pytest.raises(CheckpointError, match="Gr00tN1d7"):
        family.FAMILY.detect(tmp_path)
    assert family.FAMILY.detect(CKPT) is None
    assert policy_families()["groot"] is family.FAMILY


def test_embodiment_by_id_matches_by_name(fronts):
    f = family.load(CKPT, embodiment=3)
    assert f.embodiment.tag == "tag_b"
    obs = _obs("emb_b")
    assert np.array_equal(infer(f, obs, seed=1), infer(fronts["emb_b"], obs, seed=1))


def test_float_images_accepted_like_lerobot(fronts):
    """Float [0, 1] pixels are truncated to uint8 as lerobot's pack step does."""
    f = fronts["one_cam"]
    obs = _obs("one_cam")
    img = obs["images"]["front"]
    as_float = dict(obs, images={"front": torch.from_numpy(img).float() / 255.0})
    lerobot_u8 = (torch.from_numpy(img).float() / 255.0 * 255.0).to(torch.uint8).numpy()
    assert np.array_equal(
        infer(f, as_float, seed=0), infer(f, dict(obs, images={"front": lerobot_u8}), seed=0)
    )


def _edited_checkpoint(tmp_path: Path, edit) -> Path:
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(CKPT, folder)
    cfg = json.loads((folder / "processor_config.json").read_text())
    edit(cfg["processor_kwargs"])
    (folder / "processor_config.json").write_text(json.dumps(cfg))
    return folder


def test_chunk_is_the_decoded_horizon(tmp_path, one_thread):
    """lerobot returns len(action delta_indices) actions of the model's horizon."""
    folder = _edited_checkpoint(
        tmp_path, lambda kw: kw["modality_configs"]["tag_a"]["action"].update(delta_indices=[0, 1, 2, 3, 4])
    )
    f = family.load(folder, embodiment="tag_a", cameras=["front"])
    assert f.chunk_size == 5 and f.n_action_steps == 5
    actions = infer(f, _obs("one_cam"), noise=IO["one_cam/noise"])
    assert np.abs(actions - IO["one_cam/actions"].numpy()[:5]).max() <= TOL


def test_default_image_geometry_when_the_checkpoint_has_none(tmp_path, one_thread):
    """No image_target_size in processor_config.json: lerobot's N1.7 default 256 x 256, crop 230."""
    folder = _edited_checkpoint(tmp_path, lambda kw: [kw.pop("image_target_size"), kw.pop("image_crop_size")])
    f = family.load(folder, embodiment="tag_a", cameras=["front"])
    assert f.describe()["image_size"] == [256, 256]
    assert f.image.edge == 256 and abs(f.image.crop_fraction - 230 / 256) < 1e-12


@pytest.mark.parametrize("size", ["64x64", "60x80", "96x64", "50x50"])
def test_albumentations_geometry_matches_lerobot(size):
    """use_albumentations checkpoints: OpenCV INTER_AREA shortest-edge resize, 0.95 crop, resize (aspect
    kept), then the Qwen processor's smart resize: same pixels and image grid as lerobot's transform."""
    from flashrt.frontends.groot.common.preprocess import normalize_pixels, transform_image
    from flashrt.frontends.groot.n17.frontend import image_spec

    kw = {
        "image_target_size": [64, 64],
        "image_crop_size": [58, 58],
        "crop_fraction": 0.95,
        "use_albumentations": True,
    }
    spec = image_spec(kw, 32, CKPT / "backbone")
    frame = torch.from_numpy(IO[f"albu/{size}/frame"].numpy()).permute(2, 0, 1)
    img = transform_image(frame, spec)
    grid = IO[f"albu/{size}/image_grid_thw"][0].tolist()
    assert [1, img.shape[-2] // 16, img.shape[-1] // 16] == grid
    assert spec.output_size(*frame.shape[-2:]) == tuple(img.shape[-2:])
    px = normalize_pixels(img, spec)[None]
    r, q = px.shape[-2:]
    x = px[:, None].expand(1, 2, 3, r, q).reshape(1, 2, 3, r // 32, 2, 16, q // 32, 2, 16)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(-1, 3 * 2 * 16 * 16)
    assert (x - IO[f"albu/{size}/pixel_values"]).abs().max().item() <= 1e-6


def test_frame_size_fixes_the_layout_under_albumentations(tmp_path, one_thread):
    folder = _edited_checkpoint(tmp_path, lambda kw: kw.update(use_albumentations=True, crop_fraction=0.95))
    f = family.load(folder, embodiment="tag_a", frame_size=(60, 80))
    assert f.describe()["image_size"] == [64, 96] and f.describe()["image_transform"] == "albumentations"
    obs = _obs("two_cams")
    obs["images"] = {c: IO["albu/60x80/frame"].numpy() for c in ("front", "wrist")}
    assert infer(f, obs, seed=0).shape == (8, 6)
    obs["images"] = {c: IO["albu/96x64/frame"].numpy() for c in ("front", "wrist")}
    with pytest.raises(InputError, match="frame_size"):
        f.check(obs)


def test_a_foreign_tokenizer_is_refused(tmp_path):
    """Vision-token ids that differ from the backbone config's would leave the image slots empty."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|image_pad|>", "<|vision_end|>", "<|vision_start|>", "<|im_end|>", "<|im_start|>"]
    tok.train_from_iterator(
        ["open the drawer"], trainers.BpeTrainer(vocab_size=280, special_tokens=specials, show_progress=False)
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="disagree"):
        family.load(CKPT, embodiment="tag_a", cameras=["front"], tokenizer=tmp_path / "tokenizer.json")
