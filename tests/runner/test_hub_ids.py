"""Vocoders and policies by hub id, against a Hugging Face cache the test writes itself (blobs + snapshot
links, as huggingface_hub lays it out); never touches the network, HF_HUB_OFFLINE honoured."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

from flashrt.errors import CheckpointError
from flashrt.runner.vocoder import load_vocoder

pytest.importorskip("huggingface_hub")
import huggingface_hub.constants as hub_constants  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vocoders"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(root: Path, repo_id: str, folder: Path) -> Path:
    """models--owner--name/{blobs/<sha>, refs/main, snapshots/<commit>/<name> -> ../../blobs/<sha>}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        sha = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, repo / "blobs" / sha)
        os.symlink(Path("..") / ".." / "blobs" / sha, snapshot / file.name)
    return snapshot


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test (the offline promise), not just the lookup."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network use in an offline test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    snapshot = write_hub_cache(root, "hubertsiuzdak/snac_24khz", FIXTURES / "snac_24khz_tiny")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(root))
    return root, snapshot


def test_load_vocoder_by_hub_id_equals_the_folder(hub_cache, no_network):
    _, snapshot = hub_cache
    by_id = load_vocoder("hubertsiuzdak/snac_24khz", buckets=(8,))
    by_folder = load_vocoder(FIXTURES / "snac_24khz_tiny", buckets=(8,))
    assert by_id.family.name == "snac" and by_id.config == by_folder.config
    for (name, a), (_, b) in zip(by_id.frontend.module.state_dict().items(),
                                 by_folder.frontend.module.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert not no_network


def test_a_card_takes_a_hub_id_as_its_checkpoint(hub_cache, no_network):
    voc = load_vocoder("snac-24khz", checkpoint="hubertsiuzdak/snac_24khz", config="tiny", buckets=(8,))
    assert voc.family.name == "snac" and not no_network


def test_an_id_missing_from_the_cache_says_how_to_get_it(hub_cache, no_network):
    with pytest.raises(CheckpointError, match="hf download hubertsiuzdak/snac_32khz"):
        load_vocoder("hubertsiuzdak/snac_32khz")
    assert not no_network


def test_hf_hub_offline_is_honoured_even_when_downloads_are_allowed(hub_cache, no_network, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    voc = load_vocoder("hubertsiuzdak/snac_24khz", buckets=(8,), allow_download=True)  # from the cache
    assert voc.family.name == "snac"
    with pytest.raises(CheckpointError, match="hubertsiuzdak/snac_44khz"):
        load_vocoder("hubertsiuzdak/snac_44khz", allow_download=True)
    assert not no_network  # offline: huggingface_hub never opened a connection


def test_the_cli_takes_hub_ids_like_the_python_api(hub_cache, no_network, tmp_path, monkeypatch, capsys):
    """serve-policy, calibrate and export resolve a hub id from the local cache, as load_policy does
    (a Path-typed argument would turn the id into a missing local folder)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support import pi0_e2e as E2E

    from flashrt.cli import main
    from flashrt.serve import policy_server

    root, _ = hub_cache
    policy_dir = E2E.case("pi05_cam1").policy_dir
    write_hub_cache(root, "someone/pi05_tiny", policy_dir)
    served = []

    class Stub:
        def __init__(self, policy, *args, **kwargs):
            served.append(policy)
            self.host, self.port, self.max_message_bytes = "127.0.0.1", 0, 1

        def serve_forever(self):
            return None

        def close(self):
            return None

    monkeypatch.setattr(policy_server, "PolicyServer", Stub)
    code = main(["serve-policy", "someone/pi05_tiny", "--tokenizer", str(E2E.TOKENIZER)])
    assert code == 0, capsys.readouterr().err
    assert served and served[0].chunk_size == 6
    out = tmp_path / "onnx"
    code = main(["export", "hubertsiuzdak/snac_24khz", "-o", str(out), "--bucket", "8", "--json"])
    assert code == 0, capsys.readouterr().err
    assert (out / "manifest.json").is_file()
    assert not no_network
