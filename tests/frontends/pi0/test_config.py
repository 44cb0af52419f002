"""Pi0Config: presets, model cards, validation, and sizes derived from checkpoint tensor shapes."""

import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.pi0.config import (
    GemmaSpec,
    SiglipSpec,
    config_from_card,
    config_from_state_dict_shapes,
    preset,
)
from flashrt.resources import data_dir

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "pi0"
LLM = "model.paligemma_with_expert.paligemma.model.language_model."


def _fixture_shapes(variant: str) -> dict:
    return {k: v.shape for k, v in load_file(str(FIXTURES / f"{variant}_tiny" / "model.safetensors")).items()}


@pytest.mark.parametrize("card,name", [("pi0-base", "pi0"), ("pi05-base", "pi05"), ("pi0-tiny", "pi0-tiny"),
                                       ("pi05-tiny", "pi05-tiny")])
def test_model_cards_match_presets(card, name):
    with open(data_dir("models") / f"{card}.toml", "rb") as f:
        assert config_from_card(tomllib.load(f)) == preset(name)


def test_card_with_unknown_keys_is_refused():
    with open(data_dir("models") / "pi0-tiny.toml", "rb") as f:
        card = tomllib.load(f)
    card["io"]["chunk"] = 3
    with pytest.raises(ConfigError, match="io.chunk"):
        config_from_card(card)


def test_real_presets_have_the_family_sizes():
    cfg = preset("pi0")
    assert (cfg.vlm.width, cfg.vlm.depth, cfg.vlm.mlp_dim, cfg.vlm.vocab_size) == (2048, 18, 16_384, 257_152)
    e, v = cfg.expert, cfg.vision
    assert (e.width, e.mlp_dim, e.num_heads, e.num_kv_heads) == (1024, 4096, 8, 1)
    assert (v.width, v.depth, v.head_dim, v.num_tokens) == (1152, 27, 72, 256)
    assert cfg.suffix_len == 51 and preset("pi05").suffix_len == 50
    assert cfg.prefix_len(2, 48) == 560 and preset("pi0-tiny").prefix_len(3, 10) == 22


def test_invalid_configs_are_refused():
    with pytest.raises(ConfigError, match="share depth"):
        replace(preset("pi0-tiny"), expert=GemmaSpec(width=32, depth=3, mlp_dim=64, head_dim=16))
    with pytest.raises(ConfigError, match="variant"):
        preset("pi0", variant="pi1")
    with pytest.raises(ConfigError, match="unknown Pi0 preset"):
        preset("pi0-huge")
    with pytest.raises(ConfigError, match="divisible"):
        SiglipSpec(width=30, num_heads=4)


def _lerobot_shapes(cfg, prefix="model.") -> dict[str, tuple[int, ...]]:
    """The lerobot key layout (REFERENCE_IMPLEMENTATIONS §1.2) with the sizes of ``cfg``, no tensors."""
    v, vlm, e = cfg.vision, cfg.vlm, cfg.expert
    vis = "paligemma_with_expert.paligemma.model.vision_tower.vision_model."
    s = {vis + "embeddings.patch_embedding.weight": (v.width, 3, v.patch, v.patch),
         vis + "embeddings.patch_embedding.bias": (v.width,),
         vis + "embeddings.position_embedding.weight": (v.num_tokens, v.width),
         vis + "encoder.layers.0.mlp.fc1.weight": (v.mlp_dim, v.width)}
    s.update({vis + f"encoder.layers.{i}.layer_norm1.weight": (v.width,) for i in range(v.depth)})
    for stem, g in (("paligemma_with_expert.paligemma.model.language_model.", vlm),
                    ("paligemma_with_expert.gemma_expert.model.", e)):
        for i in range(g.depth):
            s[stem + f"layers.{i}.self_attn.q_proj.weight"] = (g.q_dim, g.width)
            s[stem + f"layers.{i}.self_attn.k_proj.weight"] = (g.kv_dim, g.width)
            s[stem + f"layers.{i}.mlp.gate_proj.weight"] = (g.mlp_dim, g.width)
    s["paligemma_with_expert.paligemma.lm_head.weight"] = (vlm.vocab_size, vlm.width)
    s["action_in_proj.weight"] = (e.width, cfg.max_action_dim)
    s["state_proj.weight"] = (e.width, cfg.max_state_dim)
    return {prefix + k: t for k, t in s.items()}


def test_tiny_fixture_sizes_match_the_tiny_preset():
    shapes = _fixture_shapes("pi0")
    cfg = config_from_state_dict_shapes(shapes, "pi0", "tiny", "tiny", chunk_size=6, num_steps=4)
    assert cfg == preset("pi0-tiny")
    cfg = config_from_state_dict_shapes(_fixture_shapes("pi05"), "pi05", chunk_size=6, num_steps=4)
    assert cfg == replace(preset("pi05-tiny"), max_state_dim=32)  # pi05: no state input, default kept


@pytest.mark.parametrize("prefix", ["model.", ""])
def test_real_sizes_are_derived_and_cross_checked(prefix):
    shapes = _lerobot_shapes(preset("pi0"), prefix)
    cfg = config_from_state_dict_shapes(shapes, "pi0", "gemma_2b", "gemma_300m")
    assert cfg == preset("pi0")
    assert cfg.vision == SiglipSpec() and cfg.vision.head_dim == 72 and cfg.vision.num_tokens == 256
    with pytest.raises(CheckpointError, match="paligemma_variant says 'gemma_300m'.*width 2048"):
        config_from_state_dict_shapes(shapes, "pi0", paligemma_variant="gemma_300m")
    with pytest.raises(CheckpointError, match="not a known variant"):
        config_from_state_dict_shapes(shapes, "pi0", action_expert_variant="gemma_7b")


def test_tiny_shapes_fail_the_named_variant_check():
    shapes = _fixture_shapes("pi0")
    with pytest.raises(CheckpointError, match="gemma_2b"):
        config_from_state_dict_shapes(shapes, "pi0", paligemma_variant="gemma_2b")


def test_siglip_head_rule_and_vocab_from_embedding():
    cfg = preset("pi0-tiny")
    shapes = _lerobot_shapes(cfg)
    shapes[LLM + "embed_tokens.weight"] = (300, cfg.vlm.width)  # embedding wins over lm_head
    got = config_from_state_dict_shapes(shapes, "pi0")
    assert got.vision.num_heads == 2 and got.vlm.vocab_size == 300
    bad = {k: ((40, *v[1:]) if "patch_embedding.weight" in k else v) for k, v in shapes.items()}
    with pytest.raises(CheckpointError, match="SigLIP heads"):
        config_from_state_dict_shapes(bad, "pi0")


def test_shape_errors_name_the_problem():
    shapes = _lerobot_shapes(preset("pi0-tiny"))
    with pytest.raises(CheckpointError, match="not a multiple"):
        config_from_state_dict_shapes({**shapes, LLM + "layers.0.self_attn.q_proj.weight": (100, 64)}, "pi0")
    with pytest.raises(CheckpointError, match="state_proj"):
        config_from_state_dict_shapes({k: v for k, v in shapes.items() if "state_proj" not in k}, "pi0")
    with pytest.raises(CheckpointError, match="numbered"):
        config_from_state_dict_shapes({**shapes, LLM + "layers.3.mlp.down_proj.weight": (64, 128)}, "pi0")
    shallow = {k: v for k, v in shapes.items() if "language_model.layers.1." not in k}
    with pytest.raises(CheckpointError, match="share depth"):
        config_from_state_dict_shapes(shallow, "pi0")
