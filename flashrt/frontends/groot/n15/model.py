"""GR00T N1.5 (lerobot 0.5.1 layout): Eagle 2.5-VL backbone (SigLIP + pixel shuffle + MLP projector + Qwen3
layers) and the plain-DiT flow-matching head with ``future_tokens``. Model level: token ids, normalized
pixels, normalized state in; the normalized action chunk out.

Shape legend: I images, R image side, P patch, g = (R/P)² patches, n = g / 4 tokens per image after the
0.5 pixel shuffle, C SigLIP width, W text width, L tokens, T horizon, A max_action_dim.

What the reference (lerobot 0.5.1 ``GR00TN15.get_action``, run with transformers 5.5) computes:

* Vision: SigLIP's last hidden state (after ``post_layernorm``; the pooling head is unused), the
  (R/P)² grid pixel-shuffled by 0.5 (four neighbouring patches → one 4C token, in the reference's
  view/permute order) and ``mlp1`` (LayerNorm → Linear → GELU → Linear, or one Linear).
* The image tokens' embeddings are replaced by the projected vision tokens; Qwen3 layers up to
  ``select_layer`` with 1-D RoPE, causal. The feature is ``hidden_states[select_layer]``, which for the
  popped stack is the FINAL-NORM output (unlike N1.7, which reads the pre-norm layer output).
* Head: as N1.7's (`model.ActionHead`) with ``future_tokens`` between the state token and the actions,
  and every cross-attention block over all tokens (the padding of flashrt's buckets is masked).

The backbone sizes are not in the checkpoint's config.json: lerobot reads the Eagle config from its
processor cache (``lerobot/eagle2hg-processor-groot-n1p5``); flashrt reads ``backbone/config.json``
in the checkpoint folder (or the path given as ``backbone=``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from flashrt.errors import CheckpointError
from flashrt.frontends.groot.common.checkpoint import read_json
from flashrt.frontends.groot.common.config import HeadConfig, head_config
from flashrt.frontends.groot.common.head import ActionHead, select_ops
from flashrt.frontends.groot.common.weights import head_rules, popped_layers, qwen3_layer_rules
from flashrt.frontends.groot.n16.model import (
    EagleSizes,
    check_qwen3,
    eagle_sizes,
    mlp1_rules,
    siglip_layer_rules,
)
from flashrt.io import Rule, WeightMap, load_module
from flashrt.nn.norms import RMSNorm
from flashrt.nn.qwen3vl import qwen3_layer
from flashrt.nn.rope import rope_cos_sin
from flashrt.nn.siglip import Siglip

N15_MODEL_TYPE = "gr00t_n1_5"


@dataclass(frozen=True)
class EagleConfig(EagleSizes):
    image_size: int
    mlp_layers: int  # mlp_connector_layers: 1 or 2

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch) ** 2 // 4


@dataclass(frozen=True)
class GrootN15Config:
    eagle: EagleConfig
    head: HeadConfig


def eagle_config(bb: dict[str, Any], select_layer: int, where: str) -> EagleConfig:
    v, t = bb.get("vision_config") or {}, bb.get("text_config") or {}
    if v.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise CheckpointError(f"{where}: vision model {v.get('model_type')!r} is not supported (SigLIP only)")
    if not bb.get("use_pixel_shuffle", True) or float(bb.get("downsample_ratio", 0.5)) != 0.5:
        raise CheckpointError(f"{where}: only the 0.5 pixel shuffle is supported")
    if int(bb.get("select_layer", -1)) != -1:
        raise CheckpointError(f"{where}: only the vision tower's last layer (select_layer -1) is supported")
    check_qwen3(t, where)
    try:
        return EagleConfig(
            **eagle_sizes(bb, select_layer),
            image_size=int(bb.get("force_image_size") or v["image_size"]),
            mlp_layers=int(bb.get("mlp_connector_layers", 2)),
        )
    except KeyError as exc:
        raise CheckpointError(f"{where}: field {exc.args[0]!r} missing") from None


def n15_config(
    folder: Path, backbone: str | Path | None = None, num_steps: int | None = None
) -> GrootN15Config:
    """The config of the N1.5 checkpoint in ``folder``; the Eagle config from ``backbone`` (a config.json
    or its folder), else ``folder/backbone/config.json``."""
    g = read_json(folder / "config.json")
    if g.get("model_type") != N15_MODEL_TYPE:
        raise CheckpointError(
            f"{folder / 'config.json'}: model_type {g.get('model_type')!r} is not "
            f"{N15_MODEL_TYPE!r} (GR00T N1.5)"
        )
    bcfg, hcfg = g.get("backbone_cfg") or {}, dict(g.get("action_head_cfg") or {})
    if bcfg.get("project_to_dim") is not None or bcfg.get("reproject_vision"):
        raise CheckpointError(
            f"{folder / 'config.json'}: backbone_cfg.project_to_dim / reproject_vision are not supported"
        )
    path = Path(backbone) if backbone is not None else folder / "backbone"
    path = path / "config.json" if path.is_dir() or not path.suffix else path
    eagle = eagle_config(read_json(path), int(bcfg.get("select_layer", 12)), str(path))
    hcfg.setdefault("max_action_dim", hcfg.get("action_dim"))
    head = head_config(
        {
            **hcfg,
            "model_name": "",
            "use_alternate_vl_dit": True,
            "diffusion_model_cfg": {**hcfg["diffusion_model_cfg"], "interleave_self_attention": True},
        },
        str(folder / "config.json"),
        num_steps,
    )
    if not hcfg["diffusion_model_cfg"].get("interleave_self_attention", False):
        raise CheckpointError(
            f"{folder / 'config.json'}: only the interleaved self-attention DiT is supported"
        )
    return GrootN15Config(
        eagle, replace(head, future_tokens=int(hcfg.get("num_target_vision_tokens", 32)), alternate=False)
    )


class EagleBackbone(nn.Module):
    """SigLIP → pixel shuffle → mlp1 → Qwen3 layers → final norm: (I, 3, R, R) + (1, L) ids -> (1, L, W)."""

    def __init__(self, c: EagleConfig) -> None:
        super().__init__()
        self.config = c
        self.vision = Siglip(
            c.vision_width, c.vision_depth, c.vision_mlp, c.vision_heads, c.patch, c.image_size
        )
        merged = 4 * c.vision_width
        if c.mlp_layers == 2:
            self.mlp_norm = nn.LayerNorm(merged, eps=1e-5)
            self.mlp_fc1, self.mlp_fc2 = (
                nn.Linear(merged, c.text_width),
                nn.Linear(c.text_width, c.text_width),
            )
        else:
            self.mlp_fc1 = nn.Linear(merged, c.text_width)
        self.embed = nn.Embedding(c.vocab, c.text_width)
        self.layers = nn.ModuleList(
            qwen3_layer(c.text_width, c.text_mlp, c.heads, c.kv_heads, c.head_dim, c.eps)
            for _ in range(c.layers)
        )
        self.norm = RMSNorm(c.text_width, c.eps, offset=False)  # Qwen3's final norm, float32 product

    def vision_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """(I, 3, R, R) -> (I, n, W)."""
        x = self.vision.forward(pixels)  # (I, g, C)
        i, g, c = x.shape
        side = int(round(g**0.5))
        x = x.reshape(i, side, side, c)  # the reference's pixel_shuffle(scale 0.5), op for op
        x = x.view(i, side, side // 2, c * 2).permute(0, 2, 1, 3).reshape(i, side // 2, side // 2, c * 4)
        x = x.permute(0, 2, 1, 3).reshape(i, -1, c * 4)
        if self.config.mlp_layers == 2:
            x = F.gelu(self.mlp_fc1.forward(self.mlp_norm.forward(x)))
            return self.mlp_fc2.forward(x)
        return self.mlp_fc1.forward(x)

    def forward(
        self,
        pixels: torch.Tensor,
        tokens: torch.Tensor,
        image_slots: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        vis = self.vision_tokens(pixels)
        h = self.embed.weight[tokens].index_copy_(1, image_slots, vis.reshape(1, -1, vis.shape[-1]))
        for layer in self.layers:
            h = layer.forward(h, (cos, sin))
        return self.norm.forward(h)


class GrootN15Model(nn.Module):
    def __init__(self, config: GrootN15Config) -> None:
        super().__init__()
        self.config = config
        self.backbone = EagleBackbone(config.eagle)
        self.head = ActionHead(config.head)

    def reset_derived(self) -> None:
        """After the submodules' derived tables (`flashrt.io.reset_derived`, at load): the forms of the
        ops, in the one `flashrt.ops.select` pass (`select_ops`)."""
        self.op_choices = select_ops(self)

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.embed.weight.dtype

    def tables(self, length: int) -> dict[str, torch.Tensor]:
        """RoPE tables for positions 0..length-1 and the flow-matching step tables."""
        e, dev = self.config.eagle, self.backbone.embed.weight.device
        cos, sin = rope_cos_sin(torch.arange(length, device=dev)[None], e.head_dim, e.theta, self.dtype)
        with torch.no_grad():
            steps = self.head.step_tables(self.config.head.num_steps)
        return {"cos": cos, "sin": sin, "steps": steps}

    def sample_actions(
        self,
        pixels: torch.Tensor,
        tokens: torch.Tensor,
        token_mask: torch.Tensor,
        image_slots: torch.Tensor,
        state: torch.Tensor,
        noise: torch.Tensor,
        out: torch.Tensor,
        tables: dict[str, Any],
        embodiment: int,
    ) -> None:
        """Writes the normalized chunk (1, T, A) into ``out``; ``image_slots`` (I*n,) image-token indices."""
        features = self.backbone(pixels, tokens, image_slots, tables["cos"], tables["sin"])
        self.head.sample(features, token_mask, None, state, noise, out, tables["steps"], embodiment)


# ---------------------------------------------------------------------------------------- weights
VIS = "backbone.eagle_model.vision_model.vision_model."
LM = "backbone.eagle_model.language_model.model."


def _rules(c: GrootN15Config) -> list[Rule]:
    rules = [
        Rule(VIS + "embeddings.patch_embedding.{p}", "backbone.vision.patch.{p}"),
        Rule(VIS + "embeddings.position_embedding.weight", "backbone.vision.pos"),
        Rule(VIS + "post_layernorm.{p}", "backbone.vision.post_norm.{p}"),
        *siglip_layer_rules(VIS),
    ]
    mlp = "backbone.eagle_model.mlp1."
    if c.eagle.mlp_layers == 2:
        rules += mlp1_rules(mlp)
    else:
        rules += [Rule(mlp + "0.{p}", "backbone.mlp_fc1.{p}")]
    rules += [
        Rule(LM + "embed_tokens.weight", "backbone.embed.weight"),
        Rule(LM + "norm.weight", "backbone.norm.weight"),
    ]
    rules += qwen3_layer_rules(LM + "layers.{i}.", "backbone.layers.{i}.")
    return [*rules, *head_rules(), Rule("action_head.future_tokens.weight", "head.future_tokens.weight")]


def n15_weight_map(config: GrootN15Config, keys: list[str]) -> WeightMap:
    """Strict map. Unused on purpose: SigLIP's pooling ``head.*``, the LM head, decoder layers at or beyond
    select_layer (lerobot pops them; a file that keeps them loads the same)."""
    raw, keys = list(keys), [k.removeprefix("_groot_model.") for k in keys]
    ignore = [
        VIS + "head.*",
        "backbone.eagle_model.language_model.lm_head.weight",
        *popped_layers(keys, LM, config.eagle.layers),
    ]
    return WeightMap(_rules(config), ignore=ignore).auto_prefix(raw, ("", "_groot_model."))


def load_n15(
    config: GrootN15Config,
    checkpoint: Any,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> GrootN15Model:
    return load_module(
        lambda: GrootN15Model(config), checkpoint, n15_weight_map(config, list(checkpoint)), device, dtype
    )
