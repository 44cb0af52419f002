"""GR00T weight rules over the N1.7 checkpoint layout (``GR00TN17.save_pretrained`` keys), shared by every
version: N1.7's map and loader are `flashrt.frontends.groot.n17.weights`.

Every rule is a rename; there are no value transforms (the temporal patch kernel is folded in
`VisionTower.reset_derived`). Checked against lerobot 0.6.1 (tests/frontends/groot parity).
Deliberately unused: the text model's final ``norm`` (N1.7 reads the pre-norm features), a stored
``lm_head`` (tied upstream, never decoded; it stands in for the embedding when a lerobot policy file
stored only it), and decoder layers at or beyond ``select_layer`` (lerobot
pops them before saving; a file that still has them loads the same). The lerobot policy state dict
prefixes every key with ``_groot_model.``; that prefix is accepted too.
"""

from __future__ import annotations

from flashrt.io import Alt, Rule, transforms

VIS = "backbone.model.model.visual."
LM = "backbone.model.model.language_model."
HEAD = "action_head."
DIT = HEAD + "model."


def vision_rules() -> list[Rule]:
    blk, dst = VIS + "blocks.{i}.", "vision.blocks.{i}."
    rules = [
        Rule(VIS + "patch_embed.proj.{p}", "vision.patch_proj.{p}"),
        Rule(VIS + "pos_embed.weight", "vision.pos_embed.weight"),
    ]
    rules += [
        Rule(blk + s + ".{p}", dst + d + ".{p}")
        for s, d in (
            ("norm1", "norm1"),
            ("norm2", "norm2"),
            ("attn.qkv", "qkv"),
            ("attn.proj", "proj"),
            ("mlp.linear_fc1", "fc1"),
            ("mlp.linear_fc2", "fc2"),
        )
    ]
    for src, dst_m in (
        (VIS + "merger.", "vision.merger."),
        (VIS + "deepstack_merger_list.{k}.", "vision.deepstack_mergers.{k}."),
    ):
        rules += [
            Rule(src + s + ".{p}", dst_m + d + ".{p}")
            for s, d in (("norm", "norm"), ("linear_fc1", "fc1"), ("linear_fc2", "fc2"))
        ]
    return rules


def qwen3_layer_rules(src: str, dst: str) -> list[Rule]:
    """A transformers Qwen3 decoder layer at ``src`` (e.g. ``...layers.{i}.``) -> `qwen3_layer` (the
    one decoder layer, `flashrt.nn.llama.DecoderLayer`) at ``dst``: q|k|v and gate|up concatenated."""
    att, cat = src + "self_attn.", transforms.concat(0)
    return [
        Rule(tuple(att + f"{n}_proj.weight" for n in "qkv"), dst + "qkv.weight", cat),
        Rule(att + "o_proj.weight", dst + "o.weight"),
        Rule((src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"), dst + "gate_up.weight", cat),
        Rule(src + "mlp.down_proj.weight", dst + "down.weight"),
        Rule(att + "q_norm.weight", dst + "q_norm.weight"),
        Rule(att + "k_norm.weight", dst + "k_norm.weight"),
        Rule(src + "input_layernorm.weight", dst + "input_norm.weight"),
        Rule(src + "post_attention_layernorm.weight", dst + "post_norm.weight"),
    ]


def popped_layers(keys: list[str], lm: str, kept: int) -> list[str]:
    """Ignore patterns for the decoder layers under ``lm`` at or beyond ``kept`` (the reference pops them
    before saving; a file that still has them loads the same)."""
    prefix = lm + "layers."
    ids = {k.removeprefix(prefix).split(".")[0] for k in keys if k.startswith(prefix)}
    return [prefix + f"{i}.*" for i in sorted(ids) if int(i) >= kept]


def text_rules() -> list[Rule]:
    # tied: lerobot's policy files keep only the LM head when the two share storage
    rules = [Rule(Alt(LM + "embed_tokens.weight", "backbone.model.lm_head.weight"), "embed.weight")]
    return rules + qwen3_layer_rules(LM + "layers.{i}.", "layers.{i}.")


def _block_rules(src: str, dst: str, ada: bool) -> list[Rule]:
    rules = [Rule(src + f"attn1.to_{n}.{{p}}", dst + f"to_{n}.{{p}}") for n in "qkv"]
    rules += [
        Rule(src + "attn1.to_out.0.{p}", dst + "to_out.{p}"),
        Rule(src + "ff.net.0.proj.{p}", dst + "ff_in.{p}"),
        Rule(src + "ff.net.2.{p}", dst + "ff_out.{p}"),
    ]
    if ada:
        return [*rules, Rule(src + "norm1.linear.{p}", dst + "norm1_linear.{p}")]
    return [*rules, Rule(src + "norm1.{p}", dst + "norm1.{p}"), Rule(src + "norm3.{p}", dst + "norm3.{p}")]


def head_rules() -> list[Rule]:
    rules = [
        *_block_rules(DIT + "transformer_blocks.{i}.", "head.blocks.{i}.", ada=True),
        *_block_rules(HEAD + "vl_self_attention.transformer_blocks.{i}.", "head.vl_blocks.{i}.", ada=False),
        Rule(DIT + "timestep_encoder.timestep_embedder.linear_1.{p}", "head.time_1.{p}"),
        Rule(DIT + "timestep_encoder.timestep_embedder.linear_2.{p}", "head.time_2.{p}"),
        Rule(DIT + "proj_out_1.{p}", "head.proj_out_1.{p}"),
        Rule(DIT + "proj_out_2.{p}", "head.proj_out_2.{p}"),
        Rule(HEAD + "vlln.{p}", "head.vlln.{p}"),
        Rule(HEAD + "position_embedding.weight", "head.position_embedding.weight"),
    ]
    for mlp in ("state_encoder", "action_decoder"):
        rules += [Rule(HEAD + f"{mlp}.layer{{n}}.{{p}}", f"head.{mlp}.layer{{n}}.{{p}}")]
    return [*rules, Rule(HEAD + "action_encoder.W{n}.{p}", "head.action_w{n}.{p}")]
