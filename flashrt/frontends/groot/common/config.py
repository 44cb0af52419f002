"""GR00T N1.7 configuration: one frozen dataclass per part, read from the checkpoint's own JSON.

Sources. The action head sizes come from the checkpoint's ``config.json`` (``GR00TN17Config``,
model_type ``Gr00tN1d7``). The backbone sizes are not in it: ``model_name`` names the Qwen3-VL
backbone — ``nvidia/Cosmos-Reason2-2B`` (the public N1.7 backbone, whose config is the built-in
`COSMOS_REASON2_2B` preset, as lerobot hard-codes it) or a local folder with a Qwen3-VL
``config.json`` (relative paths resolve against the checkpoint folder).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashrt.errors import CheckpointError
from flashrt.io.files import read_json

COSMOS_NAME = "nvidia/Cosmos-Reason2-2B"


@dataclass(frozen=True)
class VisionConfig:
    width: int
    depth: int
    mlp_dim: int
    heads: int
    patch: int
    temporal: int
    merge: int
    num_pos: int
    out_width: int
    deepstack: tuple[int, ...]


@dataclass(frozen=True)
class TextConfig:
    width: int
    mlp_dim: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int  # kept layers (select_layer)
    vocab: int
    eps: float
    theta: float
    mrope_section: tuple[int, int, int]


@dataclass(frozen=True)
class TokenIds:
    image: int
    vision_start: int
    vision_end: int


@dataclass(frozen=True)
class HeadConfig:
    backbone_dim: int
    hidden: int  # hidden_size: state-encoder hidden, DiT output, action-decoder width
    inner: int  # input_embedding_dim: DiT width (heads x head_dim)
    dit_layers: int
    dit_heads: int
    dit_head_dim: int
    vl_layers: int
    vl_heads: int
    vl_head_dim: int
    max_state_dim: int
    max_action_dim: int
    horizon: int
    num_embodiments: int
    max_seq_len: int
    text_every: int  # AlternateVLDiT: cross blocks alternate text / image keys (N1.6, N1.7)
    num_steps: int
    timestep_buckets: int = 1000
    future_tokens: int = 0  # N1.5: learned tokens between the state and the action tokens
    alternate: bool = True  # False: every cross block sees every valid token (N1.5's plain DiT)

    def __post_init__(self) -> None:
        if self.dit_heads * self.dit_head_dim != self.inner:
            raise CheckpointError(
                f"DiT heads x head_dim ({self.dit_heads} x {self.dit_head_dim}) != "
                f"input_embedding_dim {self.inner}"
            )
        if self.vl_layers and self.vl_heads * self.vl_head_dim != self.backbone_dim:
            raise CheckpointError("vl_self_attention heads x head_dim != backbone_embedding_dim")


@dataclass(frozen=True)
class GrootN17Config:
    vision: VisionConfig
    text: TextConfig
    tokens: TokenIds
    head: HeadConfig


QWEN3_2B_TEXT: dict[str, Any] = {  # the Qwen3 text sizes Cosmos-Reason2-2B and Eagle-Block2A-2B-v2 share
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
}

COSMOS_REASON2_2B: dict[str, Any] = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "text_config": {
        **QWEN3_2B_TEXT,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20]},
        "rope_theta": 5000000,
        "vocab_size": 151936,
    },
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17],
        "depth": 24,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}


def _need(cfg: dict[str, Any], key: str, where: str) -> Any:
    if key not in cfg:
        raise CheckpointError(f"{where}: field {key!r} missing")
    return cfg[key]


def backbone_json(folder: Path, model_name: str) -> tuple[dict[str, Any], Path | None]:
    """The Qwen3-VL config dict of ``model_name`` and the folder it came from (None: built-in preset)."""
    if str(model_name).rstrip("/") == COSMOS_NAME:
        return COSMOS_REASON2_2B, None
    path = Path(model_name)
    path = path if path.is_absolute() else folder / path
    if not (path / "config.json").is_file():
        local = folder / "backbone"
        if (local / "config.json").is_file():
            path = local
        else:
            raise CheckpointError(
                f"{folder / 'config.json'}: field 'model_name' = {model_name!r} is neither "
                f"{COSMOS_NAME!r} nor a folder with a Qwen3-VL config.json"
            )
    return read_json(path / "config.json", "GR00T backbone config"), path


def _rope(text: dict[str, Any]) -> tuple[float, tuple[int, int, int]]:
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    theta = float(text.get("rope_theta", rope.get("rope_theta", 5e6)))
    return theta, tuple(int(s) for s in rope.get("mrope_section", (24, 20, 20)))


def text_config(bb: dict[str, Any], select_layer: int, where: str) -> TextConfig:
    t = _need(bb, "text_config", where)
    theta, section = _rope(t)
    head_dim = int(t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"])
    if sum(section) != head_dim // 2:
        raise CheckpointError(
            f"{where}: mrope_section {section} does not sum to head_dim/2 = {head_dim // 2}"
        )
    return TextConfig(
        width=int(_need(t, "hidden_size", where)),
        mlp_dim=int(_need(t, "intermediate_size", where)),
        heads=int(t["num_attention_heads"]),
        kv_heads=int(t["num_key_value_heads"]),
        head_dim=head_dim,
        layers=int(select_layer),
        vocab=int(t.get("vocab_size", 151936)),
        eps=float(t.get("rms_norm_eps", 1e-6)),
        theta=theta,
        mrope_section=section,
    )


def vision_config(bb: dict[str, Any], where: str) -> VisionConfig:
    v = _need(bb, "vision_config", where)
    return VisionConfig(
        width=int(v["hidden_size"]),
        depth=int(v["depth"]),
        mlp_dim=int(v["intermediate_size"]),
        heads=int(v["num_heads"]),
        patch=int(v.get("patch_size", 16)),
        temporal=int(v.get("temporal_patch_size", 2)),
        merge=int(v.get("spatial_merge_size", 2)),
        num_pos=int(v["num_position_embeddings"]),
        out_width=int(v["out_hidden_size"]),
        deepstack=tuple(int(i) for i in v.get("deepstack_visual_indexes", ())),
    )


def head_config(g: dict[str, Any], where: str, num_steps: int | None = None) -> HeadConfig:
    dit, vl = _need(g, "diffusion_model_cfg", where), g.get("vl_self_attention_cfg") or {}
    if not g.get("use_alternate_vl_dit", True) or not dit.get("interleave_self_attention", True):
        raise CheckpointError(
            f"{where}: only the AlternateVLDiT head (interleaved self-attention) is supported"
        )
    if int(g.get("state_history_length", 1)) != 1:
        raise CheckpointError(f"{where}: state_history_length != 1 is not supported")
    if int(dit.get("output_dim", g["hidden_size"])) != int(g["hidden_size"]):
        raise CheckpointError(f"{where}: diffusion_model_cfg.output_dim must equal hidden_size")
    return HeadConfig(
        backbone_dim=int(_need(g, "backbone_embedding_dim", where)),
        hidden=int(_need(g, "hidden_size", where)),
        inner=int(_need(g, "input_embedding_dim", where)),
        dit_layers=int(dit["num_layers"]),
        dit_heads=int(dit["num_attention_heads"]),
        dit_head_dim=int(dit["attention_head_dim"]),
        vl_layers=int(vl.get("num_layers", 0)),
        vl_heads=int(vl.get("num_attention_heads", 1)),
        vl_head_dim=int(vl.get("attention_head_dim", 1)),
        max_state_dim=int(_need(g, "max_state_dim", where)),
        max_action_dim=int(_need(g, "max_action_dim", where)),
        horizon=int(_need(g, "action_horizon", where)),
        num_embodiments=int(g.get("max_num_embodiments", 32)),
        max_seq_len=int(g.get("max_seq_len", 1024)),
        text_every=int(g.get("attend_text_every_n_blocks", 2)),
        num_steps=int(num_steps or g.get("num_inference_timesteps", 4)),
        timestep_buckets=int(g.get("num_timestep_buckets", 1000)),
    )


def n17_config(
    folder: Path, g: dict[str, Any], num_steps: int | None = None
) -> tuple[GrootN17Config, Path | None]:
    """The config of the N1.7 checkpoint in ``folder`` (``g`` = its config.json) and the backbone folder."""
    where = str(folder / "config.json")
    bb, bb_dir = backbone_json(folder, _need(g, "model_name", where))
    bwhere = str((bb_dir or folder) / "config.json")
    tokens = TokenIds(
        int(bb.get("image_token_id", 151655)),
        int(bb.get("vision_start_token_id", 151652)),
        int(bb.get("vision_end_token_id", 151653)),
    )
    return GrootN17Config(
        vision_config(bb, bwhere),
        text_config(bb, int(_need(g, "select_layer", where)), bwhere),
        tokens,
        head_config(g, where, num_steps),
    ), bb_dir
