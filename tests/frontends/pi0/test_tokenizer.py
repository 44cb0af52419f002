"""Prompt tokenization against the ids lerobot 0.6.1's processors produced, state bins, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import pi0_e2e

from flashrt.errors import CheckpointError, InputError
from flashrt.frontends.pi0.tokenizer import (
    TOKENIZER_FILE,
    PaliGemmaTokenizer,
    PromptTokenizer,
    clean_prompt,
    discretize_state,
    find_tokenizer,
    pi05_prompt,
)

E2E = pi0_e2e


@pytest.fixture(scope="module")
def tok() -> PaliGemmaTokenizer:
    return PaliGemmaTokenizer(E2E.TOKENIZER)


def test_special_ids(tok):
    assert (tok.pad_id, tok.bos_id) == (0, 2)
    assert tok.vocab_size == 395


@pytest.mark.parametrize("name", E2E.CASES)
def test_ids_match_lerobot(tok, name):
    """Same ids and mask as lerobot's tokenizer step (HF GemmaTokenizer on the same tokenizer.model)."""
    case = E2E.case(name)
    fmt = "pi05" if case.info["kind"] == "pi05" else "lerobot_pi0"
    length = case.info["tokenizer_max_length"]
    prompts = PromptTokenizer(tok, fmt, length)
    for i in case.observations:
        state = case.tensor(i, "state_norm") if fmt == "pi05" else None
        ids, mask = prompts.padded(prompts.ids(case.prompt(i), state), length)
        assert torch.equal(ids, case.tensor(i, "tokens")), (name, i)
        assert torch.equal(mask, case.tensor(i, "token_mask")), (name, i)


@pytest.mark.parametrize("name", ["pi05_cam1", "pi05_cam2", "pi05_cam3"])
def test_pi05_prompt_text_matches_lerobot(name):
    case = E2E.case(name)
    for i in case.observations:
        text = pi05_prompt(case.prompt(i), case.tensor(i, "state_norm"))
        assert text == case.info["observations"][i]["lerobot_task"]


def test_state_bins():
    edges = np.array([-1.5, -1.0, -0.9921875, 0.0, 0.5, 0.99, 1.0, 7.0], dtype=np.float32)
    assert discretize_state(edges).tolist() == [-1, 0, 1, 128, 192, 254, 255, 255]
    assert discretize_state(torch.tensor([0.0])).tolist() == [128]


def test_openpi_pi0_format(tok):
    prompts = PromptTokenizer(tok, "openpi_pi0", 48)
    ids = prompts.ids("  pick_up the\ncube ")
    assert ids == tok.encode("pick up the cube", bos=True) + tok.encode("\n")
    assert clean_prompt(" a_b\nc ") == "a b c"
    lerobot = PromptTokenizer(tok, "lerobot_pi0", 48)
    assert lerobot.ids("pick up") == lerobot.ids("pick up\n") == [tok.bos_id, *tok.encode("pick up\n")]


def test_refusals(tok):
    prompts = PromptTokenizer(tok, "pi05", 16)
    with pytest.raises(InputError, match="longer than the largest prompt bucket"):
        prompts.ids("pick up the cube", np.zeros(6, np.float32))
    with pytest.raises(InputError, match="state is required"):
        prompts.ids("pick")
    with pytest.raises(InputError, match="must be a string"):
        prompts.ids(b"pick")
    with pytest.raises(CheckpointError, match="unknown prompt format"):
        PromptTokenizer(tok, "fast", 16)


def test_missing_tokenizer_says_where_to_get_it(tmp_path):
    with pytest.raises(CheckpointError, match="google/paligemma-3b-pt-224.*tokenizer="):
        find_tokenizer(None, [tmp_path])
    with pytest.raises(CheckpointError, match="does not exist.*paligemma"):
        find_tokenizer(tmp_path / "nope.model", [])
    (tmp_path / TOKENIZER_FILE).write_bytes(E2E.TOKENIZER.read_bytes())
    assert find_tokenizer(None, [tmp_path]) == tmp_path / TOKENIZER_FILE
    assert find_tokenizer(tmp_path, []) == tmp_path / TOKENIZER_FILE


def test_corrupt_tokenizer_is_a_checkpoint_error(tmp_path):
    bad = tmp_path / TOKENIZER_FILE
    bad.write_bytes(b"not a sentencepiece model")
    with pytest.raises(CheckpointError, match="cannot load tokenizer"):
        PaliGemmaTokenizer(bad)
