"""Random-weight GR00T N1.6 and N1.5 frontends for benchmarks (no weights file): the real N1.6 / N1.5
models and frontends (Eagle backbones, their preprocessing) over seeded random weights.

The sizes are written as the checkpoint files would hold them (a config.json, an Eagle backbone
config.json, a tiny byte-level BPE as vocab.json + merges.txt with the Eagle special tokens, the chat
template, the processor configs) into a scratch folder and parsed by the loaders' own config code.

Presets (`PRESETS`, per version):

    tiny    the test fixtures' sizes (text 64 x 2 layers, vision 32 x 2, DiT 4 layers)
    small   the CPU benchmark's sizes (text 256 x 4, vision 128 x 4, DiT 256 x 8; N1.5: VL self-attention
            2 layers), 64 image tokens per camera (N1.6: 224 x 224 frames; N1.5: SigLIP at 224 / 14)
    full    as published: N1.6 = Eagle-Block2A-2B-v2 (SigLIP2 1152 x 27, Qwen3 2048, 16 of 28 layers)
            + the 32-layer AlternateVLDiT 1536 wide, max dims 29, horizon 16 (Isaac-GR00T's
            Gr00tN1d6 config defaults); N1.5 = Eagle 2.5 (SigLIP 1152 x 27 at 224 / 14, Qwen3 2048,
            12 layers kept, 2-layer MLP projector) + the 16-layer DiT 1536 wide with 32 future tokens,
            VL self-attention 4 layers, max state 64 / action 32, horizon 16 (the N1.5-3B config)

Vocabulary: the tiny tokenizer's (tiny, small) or Qwen3's 151,680 (full; the ids used stay below 512).
Weights: matrices N(0, 0.02²) drawn on the target device from a seeded generator, gains 1, biases 0.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt.errors import ConfigError
from flashrt.io import reset_derived
from flashrt.runtime.graphs import backend_for_device
from flashrt.testing.synthetic import groot as synthetic

SPECIALS = (*synthetic.SPECIALS, "<IMG_CONTEXT>", "<img>", "</img>")
CHAT_TEMPLATE = (  # Eagle's: images as <image-k> placeholders, then the text, generation prompt
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% set n = namespace(k=0) %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{% set n.k = n.k + 1 %}<image-{{ n.k }}>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STATE_DIM, ACTION_DIM = synthetic.STATE_DIM, synthetic.ACTION_DIM


@dataclass(frozen=True)
class EaglePreset:
    text: dict[str, Any]  # Qwen3 text_config
    vision: dict[str, Any]  # SigLIP / SigLIP2 vision_config
    select_layer: int
    head: dict[str, Any]  # config.json head fields
    dit: dict[str, Any]  # diffusion_model_cfg
    frame: tuple[int, int]  # raw camera frame (rows, cols)
    image: int  # N1.6: shortest_image_edge; N1.5: SigLIP image_size
    vl: dict[str, Any] | None = None  # N1.5 vl_self_attention_cfg


def _text(width: int, mlp: int, heads: int, kv: int, head_dim: int, layers: int, vocab: int = 0) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": width,
        "intermediate_size": mlp,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
    }


def _head(bb: int, hidden: int, inner: int, state: int, action: int, horizon: int, emb: int) -> dict:
    return {
        "backbone_embedding_dim": bb,
        "hidden_size": hidden,
        "input_embedding_dim": inner,
        "max_state_dim": state,
        "max_action_dim": action,
        "action_dim": action,
        "action_horizon": horizon,
        "max_num_embodiments": emb,
        "max_seq_len": 1024,
        "attend_text_every_n_blocks": 2,
        "num_inference_timesteps": 4,
        "num_timestep_buckets": 1000,
        "add_pos_embed": True,
        "use_vlln": True,
        "num_target_vision_tokens": 32,
    }


def _dit(layers: int, heads: int, head_dim: int, out: int) -> dict:
    return {
        "num_layers": layers,
        "num_attention_heads": heads,
        "attention_head_dim": head_dim,
        "output_dim": out,
        "norm_type": "ada_norm",
        "interleave_self_attention": True,
        "positional_embeddings": None,
    }


def _siglip(kind: str, width: int, mlp: int, heads: int, layers: int, grid: int) -> dict:
    out = {
        "model_type": kind,
        "hidden_size": width,
        "intermediate_size": mlp,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "patch_size": 14,
        "layer_norm_eps": 1e-6,
    }
    if kind == "siglip2_vision_model":
        return {**out, "num_patches": grid * grid, "use_rope": False, "use_windows_attn": False}
    return {**out, "image_size": 14 * grid}


def _vl(layers: int, heads: int, head_dim: int) -> dict:
    return {"num_layers": layers, "num_attention_heads": heads, "attention_head_dim": head_dim}


def _n15(n16: EaglePreset, vision: dict, vl: dict, **changes: Any) -> EaglePreset:
    """An N1.5 preset from the N1.6 one of its name: a SigLIP ``vision`` tower, VL self-attention ``vl``
    and ``changes`` to the other fields."""
    return replace(n16, vision=vision, vl=vl, **changes)


N16_PRESETS: dict[str, EaglePreset] = {
    "tiny": EaglePreset(
        _text(64, 128, 4, 2, 16, 2),
        _siglip("siglip2_vision_model", 32, 64, 2, 2, 4),
        2,
        _head(64, 32, 48, 16, 16, 8, 4),
        _dit(4, 2, 24, 32),
        (48, 64),
        56,
    ),
    "small": EaglePreset(
        _text(256, 768, 4, 2, 64, 4),
        _siglip("siglip2_vision_model", 128, 512, 2, 4, 16),
        4,
        _head(256, 128, 256, 32, 32, 16, 32),
        _dit(8, 4, 64, 128),
        (240, 320),
        224,
    ),
    "full": EaglePreset(
        _text(2048, 6144, 16, 8, 128, 28, 151680),
        _siglip("siglip2_vision_model", 1152, 4304, 16, 27, 16),
        16,
        _head(2048, 1024, 1536, 29, 29, 16, 32),
        _dit(32, 32, 48, 1024),
        (480, 640),
        256,
    ),
}
PRESETS: dict[str, dict[str, EaglePreset]] = {
    "n16": N16_PRESETS,
    "n15": {
        "tiny": _n15(
            N16_PRESETS["tiny"],
            _siglip("siglip_vision_model", 32, 64, 2, 2, 4),
            _vl(1, 2, 32),
            text=_text(64, 128, 4, 2, 16, 3),
        ),
        "small": _n15(
            N16_PRESETS["small"], _siglip("siglip_vision_model", 128, 512, 2, 4, 16), _vl(2, 4, 64)
        ),
        "full": _n15(
            N16_PRESETS["full"],
            _siglip("siglip_vision_model", 1152, 4304, 16, 27, 16),
            _vl(4, 32, 64),
            select_layer=12,
            head=_head(2048, 1024, 1536, 64, 32, 16, 32),
            dit=_dit(16, 32, 48, 1024),
            image=224,
        ),
    },
}


def preset(version: str, name: str) -> EaglePreset:
    if version not in PRESETS:
        raise ConfigError(f"groot version {version!r}; choose one of {sorted(PRESETS)}")
    if name not in PRESETS[version]:
        raise ConfigError(f"groot-{version} preset {name!r}; choose one of {sorted(PRESETS[version])}")
    return PRESETS[version][name]


def write_assets(folder: Path, per_tile: int, image: int) -> int:
    """The Eagle processor folder (tokenizer, chat template, processor configs); returns the tokenizer
    size (the <IMG_CONTEXT> id is size - 3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=380, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(list(synthetic.PROMPTS) * 10, trainer)
    tok.model.save(str(folder))
    base = tok.get_vocab_size()
    added = {
        str(base + i): {"content": s, "special": True, "normalized": False} for i, s in enumerate(SPECIALS)
    }
    files = {
        "tokenizer_config.json": {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added},
        "chat_template.json": {"chat_template": CHAT_TEMPLATE},
        "processor_config.json": {"image_token": "<IMG_CONTEXT>", "tokens_per_tile": per_tile},
        "preprocessor_config.json": {"size": {"height": image, "width": image}, "resample": 3},
    }
    for name, body in files.items():
        (folder / name).write_text(json.dumps(body))
    return base + len(SPECIALS)


def _random_weights(
    model: torch.nn.Module, device: str | torch.device, dtype: torch.dtype, seed: int
) -> None:
    synthetic.random_fill(model, device, dtype, seed)
    reset_derived(model, device)


@dataclass
class Built:
    """A random-weight model and a factory of captured frontends over it (several may share it)."""

    model: torch.nn.Module
    frontend: Callable[..., Any]  # (backend, buckets) -> captured frontend
    frame: tuple[int, int]


def build(
    version: str,
    name: str,
    n_cams: int,
    folder: Path,
    device: str | torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    num_steps: int | None = None,
) -> Built:
    """The ``version`` ("n16" / "n15") model of preset ``name`` for ``n_cams`` cameras; scratch files
    under ``folder``."""
    p = preset(version, name)
    return (_build_n16 if version == "n16" else _build_n15)(
        p, n_cams, Path(folder), device, dtype, seed, num_steps
    )


def _build_n16(p, n_cams, folder, device, dtype, seed, num_steps) -> Built:
    from flashrt.frontends.groot.common.frontend import Options
    from flashrt.frontends.groot.n16.frontend import EagleChat, EagleImageSpec, GrootN16Frontend, StateNorm
    from flashrt.frontends.groot.n16.model import GrootN16Model, n16_config

    spec = EagleImageSpec(p.image, 0.95)
    size = spec.output_size()
    vocab = write_assets(folder / "backbone", (size[0] // 28) * (size[1] // 28), size[0])
    text = {**p.text, "vocab_size": p.text["vocab_size"] or vocab}
    bb = {
        "model_type": "eagle_3_vl",
        "downsample_ratio": 0.5,
        "image_token_index": vocab - 3,
        "select_layer": -1,
        "use_pixel_shuffle": True,
        "text_config": text,
        "vision_config": p.vision,
    }
    (folder / "backbone" / "config.json").write_text(json.dumps(bb))
    cfg = {
        **p.head,
        "diffusion_model_cfg": p.dit,
        "model_type": "Gr00tN1d6",
        "model_name": "backbone",
        "select_layer": p.select_layer,
    }
    config, bb_dir = n16_config(folder, cfg, num_steps)
    with torch.device("meta"):
        model = GrootN16Model(config)
    _random_weights(model, device, dtype, seed)
    model = model.eval().requires_grad_(False)
    chat = EagleChat(folder / "backbone", config.eagle.image_token)
    emb = synthetic.embodiment(n_cams)
    norm = StateNorm(np.full(STATE_DIM, -1.0), np.full(STATE_DIM, 1.0))
    cams = synthetic.camera_names(n_cams)

    def frontend(backend: str | None = None, buckets: tuple[int, ...] | None = None) -> Any:
        fe = GrootN16Frontend(
            model, emb, cams, spec, chat, norm, Options(), buckets, backend_for_device(backend, model.device)
        )
        fe.capture()
        return fe

    return Built(model, frontend, p.frame)


def _build_n15(p, n_cams, folder, device, dtype, seed, num_steps) -> Built:
    from flashrt.frontends.groot.common.preprocess import MinMax
    from flashrt.frontends.groot.n15.frontend import EagleChat15, EagleTile, GrootN15Frontend, N15Embodiment
    from flashrt.frontends.groot.n15.model import GrootN15Model, n15_config

    per_tile = (p.vision["image_size"] // p.vision["patch_size"]) ** 2 // 4
    vocab = write_assets(folder / "backbone", per_tile, p.vision["image_size"])
    bb = {
        "vision_config": p.vision,
        "text_config": {**p.text, "vocab_size": p.text["vocab_size"] or vocab},
        "select_layer": -1,
        "downsample_ratio": 0.5,
        "use_pixel_shuffle": True,
        "mlp_connector_layers": 2,
        "image_token_index": vocab - 3,
    }
    (folder / "backbone" / "config.json").write_text(json.dumps(bb))
    cfg = {
        "model_type": "gr00t_n1_5",
        "backbone_cfg": {"select_layer": p.select_layer, "project_to_dim": None, "reproject_vision": False},
        "action_head_cfg": {**p.head, "diffusion_model_cfg": p.dit, "vl_self_attention_cfg": p.vl},
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    config = n15_config(folder, folder / "backbone", num_steps)
    with torch.device("meta"):
        model = GrootN15Model(config)
    _random_weights(model, device, dtype, seed)
    model = model.eval().requires_grad_(False)
    assets = folder / "backbone"
    image = EagleTile.read(assets)
    chat = EagleChat15(assets, config.eagle.image_token, n_cams, config.eagle.tokens_per_image)
    lo_s, lo_a = np.full(STATE_DIM, -1.0, np.float32), np.full(ACTION_DIM, -1.0, np.float32)
    cams = synthetic.camera_names(n_cams)
    dev = model.backbone.embed.weight.device

    def frontend(backend: str | None = None, buckets: tuple[int, ...] | None = None) -> Any:
        fe = GrootN15Frontend(
            model,
            N15Embodiment("synthetic", 0),
            cams,
            image,
            chat,
            MinMax(lo_s, -lo_s),
            MinMax(lo_a, -lo_a),
            (STATE_DIM, ACTION_DIM, config.head.horizon),
            False,
            buckets,
            backend_for_device(backend, dev),
        )
        fe.capture()
        return fe

    return Built(model, frontend, p.frame)


observations = synthetic.frame_observations  # (frame, n_cams, n, seed): Built.frame sized observations
