"""State/action (un)normalization: lerobot 0.6.1 parity from its own processor files, openpi formulas."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from support import pi0_e2e

from flashrt.errors import CheckpointError
from flashrt.frontends.pi0.checkpoint import load_checkpoint, relative_offset
from flashrt.frontends.pi0.normalize import MODES, Normalizer, lerobot_normalizer, openpi_normalizers

E2E = pi0_e2e


def _state_norm(case) -> Normalizer:
    return lerobot_normalizer(case.policy_dir, "policy_preprocessor.json", "normalizer_processor",
                              "observation.state")


def _action_norm(case) -> Normalizer:
    return lerobot_normalizer(case.policy_dir, "policy_postprocessor.json", "unnormalizer_processor",
                              "action")


@pytest.mark.parametrize("name", E2E.CASES)
def test_lerobot_parity(name):
    """The state lerobot's preprocessor normalized and the actions its postprocessor un-normalized."""
    case = E2E.case(name)
    state_norm, action_norm = _state_norm(case), _action_norm(case)
    expected_mode = "MEAN_STD" if case.info["kind"] == "pi0" else "QUANTILES"
    assert (state_norm.mode, action_norm.mode) == (expected_mode, expected_mode)
    assert (state_norm.dim, action_norm.dim) == (case.info["state_dim"], case.info["action_dim"])
    for i in case.observations:
        got = state_norm.normalize(case.tensor(i, "state"))
        assert torch.allclose(got, case.tensor(i, "state_norm"), rtol=0, atol=1e-6)
        back = action_norm.unnormalize(case.tensor(i, "actions_norm"))
        if name.endswith("_rel"):  # relative actions: the postprocessor then adds the raw state back
            mask = load_checkpoint(case.policy_dir, tokenizer=E2E.TOKENIZER).relative_mask
            back = back + relative_offset(mask, case.tensor(i, "state"), case.info["action_dim"])
        assert torch.allclose(back, case.tensor(i, "actions"), rtol=0, atol=1e-5)


STATS = {"mean": [1.0, -2.0, 0.5], "std": [2.0, 0.0, 0.25], "min": [-3.0, 1.0, 0.0], "max": [5.0, 1.0, 2.0],
         "q01": [-1.0, 3.0, 0.0], "q99": [3.0, 3.0, 1.0], "q10": [0.0, 3.0, 0.2], "q90": [2.0, 3.0, 0.8]}
X = np.array([0.5, 3.0, 0.75], dtype=np.float64)


def _expected(convention: str, mode: str, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(normalize(X), unnormalize(X)) written out in float64 from the reference formulas."""
    s = {k: np.array(v) for k, v in STATS.items()}
    if convention == "openpi":
        if mode == "MEAN_STD":
            return (X - s["mean"]) / (s["std"] + eps), X * (s["std"] + eps) + s["mean"]
        d = s["q99"] - s["q01"] + eps
        return (X - s["q01"]) / d * 2 - 1, (X + 1) / 2 * d + s["q01"]
    if mode == "MEAN_STD":
        return (X - s["mean"]) / (s["std"] + eps), X * s["std"] + s["mean"]
    lo, hi = {"MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90")}[mode]
    d = np.where(s[hi] - s[lo] == 0, eps, s[hi] - s[lo])
    return 2 * (X - s[lo]) / d - 1, (X + 1) / 2 * d + s[lo]


@pytest.mark.parametrize(("convention", "mode"), sorted(k for k in MODES if k[1] != "IDENTITY"))
def test_formulas_and_eps_placement(convention, mode):
    """Zero spreads (std 0, q01 == q99) make the epsilon's place visible in the result."""
    eps = 1e-2  # large, so that a misplaced epsilon cannot hide below float32 rounding
    n = Normalizer(convention, mode, STATS, eps)
    want_norm, want_unnorm = _expected(convention, mode, eps)
    x = torch.tensor(X, dtype=torch.float32)
    assert np.allclose(n.normalize(x).numpy(), want_norm, rtol=1e-6, atol=1e-5)
    assert np.allclose(n.unnormalize(x).numpy(), want_unnorm, rtol=1e-6, atol=1e-5)


def test_round_trip_and_identity():
    stats = {k: [v[0], v[2]] for k, v in STATS.items()}
    x = torch.tensor([0.3, -0.7])
    for convention, mode in MODES:
        n = Normalizer(convention, mode, stats, 1e-8)
        assert torch.allclose(n.unnormalize(n.normalize(x)), x, atol=1e-5), (convention, mode)
    ident = Normalizer("lerobot", "IDENTITY")
    assert ident.dim is None and torch.equal(ident.normalize(x), x)


def test_refusals():
    with pytest.raises(CheckpointError, match="needs statistics \\['q01', 'q99'\\]"):
        Normalizer("lerobot", "QUANTILES", {"mean": [0.0], "std": [1.0]}, name="observation.state")
    with pytest.raises(CheckpointError, match="not supported"):
        Normalizer("openpi", "MIN_MAX", STATS)
    with pytest.raises(CheckpointError, match="different sizes"):
        Normalizer("lerobot", "MEAN_STD", {"mean": [0.0, 1.0], "std": [1.0]})


def test_openpi_norm_stats_json(tmp_path):
    path = tmp_path / "norm_stats.json"
    actions = {k: v[:2] for k, v in STATS.items()}
    path.write_text(json.dumps({"norm_stats": {"state": STATS, "actions": actions}}))
    state, action = openpi_normalizers(path, quantiles=True)
    assert (state.mode, state.convention, state.eps) == ("QUANTILES", "openpi", 1e-6)
    assert (state.dim, action.dim) == (3, 2)
    state, _ = openpi_normalizers(path, quantiles=False)
    assert state.mode == "MEAN_STD"
    path.write_text(json.dumps({"norm_stats": {"state": STATS}}))
    with pytest.raises(CheckpointError, match="no 'actions'"):
        openpi_normalizers(path, quantiles=True)
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        openpi_normalizers(path, quantiles=True)


def test_lerobot_files_missing_or_incomplete(tmp_path):
    policy = E2E.copy_policy(E2E.case("pi05_cam1"), tmp_path / "policy")
    pre = json.loads((policy / "policy_preprocessor.json").read_text())
    (state_file,) = policy.glob("policy_preprocessor_step_*_normalizer_processor.safetensors")
    state_file.unlink()
    with pytest.raises(CheckpointError, match="normalization statistics .* not found"):
        lerobot_normalizer(policy, "policy_preprocessor.json", "normalizer_processor", "observation.state")
    with pytest.raises(CheckpointError, match="no 'unnormalizer_processor' step"):
        lerobot_normalizer(policy, "policy_preprocessor.json", "unnormalizer_processor", "action")
    with pytest.raises(CheckpointError, match="no feature 'observation.vel'"):
        lerobot_normalizer(policy, "policy_postprocessor.json", "unnormalizer_processor", "observation.vel")
    for step in pre["steps"]:  # a step without a state file: lerobot leaves the feature untouched
        step.pop("state_file", None)
    (policy / "policy_preprocessor.json").write_text(json.dumps(pre))
    n = lerobot_normalizer(policy, "policy_preprocessor.json", "normalizer_processor", "observation.state")
    assert n.mode == "IDENTITY"
