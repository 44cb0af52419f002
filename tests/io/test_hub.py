"""Hub ids resolve through a local Hugging Face cache layout the test writes itself (offline)."""

from __future__ import annotations

import shutil

import pytest
from support import pi0_e2e as E2E

from flashrt.errors import CheckpointError
from flashrt.io.hub import looks_like_hub_id, resolve_checkpoint

pytest.importorskip("huggingface_hub")


def _cache(tmp_path, repo_id: str, files: dict) -> tuple:
    """models--owner--name/{refs/main, snapshots/<commit>/...} as huggingface_hub writes it."""
    root = tmp_path / "hub"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        shutil.copy(source, snapshot / name)
    return root, snapshot


@pytest.mark.parametrize("value, ok", [("lerobot/pi05_base", True), ("owner/name@v1.0", True),
                                       ("a/b/c", False), ("../x", False), ("plain", False),
                                       ("/abs/x", False)])
def test_hub_id_shape(value, ok):
    assert looks_like_hub_id(value) is ok


def test_cached_id_resolves_to_its_snapshot(tmp_path):
    case = E2E.case("pi0_cam1").policy_dir
    root, snapshot = _cache(tmp_path, "lerobot/pi0_tiny", {p.name: p for p in case.iterdir()})
    assert resolve_checkpoint("lerobot/pi0_tiny", cache_dir=root) == snapshot
    assert resolve_checkpoint(str(case)) == case                      # a local folder wins


def test_missing_id_says_how_to_get_it(tmp_path):
    with pytest.raises(CheckpointError, match="hf download lerobot/absent"):
        resolve_checkpoint("lerobot/absent", cache_dir=tmp_path / "empty")


def test_load_policy_by_hub_id(tmp_path, monkeypatch):
    import flashrt.io.hub as hub
    from flashrt.runner.policy import load_policy

    case = E2E.case("pi0_cam1")
    root, _ = _cache(tmp_path, "lerobot/pi0_tiny", {p.name: p for p in case.policy_dir.iterdir()})
    real = hub.resolve_checkpoint
    monkeypatch.setattr("flashrt.runner.policy.resolve_checkpoint",
                        lambda path, allow=False: real(path, allow, cache_dir=root))
    policy = load_policy("lerobot/pi0_tiny", tokenizer=E2E.TOKENIZER)
    noise = case.tensor(0, "noise").numpy()
    got = policy.infer(case.obs(0), noise=noise)["actions"]
    assert abs(got - case.tensor(0, "actions").numpy()).max() <= 1e-4


def test_paligemma_tokenizer_is_found_in_the_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from flashrt.frontends.pi0.tokenizer import PALIGEMMA_REPO, find_tokenizer

    root, snapshot = _cache(tmp_path, PALIGEMMA_REPO, {"tokenizer.model": E2E.TOKENIZER})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root))
    assert find_tokenizer(None, [tmp_path / "nowhere"]) == snapshot / "tokenizer.model"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match="--tokenizer"):
        find_tokenizer(None, [tmp_path / "nowhere"])
