"""Pi0 weight maps and size derivation: layouts, aliases, tied embeddings, dtypes, strictness."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashrt.errors import CheckpointError
from flashrt.frontends.pi0.config import config_from_state_dict_shapes
from flashrt.frontends.pi0.model import Pi0Model
from flashrt.frontends.pi0.weights import detect_layout, detect_variant, load_pi0, pi0_weight_map
from flashrt.io import build_on_meta, expected_slots, open_checkpoint

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "pi0"
PG = "model.paligemma_with_expert.paligemma."
LLM = PG + "model.language_model."
EXPERT = "model.paligemma_with_expert.gemma_expert."


def _state_dict(variant: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / f"{variant}_tiny" / "model.safetensors"))


def _config(variant: str, sd) -> object:
    shapes = {k: v.shape for k, v in sd.items()}
    return config_from_state_dict_shapes(shapes, variant, chunk_size=6, num_steps=4)


def _actions(model, variant: str, case: str = "cam3_padded") -> tuple[torch.Tensor, torch.Tensor]:
    io = load_file(str(FIXTURES / f"{variant}_tiny" / "io.safetensors"))
    c = {k.split("/", 1)[1]: v for k, v in io.items() if k.startswith(case + "/")}
    out = model.sample_actions(c["images"], c["img_masks"], c["tokens"], c["token_masks"], c.get("state"),
                               c["noise"])
    return out, c["actions"]


# ------------------------------------------------------------------------------ weight maps

@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_map_produces_exactly_the_module_slots(variant):
    sd = _state_dict(variant)
    cfg = _config(variant, sd)
    expected = expected_slots(build_on_meta(lambda: Pi0Model(cfg)))
    produced = pi0_weight_map(cfg, "model.").apply(sd, expected)
    assert set(produced) == set(expected)
    assert {PG + "lm_head.weight", EXPERT + "lm_head.weight"} <= set(sd)  # present, deliberately ignored
    layer = produced["vlm.layers.1.qkv.weight"]
    src = LLM + "layers.1.self_attn."
    assert torch.equal(layer, torch.cat([sd[src + "q_proj.weight"], sd[src + "k_proj.weight"],
                                         sd[src + "v_proj.weight"]]))


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_openpi_layout_without_model_prefix(variant):
    sd = {k.removeprefix("model."): v for k, v in _state_dict(variant).items()}
    assert detect_layout(sd) == "openpi" and detect_variant(sd) == variant
    out, want = _actions(load_pi0(_config(variant, sd), sd), variant)
    assert (out - want).abs().max() <= 1e-4


def test_tied_embedding_taken_from_lm_head():
    sd = _state_dict("pi0")
    sd[PG + "lm_head.weight"] = sd.pop(LLM + "embed_tokens.weight")
    model = load_pi0(_config("pi0", sd), sd)
    assert torch.equal(model.vlm.embed.weight, sd[PG + "lm_head.weight"])
    out, want = _actions(model, "pi0")
    assert (out - want).abs().max() <= 1e-4


@pytest.mark.parametrize("variant,old,new", [("pi0", "action_time_mlp_", "time_mlp_"),
                                             ("pi05", "time_mlp_", "action_time_mlp_")])
def test_time_mlp_aliases(variant, old, new):
    sd = {k.replace("model." + old, "model." + new): v for k, v in _state_dict(variant).items()}
    assert any(k.startswith("model." + new) for k in sd)
    out, want = _actions(load_pi0(_config(variant, sd), sd), variant)
    assert (out - want).abs().max() <= 1e-4


def test_bf16_storage_is_cast_at_load(tmp_path):
    from safetensors.torch import save_file

    sd = {k: v.bfloat16() for k, v in _state_dict("pi05").items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    ckpt = open_checkpoint(tmp_path)
    model = load_pi0(_config("pi05", sd), ckpt, dtype=torch.float32)
    assert model.dtype == torch.float32
    assert torch.equal(model.action_out.weight, sd["model.action_out_proj.weight"].float())
    out, want = _actions(model, "pi05")
    assert 0 < (out - want).abs().max() < 0.05  # rounded weights: close, not equal


# lerobot 0.6.1's bf16 recipe, as its source states it: PaliGemmaWithExpertModel.
# to_bfloat16_for_selected_params keeps the parameters whose names contain one of these in float32; the
# heads of PI0Pytorch / PI05Pytorch (everything outside "paligemma_with_expert.") are never converted.
LEROBOT_KEEP_FP32 = ("vision_tower", "multi_modal_projector", "input_layernorm", "post_attention_layernorm",
                     "model.norm")


def _lerobot_keeps_fp32(key: str) -> bool:
    return not key.startswith("model.paligemma_with_expert.") or any(s in key for s in LEROBOT_KEEP_FP32)


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_bf16_recipe_keeps_in_fp32_exactly_what_lerobot_does(variant):
    """Every checkpoint tensor's slot dtype under keep_fp32=True follows lerobot's rule (applied to the
    checkpoint key), and with keep_fp32=False every float slot is bfloat16."""
    sd = _state_dict(variant)
    model = load_pi0(_config(variant, sd), sd, dtype=torch.bfloat16, keep_fp32=True)
    assert model.dtype == torch.bfloat16 and model.expert.layers[0].qkv.weight.dtype == torch.bfloat16
    plan = pi0_weight_map(model.config, "model.").plan(sd, model.state_dict())
    checked = 0
    for production in plan.productions:
        want = torch.float32 if all(_lerobot_keeps_fp32(k) for k in production.sources) else torch.bfloat16
        assert model.state_dict()[production.target].dtype == want, (production.sources, production.target)
        checked += 1
    assert checked == len(model.state_dict())
    assert model.action_in.weight.dtype == model.action_out.weight.dtype == torch.float32
    assert torch.equal(model.vision.layers[0].qkv.weight[:32], sd[PG + "model.vision_tower.vision_model."
                                                                 "encoder.layers.0.self_attn.q_proj.weight"])
    out, want = _actions(model, variant)
    assert torch.isfinite(out).all() and (out - want).abs().max() < 0.05
    plain = load_pi0(_config(variant, sd), sd, dtype=torch.bfloat16, keep_fp32=False)
    assert {p.dtype for p in plain.parameters()} == {torch.bfloat16}


def test_pi05_ignores_what_lerobot_drops():
    sd = _state_dict("pi05")
    sd["model.state_proj.weight"] = torch.zeros(32, 12)
    sd[EXPERT + "model.layers.0.input_layernorm.weight"] = torch.zeros(32)
    out, want = _actions(load_pi0(_config("pi05", sd), sd), "pi05")
    assert (out - want).abs().max() <= 1e-4


def test_strict_report_lists_missing_and_unexpected_together():
    sd = _state_dict("pi0")
    del sd["model.action_out_proj.bias"]
    sd["model.extra_head.weight"] = torch.zeros(3)
    with pytest.raises(CheckpointError) as err:
        load_pi0(_config("pi0", sd), sd)
    assert "action_out.bias" in str(err.value) and "model.extra_head.weight" in str(err.value)


def test_wrong_variant_or_family_is_refused():
    sd = _state_dict("pi0")
    with pytest.raises(CheckpointError):
        load_pi0(replace(_config("pi0", sd), variant="pi05"), sd)
    with pytest.raises(CheckpointError, match="not a Pi0"):
        detect_layout(["decoder.weight"])
