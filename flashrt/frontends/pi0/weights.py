"""Checkpoint → `Pi0Model` weight maps (lerobot 0.6.1 and openpi-PyTorch layouts), and the loader.

Layouts. lerobot ``model.safetensors`` keys start with ``model.``; openpi's PyTorch conversion uses the
same names without it. `load_pi0` picks the prefix that consumes the most keys (``auto_prefix``).

Transforms, all checked against lerobot 0.6.1 (tests/frontends/pi0/test_model.py parity):

* SigLIP ``self_attn.{q,k,v}_proj.{weight,bias}`` → ``qkv`` (concatenated along the output dim).
* Gemma ``self_attn.{q,k,v}_proj.weight`` → ``qkv`` and ``mlp.{gate,up}_proj.weight`` → ``gate_up``
  (concatenated along the output dim), for the VLM and the expert.
* Tied embedding: ``language_model.embed_tokens.weight`` if present, else ``paligemma.lm_head.weight``
  (upstream ties them; openpi-converted files keep only the head).
* Pi0 ``action_time_mlp_{in,out}`` may be stored as ``time_mlp_{in,out}`` and Pi0.5 ``time_mlp_*``
  as ``action_time_mlp_*`` (the renames lerobot's ``_fix_pytorch_state_dict_keys`` applies).
* Storage dtype (bf16 or fp32) is cast at load to the requested dtype (`flashrt.io.load_module`).

Deliberately unused keys (``ignore``): both ``lm_head.weight`` (Pi0 never decodes text), the
expert's ``embed_tokens`` if a file carries one; for Pi0.5 also ``state_proj.*`` and plain expert
RMSNorm weights, which lerobot drops the same way (adaRMS replaces them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

import torch

from flashrt.errors import CheckpointError
from flashrt.frontends.pi0.config import EXPERT, LLM, PG, VISION, Pi0Config
from flashrt.frontends.pi0.model import Pi0Model
from flashrt.io import Alt, Rule, WeightMap, load_module, transforms

LAYOUT_PREFIXES: dict[str, str] = {"lerobot": "model.", "openpi": ""}
# lerobot 0.6.1's bf16 recipe, what stays float32 when the model runs in bfloat16:
# * PaliGemmaWithExpertModel.to_bfloat16_for_selected_params keeps the parameters whose names contain
#   "vision_tower", "multi_modal_projector", "input_layernorm", "post_attention_layernorm" or "model.norm"
#   (the SigLIP tower, the projector, every (ada)RMSNorm of both Gemmas, adaRMS denses included);
# * the heads outside it (action_in_proj, action_out_proj, state_proj, time_mlp_* / action_time_mlp_*)
#   are plain nn.Linear of PI0Pytorch / PI05Pytorch that nothing converts: float32.
# Our targets of those modules (prefixes of whole stems, infixes for the norms):
FP32_PREFIXES: tuple[str, ...] = ("vision.", "projector.", "action_in.", "action_out.", "state_in.",
                                  "action_time_in.", "action_time_out.", "time_in.", "time_out.")
FP32_INFIXES: tuple[str, ...] = (".input_norm.", ".post_norm.", ".norm.")
_CAT = transforms.concat(0)


def _siglip_rules() -> list[Rule]:
    enc, dst = VISION + "encoder.layers.{i}.", "vision.layers.{i}."
    rules = [Rule(VISION + "embeddings.patch_embedding.{p}", "vision.patch.{p}"),
             Rule(VISION + "embeddings.position_embedding.weight", "vision.pos"),
             Rule(VISION + "post_layernorm.{p}", "vision.post_norm.{p}"),
             Rule(enc + "self_attn.out_proj.{p}", dst + "o.{p}")]
    rules += [Rule(enc + f"{src}.{{p}}", dst + f"{tgt}.{{p}}")
              for src, tgt in (("layer_norm1", "norm1"), ("layer_norm2", "norm2"),
                               ("mlp.fc1", "fc1"), ("mlp.fc2", "fc2"))]
    qkv = tuple(enc + f"self_attn.{n}_proj.{{p}}" for n in "qkv")
    return [*rules, Rule(qkv, dst + "qkv.{p}", _CAT)]


def _gemma_rules(stem: str, dst: str, adaptive: bool) -> list[Rule]:
    src, out = stem + "layers.{i}.", dst + ".layers.{i}."
    rules = [Rule(tuple(src + f"self_attn.{n}_proj.weight" for n in "qkv"), out + "qkv.weight", _CAT),
             Rule(src + "self_attn.o_proj.weight", out + "o.weight"),
             Rule((src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"), out + "gate_up.weight", _CAT),
             Rule(src + "mlp.down_proj.weight", out + "down.weight")]
    norm = ".dense.{p}" if adaptive else ".weight"
    rules += [Rule(src + "input_layernorm" + norm, out + "input_norm" + norm),
              Rule(src + "post_attention_layernorm" + norm, out + "post_norm" + norm),
              Rule(stem + "norm" + norm, dst + ".norm" + norm)]
    return rules


def _head_rules(config: Pi0Config) -> list[Rule]:
    rules = [Rule("action_in_proj.{p}", "action_in.{p}"), Rule("action_out_proj.{p}", "action_out.{p}")]
    if config.has_state_token:
        return [*rules, Rule("state_proj.{p}", "state_in.{p}"),
                Rule(Alt("action_time_mlp_in.{p}", "time_mlp_in.{p}"), "action_time_in.{p}"),
                Rule(Alt("action_time_mlp_out.{p}", "time_mlp_out.{p}"), "action_time_out.{p}")]
    return [*rules, Rule(Alt("time_mlp_in.{p}", "action_time_mlp_in.{p}"), "time_in.{p}"),
            Rule(Alt("time_mlp_out.{p}", "action_time_mlp_out.{p}"), "time_out.{p}")]


def _ignored(config: Pi0Config) -> tuple[str, ...]:
    ignore = [PG + "lm_head.weight", "paligemma_with_expert.gemma_expert.lm_head.weight",
              EXPERT + "embed_tokens.weight"]
    if not config.has_state_token:
        ignore += ["state_proj.*", EXPERT + "layers.{i}.input_layernorm.weight",
                   EXPERT + "layers.{i}.post_attention_layernorm.weight", EXPERT + "norm.weight"]
    return tuple(ignore)


def pi0_weight_map(config: Pi0Config, prefix: str = "", keep_fp32: bool = False) -> WeightMap:
    """The strict map for ``config``'s variant; ``prefix`` is "model." for lerobot files, "" for openpi.

    ``keep_fp32``: the modules lerobot's bfloat16 mode keeps in float32 (`FP32_PREFIXES`,
    `FP32_INFIXES`: vision tower, projector, every (ada)RMSNorm, the action / state / time heads) load
    as float32 whatever the model dtype."""
    rules = [*_siglip_rules(),
             Rule(PG + "model.multi_modal_projector.linear.{p}", "projector.{p}"),
             Rule(Alt(LLM + "embed_tokens.weight", PG + "lm_head.weight"), "vlm.embed.weight"),
             *_gemma_rules(LLM, "vlm", adaptive=False),
             *_gemma_rules(EXPERT, "expert", adaptive=not config.has_state_token),
             *_head_rules(config)]
    if keep_fp32:
        rules = [replace(r, dtype=torch.float32) if is_fp32_target(r.target) else r for r in rules]
    return WeightMap(rules, ignore=_ignored(config)).with_prefix(prefix)


def is_fp32_target(target: str) -> bool:
    """Whether lerobot's bf16 recipe keeps the module slot ``target`` (e.g. "vlm.norm.weight") float32."""
    return target.startswith(FP32_PREFIXES) or any(t in target for t in FP32_INFIXES)


def detect_layout(keys: Iterable[str]) -> str:
    """"lerobot" (keys under ``model.``) or "openpi" (no prefix); CheckpointError if neither fits."""
    keys = list(keys)
    for layout, prefix in LAYOUT_PREFIXES.items():
        if any(k.startswith(prefix + "paligemma_with_expert.") for k in keys):
            return layout
    raise CheckpointError("no 'paligemma_with_expert.' keys (with or without 'model.'): not a Pi0/Pi0.5 "
                          f"checkpoint; first keys: {keys[:5]}")


def detect_variant(keys: Iterable[str]) -> str:
    """"pi05" when the expert norms are adaptive (``...norm.dense.weight``), else "pi0"."""
    keys = list(keys)
    detect_layout(keys)
    adaptive = any(k.removeprefix("model.") == EXPERT + "norm.dense.weight" for k in keys)
    return "pi05" if adaptive else "pi0"


def load_pi0(config: Pi0Config, checkpoint: Mapping[str, torch.Tensor], device: str | torch.device = "cpu",
             dtype: torch.dtype | None = None, keep_fp32: bool = False, kernels: str = "auto") -> Pi0Model:
    """Build `Pi0Model` on meta, map ``checkpoint`` strictly, cast to ``dtype``, compute the schedule.

    ``dtype`` None keeps the storage dtype; ``keep_fp32`` (with a half ``dtype``) is lerobot's bf16
    recipe: vision tower, projector, norms and the action / state / time heads stay float32 (weights
    and their activations), the two Gemmas run in ``dtype``; activations are cast at the boundaries.
    ``kernels``: the form of the "decoder" ops (`flashrt.ops.decoder.decoder_prefer`), chosen with the
    other ops' forms by the one `flashrt.ops.select` pass of ``reset_derived``."""
    prefix = LAYOUT_PREFIXES[detect_layout(checkpoint.keys())]
    wmap = pi0_weight_map(config, prefix, keep_fp32)
    return load_module(lambda: Pi0Model(config, kernels), checkpoint, wmap, device, dtype)
