"""Pi0 configs from untrusted data (flashrt/frontends/pi0/config.py): every malformed size, card or tensor
shape is a ConfigError / CheckpointError naming the field; never a raw KeyError, ValueError, TypeError,
IndexError or ZeroDivisionError, and never an absurd size accepted for a later allocation."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import pytest

from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.pi0.config import (
    GemmaSpec,
    Pi0Config,
    SiglipSpec,
    config_from_card,
    config_from_state_dict_shapes,
    preset,
)
from flashrt.io import open_checkpoint

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "pi0"
LLM = "model.paligemma_with_expert.paligemma.model.language_model."
VISION = "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model."
TINY = preset("pi0-tiny")

BAD_SPECS = {
    "gemma width 0": (GemmaSpec, {"width": 0}, "width"),
    "gemma width negative": (GemmaSpec, {"width": -64}, "width"),
    "gemma width bool": (GemmaSpec, {"width": True}, "width"),
    "gemma width float": (GemmaSpec, {"width": 64.0}, "width"),
    "gemma width string": (GemmaSpec, {"width": "64"}, "width"),
    "gemma depth absurd": (GemmaSpec, {"depth": 1_000_000}, "depth"),
    "gemma vocab absurd": (GemmaSpec, {"vocab_size": 10**9}, "vocab_size"),
    "gemma vocab negative": (GemmaSpec, {"vocab_size": -1}, "vocab_size"),
    "gemma kv heads 0": (GemmaSpec, {"num_kv_heads": 0}, "num_kv_heads"),
    "gemma head_dim odd": (GemmaSpec, {"head_dim": 15}, "head_dim"),
    "gemma eps 0": (GemmaSpec, {"eps": 0.0}, "eps"),
    "gemma eps nan": (GemmaSpec, {"eps": float("nan")}, "eps"),
    "gemma rope negative": (GemmaSpec, {"rope_theta": -1.0}, "rope_theta"),
    "gemma rope string": (GemmaSpec, {"rope_theta": "1e4"}, "rope_theta"),
    "siglip heads 0": (SiglipSpec, {"num_heads": 0}, "num_heads"),       # was a ZeroDivisionError
    "siglip patch 0": (SiglipSpec, {"patch": 0}, "patch"),               # was a ZeroDivisionError
    "siglip image 0": (SiglipSpec, {"image_size": 0}, "image_size"),
    "siglip image absurd": (SiglipSpec, {"image_size": 14 * 10_000}, "image_size"),
    "siglip width float": (SiglipSpec, {"width": 32.5}, "width"),
    "siglip eps negative": (SiglipSpec, {"eps": -1e-6}, "eps"),
    "pi0 chunk 0": (Pi0Config, {"chunk_size": 0}, "chunk_size"),
    "pi0 chunk absurd": (Pi0Config, {"chunk_size": 1_000_000}, "chunk_size"),
    "pi0 steps bool": (Pi0Config, {"num_steps": True}, "num_steps"),
    "pi0 steps absurd": (Pi0Config, {"num_steps": 10**6}, "num_steps"),
    "pi0 action dim float": (Pi0Config, {"max_action_dim": 16.0}, "max_action_dim"),
    "pi0 state dim absurd": (Pi0Config, {"max_state_dim": 10**6}, "max_state_dim"),
    "pi0 min period 0": (Pi0Config, {"min_period": 0.0}, "min_period"),
    "pi0 periods swapped": (Pi0Config, {"min_period": 4.0, "max_period": 4e-3}, "min_period"),
    "pi0 max period inf": (Pi0Config, {"max_period": float("inf")}, "max_period"),
    "pi0 vision not a spec": (Pi0Config, {"vision": {"width": 32}}, "vision"),
    "pi0 variant": (Pi0Config, {"variant": "pi1"}, "variant"),
}


@pytest.mark.parametrize("case", BAD_SPECS)
def test_bad_sizes_are_config_errors(case):
    cls, change, field = BAD_SPECS[case]
    base = {GemmaSpec: TINY.vlm, SiglipSpec: TINY.vision, Pi0Config: TINY}[cls]
    with pytest.raises(ConfigError, match=field):
        replace(base, **change)


def _card(**change):
    card = {"variant": "pi0", "sizes": {"vision": asdict(TINY.vision), "vlm": asdict(TINY.vlm),
                                        "expert": asdict(TINY.expert)},
            "io": {"chunk_size": 6, "max_state_dim": 12, "max_action_dim": 16, "num_steps": 4}}
    for path, value in change.items():
        *parents, leaf = path.split("__")
        node = card
        for p in parents:
            node = node[p]
        if value is KeyError:
            del node[leaf]
        else:
            node[leaf] = value
    return card


BAD_CARDS = {
    "not a table": ([1, 2], "expected a table"),
    "sizes not a table": (_card(sizes="tiny"), r"\[sizes\]"),
    "io not a table": (_card(io=[6]), r"\[io\]"),
    "vlm missing": (_card(sizes__vlm=KeyError), r"sizes.vlm\]: missing"),
    "vlm a list": (_card(sizes__vlm=[64, 2]), r"sizes.vlm\]: expected a table"),
    "vlm unknown key": (_card(sizes__vlm__hidden=64), r"sizes.vlm\]: unknown keys \['hidden'\]"),
    "vlm width missing": (_card(sizes__vlm__width=KeyError), r"sizes.vlm\].*width"),
    "vlm width string": (_card(sizes__vlm__width="64"), r"sizes.vlm\].*width"),
    "vision heads 0": (_card(sizes__vision__num_heads=0), r"sizes.vision\].*num_heads"),
    "expert depth differs": (_card(sizes__expert__depth=3), "share depth"),
    "io chunk absurd": (_card(io__chunk_size=1_000_000), "chunk_size"),
    "io chunk negative": (_card(io__chunk_size=-6), "chunk_size"),
    "io steps float": (_card(io__num_steps=4.5), "num_steps"),
    "io unknown": (_card(io__prompt_len=48), "io.prompt_len"),
    "variant": (_card(variant="pi1"), "variant"),
    "unknown sizes table": (_card(sizes__decoder={}), "decoder"),
}


@pytest.mark.parametrize("case", BAD_CARDS)
def test_bad_cards_are_config_errors(case):
    card, match = BAD_CARDS[case]
    with pytest.raises(ConfigError, match=match):
        config_from_card(card)


def test_the_good_card_reads():
    assert config_from_card(_card()) == TINY


def _shapes():
    with open_checkpoint(FIXTURES / "pi0_tiny" / "model.safetensors") as ckpt:
        return {k: tuple(ckpt.shape(k)) for k in ckpt}


BAD_SHAPES = {
    "q_proj 1-D": (LLM + "layers.0.self_attn.q_proj.weight", (128,), "q_proj"),
    "q_proj 3-D": (LLM + "layers.0.self_attn.q_proj.weight", (128, 64, 1), "q_proj"),
    "q_proj empty": (LLM + "layers.0.self_attn.q_proj.weight", (0, 64), "q_proj"),
    "k_proj rows not whole heads": (LLM + "layers.0.self_attn.k_proj.weight", (24, 64), "k_proj"),
    "gate_proj 1-D": (LLM + "layers.0.mlp.gate_proj.weight", (128,), "gate_proj"),
    "embed_tokens 3-D": (LLM + "embed_tokens.weight", (512, 64, 1), "embed_tokens"),
    "patch embedding 2-D": (VISION + "embeddings.patch_embedding.weight", (32, 588), "patch_embedding"),
    "position embedding 1-D": (VISION + "embeddings.position_embedding.weight", (4,), "position_embedding"),
    "position rows not square": (VISION + "embeddings.position_embedding.weight", (5, 32), "square"),
    "fc1 scalar": (VISION + "encoder.layers.0.mlp.fc1.weight", (), "fc1"),
    "action_in_proj 1-D": ("model.action_in_proj.weight", (32,), "action_in_proj"),
    "state_proj 1-D": ("model.state_proj.weight", (32,), "state_proj"),
    "action dim absurd": ("model.action_in_proj.weight", (32, 100_000), "max_action_dim"),
}


@pytest.mark.parametrize("case", BAD_SHAPES)
def test_bad_tensor_shapes_are_checkpoint_errors(case):
    key, shape, match = BAD_SHAPES[case]
    shapes = _shapes()
    assert key in shapes
    shapes[key] = shape
    with pytest.raises(CheckpointError, match=match):
        config_from_state_dict_shapes(shapes, "pi0", chunk_size=6, num_steps=4)


BAD_OVERRIDES = {
    "chunk absurd": ({"chunk_size": 1_000_000}, CheckpointError, "chunk_size"),
    "chunk zero": ({"chunk_size": 0}, CheckpointError, "chunk_size"),
    "steps string": ({"num_steps": "10"}, CheckpointError, "num_steps"),
    "unknown override": ({"prompt_len": 48}, ConfigError, "prompt_len"),
}


@pytest.mark.parametrize("case", BAD_OVERRIDES)
def test_bad_overrides(case):
    overrides, error, match = BAD_OVERRIDES[case]
    with pytest.raises(error, match=match):
        config_from_state_dict_shapes(_shapes(), "pi0", **{"chunk_size": 6, "num_steps": 4, **overrides})


def test_the_fixture_shapes_still_derive_the_tiny_preset():
    assert config_from_state_dict_shapes(_shapes(), "pi0", "tiny", "tiny", chunk_size=6, num_steps=4) == TINY
