"""FAST detokenizer vs lerobot 0.6.1 `detokenize_actions` on hand-made token streams (well formed, no end
marker, too short, too long, "Action: " prefix), its refusals, and its files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from flashrt.errors import CheckpointError, NumericalError
from flashrt.frontends.pi0.tokenizer import PaliGemmaTokenizer
from flashrt.frontends.pi0_fast.family import _text_ids
from flashrt.frontends.pi0_fast.fast import Detokenizer, FastTokenizer, find_fast_folder, idct_ortho

ROOT = Path(__file__).resolve().parents[2] / "fixtures" / "pi0_fast"
FAST_DIR = ROOT / "cam1" / "policy" / "fast_tokenizer"
INFO = json.loads((ROOT / "cam1" / "io.json").read_text())


def detokenizer(check_prefix: bool = False) -> Detokenizer:
    text = _text_ids(PaliGemmaTokenizer(ROOT / "tokenizer.model"))
    return Detokenizer(FastTokenizer.load(FAST_DIR), text, 128, INFO["n_action_steps"], INFO["action_dim"],
                       check_prefix)


def cut(ids: list[int], end: int) -> list[int]:
    """What the decode loop hands the detokenizer: the ids before the first end marker."""
    return ids[: ids.index(end)] if end in ids else ids


@pytest.mark.parametrize("name", ["well_formed", "no_end_marker", "too_short", "too_long", "action_prefix"])
def test_matches_lerobot(name):
    streams = load_file(str(ROOT / "detok.safetensors"))
    det = detokenizer()
    got = det.decode(cut(streams[f"{name}.tokens"].tolist(), det.text.end))
    want = streams[f"{name}.actions"].numpy()
    assert np.abs(want).max() > 0.1  # a real chunk, not lerobot's all-zero fallback
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_empty_stream_is_an_error_not_zeros():
    streams = load_file(str(ROOT / "detok.safetensors"))
    det = detokenizer()
    assert not streams["empty.actions"].any()  # lerobot: zeros
    with pytest.raises(NumericalError, match="no FAST action tokens"):
        det.decode(cut(streams["empty.tokens"].tolist(), det.text.end))


def test_skipped_range_id_is_an_error():
    det = detokenizer()
    with pytest.raises(NumericalError, match="skipped"):
        det.decode([700, det.text.vocab_size - 5])


def test_prefix_check():
    det = detokenizer(check_prefix=True)
    with pytest.raises(NumericalError, match="Action"):
        det.decode([700, 701])
    plain = detokenizer().decode([700, 701])
    np.testing.assert_array_equal(det.decode([*det.text.action_prefix, 700, 701]), plain)


def test_idct_inverts_the_orthonormal_dct():
    n = 7
    k, t = np.arange(n)[:, None], np.arange(n)[None, :]
    dct = np.cos(np.pi * k * (2 * t + 1) / (2 * n)) * np.sqrt(2.0 / n)
    dct[0] = np.sqrt(1.0 / n)
    x = np.random.default_rng(0).normal(size=(n, 3))
    np.testing.assert_allclose(idct_ortho(dct @ x), x, atol=1e-12)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(CheckpointError, match="processor_config.json"):
        find_fast_folder(tmp_path, tmp_path)
    (tmp_path / "processor_config.json").write_text('{"scale": "ten", "min_token": 0}')
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="scale"):
        FastTokenizer.load(find_fast_folder(tmp_path, tmp_path))
    (tmp_path / "processor_config.json").write_text('{"scale": 10, "min_token": 0}')
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        FastTokenizer.load(tmp_path)


def test_hostile_fast_files(tmp_path):
    """A FIFO or /dev/zero named as tokenizer.json is refused at once (regular files only, capped)."""
    import os

    (tmp_path / "processor_config.json").write_text('{"scale": 10, "min_token": 0}')
    os.mkfifo(tmp_path / "tokenizer.json")
    with pytest.raises(CheckpointError, match="tokenizer"):
        FastTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.json").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="tokenizer"):
        FastTokenizer.load(tmp_path)
