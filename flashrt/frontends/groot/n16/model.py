"""GR00T N1.6 (Isaac-GR00T layout): the Eagle 3 VL backbone and the N1.6 action head, as one module.

Shape legend: I images, R x Q image size (multiples of 2P), P patch side (14), gh x gw = (R/P) x (Q/P)
patches, n = gh * gw / 4 tokens per image after the pixel unshuffle, C SigLIP2 width, W text width,
L tokens, T horizon, A max_action_dim.

What Isaac-GR00T's N1.6 computes (``gr00t/model/gr00t_n1d6``, ``modules/eagle_backbone.py`` and the
Eagle-Block2A-2B-v2 model code), and how it is arranged here:

* Vision: SigLIP2 on each image's own patches (`flashrt.nn.siglip2`): a Linear over (row, column,
  channel) patches, the learned position grid resized to gh x gw, encoder layers whose attention stays
  inside one image, the post LayerNorm; the pooling ``head`` is unused. The reference cuts the patches
  into ``window_size`` windows and restores the row-major order after the post LayerNorm; with
  windowed attention and 2-D RoPE off (``use_windows_attn`` / ``use_rope`` false, as
  Eagle-Block2A-2B-v2 ships) every layer attends over the whole image, so that order is a permutation
  that cancels and the tower runs row-major here. A checkpoint turning either on is refused.
* Pixel unshuffle (``downsample_ratio`` 0.5, `pixel_unshuffle_tokens`): the (C, gh, gw) map becomes
  (4C, gh/2, gw/2) with channel ``4c + 2i + j`` holding the patch at row offset i, column offset j of
  its 2 x 2 block (torch's ``pixel_unshuffle``); tokens row-major.
* ``mlp1``: LayerNorm(4C) → Linear(4C, W) → GELU (erf) → Linear(W, W).
* The ``<IMG_CONTEXT>`` tokens' embeddings are replaced by the projected image tokens, image after
  image; the Qwen3 layers kept (``select_layer``; the rest are popped) run causal with 1-D RoPE on
  positions 0..L-1. The feature is ``hidden_states[-1]`` of the popped stack: the FINAL-NORM output
  (as N1.5; N1.7 reads the pre-norm output of its last layer).
* Head: `flashrt.frontends.groot.common.head.ActionHead` without VL self-attention (``Gr00tN1d6ActionHead``
  is the N1.7 head without it; parity in tests/frontends/groot/n16/test_head.py), AlternateVLDiT
  cross blocks over text / image keys (image keys = the ``<IMG_CONTEXT>`` positions).

Sizes: ``config.json`` (model_type ``Gr00tN1d6``) holds the head and ``select_layer``; the backbone's
sizes come from ``model_name``: ``nvidia/Eagle-Block2A-2B-v2`` (the published backbone, whose config is
the built-in `EAGLE_BLOCK2A_2B`, as Isaac-GR00T ships it inside its package) or a local folder with an
Eagle 3 VL ``config.json`` (relative paths resolve against the checkpoint folder; ``backbone/``
is the fallback).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from flashrt.errors import CheckpointError
from flashrt.frontends.groot.common.config import QWEN3_2B_TEXT, HeadConfig, head_config
from flashrt.frontends.groot.common.head import ActionHead, select_ops
from flashrt.frontends.groot.common.weights import head_rules, popped_layers, qwen3_layer_rules
from flashrt.io import Alt, Rule, WeightMap, load_module, transforms
from flashrt.io.files import read_json
from flashrt.nn.norms import RMSNorm
from flashrt.nn.qwen3vl import qwen3_layer
from flashrt.nn.rope import rope_cos_sin
from flashrt.nn.siglip2 import Siglip2Vision

N16_MODEL_TYPE = "Gr00tN1d6"
EAGLE3_NAME = "nvidia/Eagle-Block2A-2B-v2"

EAGLE_BLOCK2A_2B: dict[str, Any] = {  # Isaac-GR00T's Eagle-Block2A-2B-v2/config.json, the fields read
    "model_type": "eagle_3_vl",
    "downsample_ratio": 0.5,
    "image_token_index": 151669,
    "select_layer": -1,
    "use_pixel_shuffle": True,
    "text_config": {
        "architectures": ["Qwen3ForCausalLM"],
        **QWEN3_2B_TEXT,
        "rope_theta": 1000000,
        "vocab_size": 151680,
    },
    "vision_config": {
        "model_type": "siglip2_vision_model",
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "layer_norm_eps": 1e-6,
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "num_patches": 256,
        "patch_size": 14,
        "use_rope": False,
        "use_windows_attn": False,
    },
}


@dataclass(frozen=True)
class EagleSizes:
    """The fields Eagle 2.5 (N1.5) and Eagle 3 (N1.6) configs share (`eagle_sizes` reads them)."""

    vision_width: int
    vision_depth: int
    vision_mlp: int
    vision_heads: int
    patch: int
    text_width: int
    text_mlp: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int  # kept layers (select_layer)
    vocab: int
    eps: float
    theta: float
    image_token: int


@dataclass(frozen=True)
class Eagle3Config(EagleSizes):
    num_patches: int  # the learned position grid (a square)
    vision_eps: float

    @property
    def factor(self) -> int:
        """Image sides are multiples of this (patch x the 2 x 2 unshuffle)."""
        return 2 * self.patch

    def tokens_per_image(self, size: tuple[int, int]) -> int:
        return (size[0] // self.factor) * (size[1] // self.factor)


@dataclass(frozen=True)
class GrootN16Config:
    eagle: Eagle3Config
    head: HeadConfig


def _check_vision(v: dict[str, Any], bb: dict[str, Any], where: str) -> None:
    if v.get("model_type") != "siglip2_vision_model":
        raise CheckpointError(
            f"{where}: vision model {v.get('model_type')!r} is not supported (SigLIP2 only)"
        )
    if v.get("use_rope", True) or v.get("use_windows_attn", True):
        raise CheckpointError(
            f"{where}: a SigLIP2 tower with 2-D RoPE or windowed attention (use_rope / use_windows_attn) "
            "is not supported; Eagle-Block2A-2B-v2 has both off"
        )
    if not bb.get("use_pixel_shuffle", True) or float(bb.get("downsample_ratio", 0.5)) != 0.5:
        raise CheckpointError(f"{where}: only the 0.5 pixel unshuffle is supported")
    if int(bb.get("select_layer", -1)) != -1:
        raise CheckpointError(f"{where}: only the vision tower's last layer (select_layer -1) is supported")


def check_qwen3(t: dict[str, Any], where: str) -> None:
    if (t.get("architectures") or ["Qwen3ForCausalLM"])[0] != "Qwen3ForCausalLM":
        raise CheckpointError(f"{where}: only a Qwen3 language model is supported")


def eagle_sizes(bb: dict[str, Any], select_layer: int) -> dict[str, Any]:
    """The fields Eagle 2.5 (N1.5) and Eagle 3 (N1.6) configs share: the SigLIP tower's and the Qwen3
    model's sizes, ``select_layer`` kept layers, the image token (a missing field raises KeyError)."""
    v, t = bb.get("vision_config") or {}, bb.get("text_config") or {}
    return {
        "vision_width": int(v["hidden_size"]),
        "vision_depth": int(v["num_hidden_layers"]),
        "vision_mlp": int(v["intermediate_size"]),
        "vision_heads": int(v["num_attention_heads"]),
        "patch": int(v["patch_size"]),
        "text_width": int(t["hidden_size"]),
        "text_mlp": int(t["intermediate_size"]),
        "heads": int(t["num_attention_heads"]),
        "kv_heads": int(t["num_key_value_heads"]),
        "head_dim": int(t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]),
        "layers": int(select_layer),
        "vocab": int(t["vocab_size"]),
        "eps": float(t.get("rms_norm_eps", 1e-6)),
        "theta": float(t.get("rope_theta", 1e6)),
        "image_token": int(bb["image_token_index"]),
    }


def eagle3_config(bb: dict[str, Any], select_layer: int, where: str) -> Eagle3Config:
    """The `Eagle3Config` of an Eagle 3 VL config dict, keeping ``select_layer`` text layers."""
    v, t = bb.get("vision_config") or {}, bb.get("text_config") or {}
    _check_vision(v, bb, where)
    check_qwen3(t, where)
    try:
        layers = int(t["num_hidden_layers"])
        if not 0 < select_layer <= layers:
            raise CheckpointError(f"{where}: select_layer {select_layer} is not in 1..{layers}")
        return Eagle3Config(
            **eagle_sizes(bb, select_layer),
            num_patches=int(v.get("num_patches", 256)),
            vision_eps=float(v.get("layer_norm_eps", 1e-6)),
        )
    except KeyError as exc:
        raise CheckpointError(f"{where}: field {exc.args[0]!r} missing") from None


def backbone_source(folder: Path, model_name: str) -> tuple[dict[str, Any], Path | None]:
    """The Eagle 3 VL config dict named by ``model_name`` and its folder (None: the built-in preset)."""
    if str(model_name).rstrip("/") == EAGLE3_NAME:
        return EAGLE_BLOCK2A_2B, None
    path = Path(model_name)
    path = path if path.is_absolute() else folder / path
    for candidate in (path, folder / "backbone"):
        if (candidate / "config.json").is_file():
            return read_json(candidate / "config.json", "GR00T N1.6 backbone config"), candidate
    raise CheckpointError(
        f"{folder / 'config.json'}: field 'model_name' = {model_name!r} is neither {EAGLE3_NAME!r} nor a "
        "folder with an Eagle 3 VL config.json"
    )


def _n16_head(g: dict[str, Any], where: str, num_steps: int | None) -> HeadConfig:
    if (g.get("vl_self_attention_cfg") or {}).get("num_layers"):
        raise CheckpointError(f"{where}: an N1.6 head has no vl_self_attention")
    for flag in ("use_vlln", "add_pos_embed"):
        if not g.get(flag, True):
            raise CheckpointError(f"{where}: {flag} = false is not supported")
    return replace(head_config(g, where, num_steps), vl_layers=0)


def n16_config(
    folder: Path, g: dict[str, Any], num_steps: int | None = None
) -> tuple[GrootN16Config, Path | None]:
    """The config of the N1.6 checkpoint in ``folder`` (``g`` = its config.json) and the backbone folder."""
    where = str(folder / "config.json")
    if g.get("model_type") != N16_MODEL_TYPE:
        raise CheckpointError(f"{where}: model_type {g.get('model_type')!r} is not {N16_MODEL_TYPE!r}")
    if g.get("reproject_vision"):
        raise CheckpointError(f"{where}: reproject_vision is not supported")
    bb, bb_dir = backbone_source(folder, str(g.get("model_name", EAGLE3_NAME)))
    eagle = eagle3_config(bb, int(g.get("select_layer", 16)), str((bb_dir or folder) / "config.json"))
    head = _n16_head(g, where, num_steps)
    if head.backbone_dim != eagle.text_width:
        raise CheckpointError(
            f"{where}: backbone_embedding_dim {head.backbone_dim} != the language model's width "
            f"{eagle.text_width}"
        )
    return GrootN16Config(eagle, head), bb_dir


# ------------------------------------------------------------------------------------------ model
def pixel_unshuffle_tokens(x: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
    """(I, gh * gw, C) row-major patch tokens -> (I, gh/2 * gw/2, 4C): the 2 x 2 block at (r, c) becomes
    token r * gw/2 + c with channel ``4k + 2i + j`` = channel k of the patch (2r + i, 2c + j)."""
    i, _, c = x.shape
    x = x.view(i, gh // 2, 2, gw // 2, 2, c).permute(0, 1, 3, 5, 2, 4)  # (I, gh/2, gw/2, C, 2, 2)
    return x.reshape(i, (gh // 2) * (gw // 2), 4 * c)


class Eagle3Backbone(nn.Module):
    """SigLIP2 → pixel unshuffle → mlp1 → Qwen3 layers → final norm: (I, 3, R, Q) + (1, L) -> (1, L, W)."""

    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.config = c
        self.vision = Siglip2Vision(
            c.vision_width, c.vision_depth, c.vision_mlp, c.vision_heads, c.patch, c.num_patches, c.vision_eps
        )
        merged = 4 * c.vision_width
        self.mlp_norm = nn.LayerNorm(merged, eps=1e-5)
        self.mlp_fc1, self.mlp_fc2 = nn.Linear(merged, c.text_width), nn.Linear(c.text_width, c.text_width)
        self.embed = nn.Embedding(c.vocab, c.text_width)
        self.layers = nn.ModuleList(
            qwen3_layer(c.text_width, c.text_mlp, c.heads, c.kv_heads, c.head_dim, c.eps)
            for _ in range(c.layers)
        )
        self.norm = RMSNorm(c.text_width, c.eps, offset=False)  # Qwen3's final norm, float32 product

    def vision_tokens(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(I, 3, R, Q) normalized pixels, ``positions`` (g, C) of `Siglip2Vision.position_table` ->
        (I, n, W) projected image tokens."""
        p = self.config.patch
        x = self.vision.forward(pixels, positions)  # (I, g, C)
        x = pixel_unshuffle_tokens(x, pixels.shape[-2] // p, pixels.shape[-1] // p)
        x = F.gelu(self.mlp_fc1.forward(self.mlp_norm.forward(x)))
        return self.mlp_fc2.forward(x)

    def forward(
        self, vision: torch.Tensor, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """vision (1, S, W) projected image tokens in prompt order; tokens (1, L) holding exactly S
        ``<IMG_CONTEXT>`` ids; cos/sin (1, L, 1, D) -> final-norm features (1, L, W).

        The k-th image token of the prompt takes ``vision[:, k]`` (k = running count of image tokens - 1):
        fixed shapes, no host sync, wherever the prompt puts the images (N1.6's chat template puts
        them after the prompt text, so their slots move with the prompt's length)."""
        is_image = tokens == self.config.image_token  # (1, L)
        k = (is_image.cumsum(-1) - 1).clamp_(min=0)
        h = torch.where(is_image[..., None], vision[:, k[0]], self.embed.weight[tokens])
        for layer in self.layers:
            h = layer.forward(h, (cos, sin))
        return self.norm.forward(h)


@dataclass
class N16Plan:
    """Constants of one (image size, bucket) layout: RoPE tables for positions 0..L-1, the SigLIP2
    position table, the flow-matching step tables, the embodiment."""

    cos: torch.Tensor  # (1, L, 1, D)
    sin: torch.Tensor
    positions: torch.Tensor  # (g, C)
    steps: dict[str, torch.Tensor]
    embodiment: int


class GrootN16Model(nn.Module):
    """Eagle 3 VL backbone + the N1.6 head; `sample_actions` is the whole captured step."""

    def __init__(self, config: GrootN16Config) -> None:
        super().__init__()
        self.config = config
        self.backbone = Eagle3Backbone(config.eagle)
        self.head = ActionHead(config.head)

    def reset_derived(self) -> None:
        """After the submodules' derived tables (`flashrt.io.reset_derived`, at load): the forms of the
        ops, in the one `flashrt.ops.select` pass (`select_ops`)."""
        self.op_choices = select_ops(self)

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.backbone.embed.weight.device

    def tokens_per_image(self, size: tuple[int, int]) -> int:
        return self.config.eagle.tokens_per_image(size)

    def plan(self, bucket: int, size: tuple[int, int], embodiment: int) -> N16Plan:
        e, dev = self.config.eagle, self.device
        cos, sin = rope_cos_sin(torch.arange(bucket, device=dev)[None], e.head_dim, e.theta, self.dtype)
        with torch.no_grad():
            positions = self.backbone.vision.position_table(size[0] // e.patch, size[1] // e.patch)
            steps = self.head.step_tables(self.config.head.num_steps)
        return N16Plan(cos, sin, positions, steps, int(embodiment))

    def features(self, pixels: torch.Tensor, tokens: torch.Tensor, plan: N16Plan) -> torch.Tensor:
        """pixels (I, 3, R, Q) in prompt order, tokens (1, L) -> backbone features (1, L, W)."""
        vis = self.backbone.vision_tokens(pixels, plan.positions)  # (I, n, W)
        return self.backbone(vis.reshape(1, -1, vis.shape[-1]), tokens, plan.cos, plan.sin)

    def sample_actions(
        self,
        pixels: torch.Tensor,
        tokens: torch.Tensor,
        token_mask: torch.Tensor,
        state: torch.Tensor,
        noise: torch.Tensor,
        out: torch.Tensor,
        plan: N16Plan,
    ) -> None:
        """pixels (I, 3, R, Q); tokens / token_mask (1, L); state (1, 1, S); noise / out (1, T, A).
        Image keys of the AlternateVLDiT = the ``<IMG_CONTEXT>`` positions (as Isaac-GR00T's
        ``image_mask``). Writes the normalized chunk into ``out``."""
        features = self.features(pixels, tokens, plan)
        image_keys = (tokens == self.config.eagle.image_token)[:, None, None, :]
        self.head.sample(features, token_mask, image_keys, state, noise, out, plan.steps, plan.embodiment)


# ---------------------------------------------------------------------------------------- weights
VIS = "backbone.model.vision_model.vision_model."
LM = "backbone.model.language_model.model."
LM_HEAD = "backbone.model.language_model.lm_head.weight"


def siglip_layer_rules(vis: str) -> list[Rule]:
    """The SigLIP / SigLIP2 encoder layers under ``vis`` -> ``backbone.vision.layers`` (q, k, v fused)."""
    enc, dst = vis + "encoder.layers.{i}.", "backbone.vision.layers.{i}."
    rules = [
        Rule(enc + "self_attn.out_proj.{p}", dst + "o.{p}"),
        Rule(tuple(enc + f"self_attn.{n}_proj.{{p}}" for n in "qkv"), dst + "qkv.{p}", transforms.concat(0)),
    ]
    pairs = (("layer_norm1", "norm1"), ("layer_norm2", "norm2"), ("mlp.fc1", "fc1"), ("mlp.fc2", "fc2"))
    return rules + [Rule(enc + f"{s}.{{p}}", dst + f"{d}.{{p}}") for s, d in pairs]


def mlp1_rules(mlp: str) -> list[Rule]:
    """The two-layer ``mlp1`` projector (LayerNorm, Linear, GELU, Linear) under ``mlp``."""
    return [
        Rule(mlp + "0.{p}", "backbone.mlp_norm.{p}"),
        Rule(mlp + "1.{p}", "backbone.mlp_fc1.{p}"),
        Rule(mlp + "3.{p}", "backbone.mlp_fc2.{p}"),
    ]


def _vision_rules() -> list[Rule]:
    return [
        Rule(VIS + "embeddings.patch_embedding.{p}", "backbone.vision.patch_embedding.{p}"),
        Rule(VIS + "embeddings.position_embedding.weight", "backbone.vision.position_embedding.weight"),
        Rule(VIS + "post_layernorm.{p}", "backbone.vision.post_norm.{p}"),
        *siglip_layer_rules(VIS),
        *mlp1_rules("backbone.model.mlp1."),
    ]


def _text_rules() -> list[Rule]:
    rules = [  # tied: Isaac-GR00T's files keep the embedding; a file keeping only the LM head loads the same
        Rule(Alt(LM + "embed_tokens.weight", LM_HEAD), "backbone.embed.weight"),
        Rule(LM + "norm.weight", "backbone.norm.weight"),
    ]
    return rules + qwen3_layer_rules(LM + "layers.{i}.", "backbone.layers.{i}.")


def n16_weight_map(config: GrootN16Config, keys: list[str]) -> WeightMap:
    """Strict map of a ``Gr00tN1d6`` state dict. Unused on purpose: SigLIP2's pooling ``head.*``, the
    tied LM head, decoder layers at or beyond select_layer (Isaac-GR00T pops them; a file that keeps
    them loads the same) and ``action_head.mask_token`` (state dropout, training only)."""
    popped = popped_layers(keys, LM, config.eagle.layers)
    ignore = [VIS + "head.*", LM_HEAD, "action_head.mask_token", *popped]
    return WeightMap([*_vision_rules(), *_text_rules(), *head_rules()], ignore=ignore)


def load_n16(
    config: GrootN16Config,
    checkpoint: Any,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> GrootN16Model:
    """Build on meta, map strictly, cast to ``dtype`` (None: storage dtype)."""
    wmap = n16_weight_map(config, list(checkpoint))
    return load_module(lambda: GrootN16Model(config), checkpoint, wmap, device, dtype)
