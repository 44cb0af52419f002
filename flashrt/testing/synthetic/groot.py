"""Random-weight GR00T N1.7 frontends for benchmarks (no checkpoint file): sizes, tokenizer, embodiment.

Presets (`PRESETS`), all with Qwen3-VL's real 151,936-token vocabulary except ``tiny``:

    tiny    the test fixture's sizes (text 64 x 2 layers, vision 32 x 2, DiT 48 x 4), 64 x 64 images
    small   the CPU benchmark's sizes (text 256 x 4, vision 128 x 4, DiT 256 x 8, VL self-attn 2),
            256 x 256 images (64 tokens per camera)
    full    GR00T N1.7 as published: Cosmos-Reason2-2B backbone (vision 1024 x 24, text 2048, 16 of 28
            layers kept), VL self-attention 4 layers, AlternateVLDiT 1536 x 32, max dims 132, horizon 40

``variant="n16"`` drops the VL self-attention (N1.6's head; the N1.7 backbone stands in for Eagle3-VL).
Weights: matrices N(0, 0.02²) drawn on the target device from a seeded generator, gains 1, biases 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt.errors import ConfigError
from flashrt.frontends.groot.common.actions import ActionDecoder, ActionGroup
from flashrt.frontends.groot.common.checkpoint import Embodiment
from flashrt.frontends.groot.common.config import (
    COSMOS_REASON2_2B,
    GrootN17Config,
    HeadConfig,
    TokenIds,
    text_config,
    vision_config,
)
from flashrt.frontends.groot.common.frontend import GrootFrontend, Options
from flashrt.frontends.groot.common.preprocess import ImageSpec, MinMax, PromptTokenizer
from flashrt.frontends.groot.n17.model import GrootN17Model
from flashrt.io.loading import reset_derived
from flashrt.runtime.graphs import backend_for_device

SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
PROMPTS = (
    "pick up the red cube and put it in the bowl",
    "open the top drawer",
    "stack the green blocks",
    "push the button twice",
)
STATE_DIM, ACTION_DIM = 8, 7


@dataclass(frozen=True)
class Preset:
    backbone: dict[str, Any]  # a Qwen3-VL config dict
    select_layer: int
    head: HeadConfig
    image: int  # square target size
    frame: tuple[int, int]  # raw camera frame (rows, cols)


def _bb(text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    return {
        **COSMOS_REASON2_2B,
        "text_config": {**COSMOS_REASON2_2B["text_config"], **text},
        "vision_config": {**COSMOS_REASON2_2B["vision_config"], **vision},
    }


_FULL_HEAD = HeadConfig(
    backbone_dim=2048,
    hidden=1024,
    inner=1536,
    dit_layers=32,
    dit_heads=32,
    dit_head_dim=48,
    vl_layers=4,
    vl_heads=32,
    vl_head_dim=64,
    max_state_dim=132,
    max_action_dim=132,
    horizon=40,
    num_embodiments=32,
    max_seq_len=1024,
    text_every=2,
    num_steps=4,
)
PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        _bb(
            dict(
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                vocab_size=400,
                rope_scaling={"mrope_section": [4, 2, 2]},
            ),
            dict(
                hidden_size=32,
                depth=2,
                intermediate_size=64,
                num_heads=2,
                num_position_embeddings=64,
                out_hidden_size=64,
                deepstack_visual_indexes=[0, 1],
            ),
        ),
        2,
        replace(
            _FULL_HEAD,
            backbone_dim=64,
            hidden=32,
            inner=48,
            dit_layers=4,
            dit_heads=2,
            dit_head_dim=24,
            vl_layers=1,
            vl_heads=2,
            vl_head_dim=32,
            max_state_dim=16,
            max_action_dim=16,
            horizon=8,
            num_embodiments=4,
            max_seq_len=64,
        ),
        64,
        (48, 64),
    ),
    "small": Preset(
        _bb(
            dict(
                hidden_size=256,
                intermediate_size=768,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                rope_scaling={"mrope_section": [16, 8, 8]},
            ),
            dict(
                hidden_size=128,
                depth=4,
                intermediate_size=512,
                num_heads=2,
                num_position_embeddings=256,
                out_hidden_size=256,
                deepstack_visual_indexes=[1, 3],
            ),
        ),
        4,
        replace(
            _FULL_HEAD,
            backbone_dim=256,
            hidden=128,
            inner=256,
            dit_layers=8,
            dit_heads=4,
            dit_head_dim=64,
            vl_layers=2,
            vl_heads=4,
            vl_head_dim=64,
            max_state_dim=32,
            max_action_dim=32,
            horizon=16,
            max_seq_len=64,
        ),
        256,
        (240, 320),
    ),
    "full": Preset(COSMOS_REASON2_2B, 16, _FULL_HEAD, 256, (480, 640)),
}


def write_tokenizer(folder: Path) -> Path:
    """A byte-level BPE ``tokenizer.json`` with Qwen3-VL's chat and vision special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=380,
        special_tokens=list(SPECIALS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(PROMPTS) * 10, trainer)
    path = Path(folder) / "tokenizer.json"
    tok.save(str(path))
    return path


def random_model(
    preset: str,
    tokenizer: PromptTokenizer,
    device: str | torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    variant: str = "n17",
    num_steps: int | None = None,
) -> GrootN17Model:
    if preset not in PRESETS:
        raise ConfigError(f"groot preset {preset!r}; choose one of {sorted(PRESETS)}")
    if variant not in ("n17", "n16"):
        raise ConfigError(f"groot variant {variant!r}; choose 'n17' or 'n16'")
    p = PRESETS[preset]
    head = replace(
        p.head, vl_layers=0 if variant == "n16" else p.head.vl_layers, num_steps=num_steps or p.head.num_steps
    )
    ids = tokenizer.ids
    tokens = TokenIds(ids["<|image_pad|>"], ids["<|vision_start|>"], ids["<|vision_end|>"])
    config = GrootN17Config(
        vision_config(p.backbone, preset), text_config(p.backbone, p.select_layer, preset), tokens, head
    )
    with torch.device("meta"):
        model = GrootN17Model(config)
    random_fill(model, device, dtype, seed)
    reset_derived(model, device)  # the vision tower's 2-D patch kernel, the norms' float32 gains
    return model.eval().requires_grad_(False)


def random_fill(model: torch.nn.Module, device: str | torch.device, dtype: torch.dtype, seed: int) -> None:
    """Assign ``model`` (built on meta) its random weights: matrices N(0, 0.02²) from a generator seeded
    with ``seed`` on ``device``, biases 0, other vectors 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, t in model.state_dict().items():
        if t.dim() >= 2:
            tensors[name] = (torch.randn(t.shape, generator=g, device=device) * 0.02).to(dtype)
        else:
            fill = 0.0 if name.endswith(("bias", ".b")) else 1.0
            tensors[name] = torch.full(t.shape, fill, dtype=dtype, device=device)
    model.load_state_dict(tensors, assign=True)


def camera_names(n_cams: int) -> tuple[str, ...]:
    return tuple(f"cam{i}" for i in range(n_cams))


def embodiment(n_cams: int) -> Embodiment:
    lo_s, lo_a = np.full(STATE_DIM, -1.0, np.float32), np.full(ACTION_DIM, -1.0, np.float32)
    actions = ActionDecoder((ActionGroup("joints", 0, ACTION_DIM, lo_a, -lo_a),))
    return Embodiment("synthetic", 0, camera_names(n_cams), MinMax(lo_s, -lo_s), actions)


def frontend(
    model: GrootN17Model,
    tokenizer: PromptTokenizer,
    preset: str,
    n_cams: int,
    backend: str | None = None,
    buckets: tuple[int, ...] | None = None,
    capture: bool = True,
) -> GrootFrontend:
    """A frontend over ``model`` for ``n_cams`` cameras (several may share one model), captured unless
    ``capture`` is False (calibration runs its step eagerly first)."""
    size = PRESETS[preset].image
    image = ImageSpec((size, size), size, 230 / 256)
    dev = model.embed.weight.device
    fe = GrootFrontend(
        model,
        embodiment(n_cams),
        camera_names(n_cams),
        image,
        tokenizer,
        Options(),
        buckets,
        backend_for_device(backend, dev),
    )
    if capture:
        fe.capture()
    return fe


def observations(preset: str, n_cams: int, n: int, seed: int = 0) -> list[dict[str, Any]]:
    return frame_observations(PRESETS[preset].frame, n_cams, n, seed)


def frame_observations(frame: tuple[int, int], n_cams: int, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` seeded observations: uniform uint8 frames of ``frame`` (rows, cols) from cameras cam0.., a
    state in [-1, 1], the `PROMPTS` in turn."""
    rows, cols = frame
    rng = np.random.default_rng(seed)
    return [
        {
            "images": {
                f"cam{c}": rng.integers(0, 256, (rows, cols, 3), dtype=np.uint8) for c in range(n_cams)
            },
            "state": rng.uniform(-1, 1, STATE_DIM).astype(np.float32),
            "prompt": PROMPTS[(seed + i) % 4],
        }
        for i in range(n)
    ]
