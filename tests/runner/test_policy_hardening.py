"""Bad input to a policy, as tables: call arguments, observations on every tick, threads, and
checkpoint folders made wrong one field at a time. Every case gets its typed error naming the field,
and the next good call is bit-identical to a fresh policy's."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from support import pi0_e2e as E2E

from flashrt.errors import CheckpointError, InputError, NumericalError
from flashrt.runner.policy import load_policy

CASE = "pi05_cam2"


@pytest.fixture(scope="module")
def fresh():
    """(a policy, the reference output of obs 0 with seed 3 from a fresh policy)."""
    case = E2E.case(CASE)
    reference = load_policy(case.policy_dir, tokenizer=E2E.TOKENIZER).infer(case.obs(0), seed=3)["actions"]
    return load_policy(case.policy_dir, tokenizer=E2E.TOKENIZER), reference


BAD_SEEDS = [1.5, 2.0, np.float64(2.0), True, -1, 2**64, "3", [3], torch.tensor(3)]


@pytest.mark.parametrize("seed", BAD_SEEDS, ids=[repr(s) for s in BAD_SEEDS])
def test_bad_seed_is_refused_before_anything_is_written(fresh, seed):
    policy, reference = fresh
    case = E2E.case(CASE)
    before = {name: t.clone() for name, t in policy.frontend.buffers.tensors.items()}
    with pytest.raises(InputError, match="seed"):
        policy.infer(case.obs(1), seed=seed)
    for name, t in policy.frontend.buffers.tensors.items():
        assert torch.equal(t, before[name]), name
    assert np.array_equal(policy.infer(case.obs(0), seed=3)["actions"], reference)


BAD_TICKS = {"none": None, "empty": {}, "no state": {"images": {}, "prompt": "p"},
             "nan state": "nan", "wrong camera": "camera"}


@pytest.mark.parametrize("bad", list(BAD_TICKS), ids=list(BAD_TICKS))
def test_step_checks_the_observation_on_every_tick(fresh, bad):
    policy, _ = fresh
    case = E2E.case(CASE)
    policy.reset()
    policy.step(case.obs(0), seed=1)                  # replanned: the queue holds more actions
    assert policy.queued > 0
    obs = BAD_TICKS[bad]
    if obs == "nan":
        obs = {**case.obs(0), "state": np.full_like(case.obs(0)["state"], np.nan)}
    elif obs == "camera":
        obs = {**case.obs(0), "images": {"nope": next(iter(case.obs(0)["images"].values()))}}
    queued = policy.queued
    with pytest.raises(InputError):
        policy.step(obs)
    assert policy.queued == queued                    # nothing popped by the refused tick


def test_two_threads_on_one_policy_get_correct_results(fresh):
    policy, _ = fresh
    case = E2E.case(CASE)
    want = {s: load_policy(case.policy_dir, tokenizer=E2E.TOKENIZER).infer(case.obs(s % 2), seed=s)["actions"]
            for s in range(4)}
    wrong: list[int] = []

    def hammer(seeds):
        for _ in range(6):
            for s in seeds:
                if not np.array_equal(policy.infer(case.obs(s % 2), seed=s)["actions"], want[s]):
                    wrong.append(s)

    threads = [threading.Thread(target=hammer, args=(seeds,)) for seeds in ((0, 1), (2, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_non_finite_actions_are_refused_not_queued(fresh, monkeypatch):
    policy, _ = fresh
    case = E2E.case(CASE)
    real = policy.frontend.read
    monkeypatch.setattr(policy.frontend, "read", lambda checked: real(checked) * np.nan)
    policy.reset()
    with pytest.raises(NumericalError, match="NaN"):
        policy.step(case.obs(0), seed=1)
    assert policy.queued == 0


# ---------------------------------------------------------------------------------- checkpoints
def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "policy"
    shutil.copytree(E2E.case(CASE).policy_dir, folder)
    return folder


def _edit_json(name: str, edit):
    def apply(folder: Path) -> None:
        path = folder / name
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))
    return apply


def _stat_file(folder: Path, pre: bool = True) -> Path:
    pattern = "policy_preprocessor_step_*" if pre else "policy_postprocessor_step_*"
    (path,) = folder.glob(pattern + ".safetensors")
    return path


def _edit_stats(key: str, value, pre: bool = True):
    def apply(folder: Path) -> None:
        path = _stat_file(folder, pre)
        stats = load_file(str(path))
        stats[key] = value(stats[key]) if callable(value) else value
        save_file(stats, str(path))
    return apply


def _step(data: dict, name: str) -> dict:
    return next(s for s in data["steps"] if s["registry_name"] == name)


def _set_state_file(value):
    return _edit_json("policy_preprocessor.json",
                      lambda d: _step(d, "normalizer_processor").__setitem__("state_file", value))


def _fifo_state_file(folder: Path) -> None:
    os.mkfifo(folder / "stats.fifo")
    _set_state_file("stats.fifo")(folder)


def _zero_prompt_limit(folder: Path) -> None:
    _edit_json("policy_preprocessor.json",
               lambda d: _step(d, "tokenizer_processor")["config"].__setitem__("max_length", 0))(folder)


def _nan_at_0(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[0] = float("nan")
    return t


BAD_CHECKPOINTS = {
    "nan state q01": (_edit_stats("observation.state.q01", _nan_at_0), "q01"),
    "inf action q99": (_edit_stats("action.q99", lambda t: t * float("inf"), pre=False), "q99"),
    "short state stats": (_edit_stats("observation.state.q01", lambda t: t[:-1]), "different sizes"),
    "stats of another size": (lambda f: [_edit_stats(f"observation.state.{k}", lambda t: t[:-1])(f)
                                         for k in ("q01", "q99", "mean", "std", "min", "max")],
                              "state statistics have"),
    "state_file outside": (_set_state_file("../outside.safetensors"), "state_file"),
    "state_file absolute": (_set_state_file("/etc/hostname"), "state_file"),
    "state_file fifo": (_fifo_state_file, "FIFO"),
    "state_file not a string": (_set_state_file(7), "state_file"),
    "chunk_size a string": (_edit_json("config.json", lambda d: d.__setitem__("chunk_size", "fifty")),
                            "chunk_size"),
    "chunk_size absurd": (_edit_json("config.json", lambda d: d.__setitem__("chunk_size", 10**9)),
                          "chunk_size"),
    "n_action_steps zero": (_edit_json("config.json", lambda d: d.__setitem__("n_action_steps", 0)),
                            "n_action_steps"),
    "prompt limit zero": (lambda f: [_zero_prompt_limit(f), _edit_json("config.json", lambda d: d.__setitem__(
        "tokenizer_max_length", 0))(f)], "max_length"),
    "steps missing": (_edit_json("config.json", lambda d: d.pop("num_inference_steps")),
                      "num_inference_steps"),
    "prompt limit absurd": (_edit_json("policy_preprocessor.json", lambda d: _step(d, "tokenizer_processor")[
        "config"].__setitem__("max_length", 1_000_000)), "max_length"),
    "state shape bool": (_edit_json("config.json", lambda d: d["input_features"]["observation.state"]
                                    .__setitem__("shape", [True])), "observation.state"),
    "steps not a list": (_edit_json("policy_postprocessor.json", lambda d: d.__setitem__("steps", {})),
                         "steps"),
    "eps a string": (_edit_json("policy_preprocessor.json",
                                lambda d: _step(d, "normalizer_processor")["config"].__setitem__("eps", "x")),
                     "eps"),
    "config not an object": (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json"),
    "config binary": (lambda f: (f / "config.json").write_bytes(b"\xff\xfe\x00"), "config.json"),
}


@pytest.mark.parametrize("name", list(BAD_CHECKPOINTS), ids=list(BAD_CHECKPOINTS))
@pytest.mark.timeout(60)
def test_bad_checkpoint_is_a_checkpoint_error_naming_the_field(tmp_path, name):
    edit, field = BAD_CHECKPOINTS[name]
    folder = _copy(tmp_path)
    edit(folder)
    with pytest.raises(CheckpointError, match=field):
        load_policy(folder, tokenizer=E2E.TOKENIZER)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["fifo", "/dev/zero", "directory"])
def test_hostile_tokenizer_file(tmp_path, target):
    path = tmp_path / "tokenizer.model"
    if target == "fifo":
        os.mkfifo(path)
    elif target == "directory":
        path = tmp_path / "tok_dir" / "tokenizer.model"
        path.mkdir(parents=True)
    else:
        path.symlink_to(target)
    with pytest.raises(CheckpointError, match="tokenizer"):
        load_policy(E2E.case(CASE).policy_dir, tokenizer=path)
