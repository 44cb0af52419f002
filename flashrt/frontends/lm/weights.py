"""transformers causal-LM checkpoint -> `flashrt.nn.llama.Llama` weight map (strict).

Source layout (``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` ``save_pretrained``):
``model.embed_tokens.weight``, ``model.layers.{i}.{input_layernorm, post_attention_layernorm}.weight``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight[, bias]}``, Qwen3's
``model.layers.{i}.self_attn.{q,k}_norm.weight``, ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``,
``model.norm.weight``, ``lm_head.weight`` (absent, or equal to the embedding, when tied).

Transforms (checked against transformers in tests/frontends/lm/test_lm.py): q|k|v weights (and biases)
concatenated along the output dim into ``qkv``; gate|up into ``gate_up``. A tied checkpoint that still
stores ``lm_head.weight`` has it ignored (the embedding is used), as transformers does.
"""

from __future__ import annotations

from flashrt.frontends.lm.config import LMConfig
from flashrt.io import Rule, WeightMap, transforms

__all__ = ["weight_map"]

_CAT = transforms.concat(0)


def weight_map(cfg: LMConfig) -> WeightMap:
    src, dst = "model.layers.{i}.", "layers.{i}."
    att = src + "self_attn."
    rules = [
        Rule("model.embed_tokens.weight", "embed.weight"),
        Rule("model.norm.weight", "norm.weight"),
        Rule(src + "input_layernorm.weight", dst + "input_norm.weight"),
        Rule(src + "post_attention_layernorm.weight", dst + "post_norm.weight"),
        Rule(tuple(att + f"{n}_proj.weight" for n in "qkv"), dst + "qkv.weight", _CAT),
        Rule(att + "o_proj.weight", dst + "o.weight"),
        Rule((src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"), dst + "gate_up.weight", _CAT),
        Rule(src + "mlp.down_proj.weight", dst + "down.weight"),
    ]
    if cfg.qkv_bias:
        rules.append(Rule(tuple(att + f"{n}_proj.bias" for n in "qkv"), dst + "qkv.bias", _CAT))
    if cfg.o_bias:
        rules.append(Rule(att + "o_proj.bias", dst + "o.bias"))
    if cfg.qk_norm:
        rules += [Rule(att + "q_norm.weight", dst + "q_norm.weight"),
                  Rule(att + "k_norm.weight", dst + "k_norm.weight")]
    ignore = ["lm_head.weight"] if cfg.tied else []
    if not cfg.tied:
        rules.append(Rule("lm_head.weight", "head.weight"))
    return WeightMap(rules, ignore)
