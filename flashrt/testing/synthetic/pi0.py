"""Synthetic (random-weight) Pi0 / Pi0.5 checkpoints in lerobot 0.6.1's real policy-dir layout.

The one writer of such folders, used by the demo, the bench adapters and the tests: config.json,
model.safetensors (every tensor of a PI0Policy / PI05Policy state dict, seeded N(0, 1/fan_in)), the two
processor JSONs with their statistics files, and a tiny SentencePiece tokenizer with PaliGemma's
conventions. lerobot itself loads what this writes (the bench's `--vs lerobot` does), and so does
`flashrt.load_policy`, like a downloaded checkpoint. The actions of such a policy mean nothing: it
exists to measure and test the runtime.

    spec = SyntheticSpec("pi05", SyntheticSizes(), cameras=("top", "wrist"))
    write_checkpoint(folder, spec)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashrt.frontends.pi0.config import Pi0Config
from flashrt.frontends.pi0.preprocess import camera_key

__all__ = ["SyntheticSizes", "SyntheticSpec", "STATE_DIM", "ACTION_DIM", "build_tokenizer",
           "lerobot_shapes", "sizes_of", "meta_checkpoint", "random_weights", "config_json",
           "processor_jsons", "statistics", "write_metadata", "write_checkpoint"]

STATE_DIM = ACTION_DIM = 7
NORMALIZATION = {"pi0": "MEAN_STD", "pi05": "QUANTILES"}  # lerobot defaults for STATE and ACTION


@dataclass(frozen=True)
class SyntheticSizes:
    """Model sizes (lerobot hard-codes 8 query heads and 1 K/V head); the defaults are the demo's tiny
    Pi0.5."""

    vision_width: int = 32
    vision_depth: int = 2
    vision_mlp: int = 64
    image_size: int = 56
    vlm_width: int = 64
    vlm_mlp: int = 128
    expert_width: int = 32
    expert_mlp: int = 64
    depth: int = 2
    head_dim: int = 16
    chunk_size: int = 10
    n_action_steps: int = 5
    num_steps: int = 10
    max_dim: int = 32
    max_tokens: int = 64
    patch: int = 14


TINY = SyntheticSizes()

# ------------------------------------------------------------------------------------------ tokenizer
_CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?-_'\n") + ["\u2581"]
_WORDS = ("the", "\u2581the", "\u2581pick", "\u2581up", "\u2581red", "\u2581cube", "\u2581and", "\u2581put",
          "\u2581it", "\u2581in", "\u2581box", "Task", "State", "Action", "pick")


def build_tokenizer(path: Path) -> int:
    """Write a tiny SentencePiece BPE model with PaliGemma's conventions (pad 0, eos 1, bos 2, unk 3,
    byte fallback, no dummy prefix); every word is reachable by merges of its prefixes. Returns its size."""
    from sentencepiece import sentencepiece_model_pb2 as pb2

    m = pb2.ModelProto()
    for piece, kind in (("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2)):
        m.pieces.add(piece=piece, score=0.0, type=kind)
    for b in range(256):
        m.pieces.add(piece=f"<0x{b:02X}>", score=0.0, type=6)
    normal = dict.fromkeys([*_CHARS, *(w[:i] for w in _WORDS for i in range(2, len(w) + 1))])
    for piece in normal:  # BPE merge priority follows the score, which falls with the id
        m.pieces.add(piece=piece, score=-float(len(m.pieces)), type=1)
    ts = m.trainer_spec
    ts.model_type, ts.vocab_size, ts.byte_fallback = pb2.TrainerSpec.BPE, len(m.pieces), True
    ts.pad_id, ts.eos_id, ts.bos_id, ts.unk_id = 0, 1, 2, 3
    ts.pad_piece, ts.eos_piece, ts.bos_piece, ts.unk_piece = "<pad>", "<eos>", "<bos>", "<unk>"
    ns = m.normalizer_spec
    ns.name, ns.add_dummy_prefix, ns.remove_extra_whitespaces = "identity", False, False
    ns.escape_whitespaces = True
    path.write_bytes(m.SerializeToString())
    return len(m.pieces)


_PG = "model.paligemma_with_expert.paligemma."
_VT = _PG + "model.vision_tower.vision_model."
_EX = "model.paligemma_with_expert.gemma_expert."


def _gemma_shapes(stem: str, width: int, mlp: int, s: SyntheticSizes, adaptive: bool) -> dict[str, tuple]:
    q, kv = 8 * s.head_dim, s.head_dim
    layer = {"self_attn.q_proj.weight": (q, width), "self_attn.k_proj.weight": (kv, width),
             "self_attn.v_proj.weight": (kv, width), "self_attn.o_proj.weight": (width, q),
             "mlp.gate_proj.weight": (mlp, width), "mlp.up_proj.weight": (mlp, width),
             "mlp.down_proj.weight": (width, mlp)}
    norms = ("input_layernorm", "post_attention_layernorm")
    if adaptive:
        layer.update({f"{n}.dense.{p}": shape for n in norms
                      for p, shape in (("weight", (3 * width, width)), ("bias", (3 * width,)))})
        final = {"norm.dense.weight": (3 * width, width), "norm.dense.bias": (3 * width,)}
    else:
        layer.update({f"{n}.weight": (width,) for n in norms})
        final = {"norm.weight": (width,)}
    out = {f"{stem}layers.{i}.{k}": v for i in range(s.depth) for k, v in layer.items()}
    return {**out, **{stem + k: v for k, v in final.items()}}


def _vision_shapes(s: SyntheticSizes) -> dict[str, tuple]:
    w, n_pos = s.vision_width, (s.image_size // s.patch) ** 2
    layer = {f"self_attn.{p}_proj.{t}": (w, w) if t == "weight" else (w,) for p in ("q", "k", "v", "out")
             for t in ("weight", "bias")}
    layer.update({f"layer_norm{i}.{p}": (w,) for i in (1, 2) for p in ("weight", "bias")})
    layer.update({"mlp.fc1.weight": (s.vision_mlp, w), "mlp.fc1.bias": (s.vision_mlp,),
                  "mlp.fc2.weight": (w, s.vision_mlp), "mlp.fc2.bias": (w,)})
    out = {f"{_VT}encoder.layers.{i}.{k}": v for i in range(s.vision_depth) for k, v in layer.items()}
    out.update({_VT + "embeddings.patch_embedding.weight": (w, 3, s.patch, s.patch),
                _VT + "embeddings.patch_embedding.bias": (w,),
                _VT + "embeddings.position_embedding.weight": (n_pos, w),
                _VT + "post_layernorm.weight": (w,), _VT + "post_layernorm.bias": (w,),
                _PG + "model.multi_modal_projector.linear.weight": (s.vlm_width, w),
                _PG + "model.multi_modal_projector.linear.bias": (s.vlm_width,)})
    return out


def _pi05_shapes(s: SyntheticSizes, vocab: int) -> dict[str, tuple]:
    """Every tensor of a lerobot 0.6.1 PI05Policy state dict, key -> shape (the layout it saves)."""
    we = s.expert_width
    shapes = {**_vision_shapes(s),
              _PG + "model.language_model.embed_tokens.weight": (vocab, s.vlm_width),
              _PG + "lm_head.weight": (vocab, s.vlm_width), _EX + "lm_head.weight": (vocab, we),
              **_gemma_shapes(_PG + "model.language_model.", s.vlm_width, s.vlm_mlp, s, adaptive=False),
              **_gemma_shapes(_EX + "model.", we, s.expert_mlp, s, adaptive=True)}
    for name, (out, inp) in {"action_in_proj": (we, s.max_dim), "action_out_proj": (s.max_dim, we),
                             "time_mlp_in": (we, we), "time_mlp_out": (we, we)}.items():
        shapes[f"model.{name}.weight"], shapes[f"model.{name}.bias"] = (out, inp), (out,)
    return shapes


@dataclass(frozen=True)
class SyntheticSpec:
    """Everything `write_checkpoint` needs: variant, sizes (max_tokens already per variant), cameras."""

    variant: str
    sizes: SyntheticSizes
    cameras: tuple[str, ...]
    vocab: int = 0
    storage: torch.dtype = torch.float32
    seed: int = 0
    extra_config: tuple[tuple[str, Any], ...] = ()   # extra config.json keys (the demo's marker)


def lerobot_shapes(variant: str, s: SyntheticSizes, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of a lerobot 0.6.1 PI0Policy / PI05Policy state dict, key -> shape. Pi0 differs from
    Pi0.5 in its expert: plain RMSNorm gains instead of adaRMS denses, a state projection, and the
    action-time MLP (input: action and time embedding concatenated) instead of the time MLP."""
    shapes = _pi05_shapes(s, vocab)
    if variant == "pi05":
        return shapes
    we, out = s.expert_width, {}
    for key, shape in shapes.items():
        if key.endswith(".dense.weight"):
            out[key.removesuffix(".dense.weight") + ".weight"] = (we,)
        elif not key.endswith(".dense.bias") and not key.startswith("model.time_mlp_"):
            out[key] = shape
    for name, (rows, cols) in {"state_proj": (we, s.max_dim), "action_time_mlp_in": (we, 2 * we),
                               "action_time_mlp_out": (we, we)}.items():
        out[f"model.{name}.weight"], out[f"model.{name}.bias"] = (rows, cols), (rows,)
    return out


def sizes_of(config: Pi0Config) -> SyntheticSizes:
    """The `SyntheticSizes` of a `Pi0Config` (one K/V head, as the family has; ``max_dim`` is the
    action size, `meta_checkpoint` sizes the state projection apart)."""
    v, c = config.vision, config
    return SyntheticSizes(vision_width=v.width, vision_depth=v.depth, vision_mlp=v.mlp_dim,
                          image_size=v.image_size, vlm_width=c.vlm.width, vlm_mlp=c.vlm.mlp_dim,
                          expert_width=c.expert.width, expert_mlp=c.expert.mlp_dim, depth=c.vlm.depth,
                          head_dim=c.vlm.head_dim, chunk_size=c.chunk_size, num_steps=c.num_steps,
                          max_dim=c.max_action_dim, patch=v.patch)


def meta_checkpoint(config: Pi0Config, storage: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every tensor of a lerobot checkpoint of ``config``'s sizes, on the meta device (shapes only): what
    `load_pi0(..., device="meta")` maps into a release-size model that costs no memory."""
    shapes = lerobot_shapes(config.variant, sizes_of(config), config.vlm.vocab_size)
    if "model.state_proj.weight" in shapes:
        shapes["model.state_proj.weight"] = (config.expert.width, config.max_state_dim)
    return {k: torch.empty(shape, dtype=storage, device="meta") for k, shape in shapes.items()}


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded N(0, 1/fan_in) weights drawn ON `device` (vectors: 0.05 N(0, 1), + 1 for SigLIP LayerNorm
    gains), in sorted key order, stored as `dtype`; PaliGemma's lm_head is tied to the embedding."""
    g = torch.Generator(device).manual_seed(seed)
    out = {}
    for key in sorted(shapes):
        shape = shapes[key]
        t = torch.randn(shape, generator=g, device=device) / math.sqrt(max(math.prod(shape[1:]), 1))
        if len(shape) == 1:
            t = t * 0.05 + (1.0 if "layer_norm" in key or "post_layernorm" in key else 0.0)
        out[key] = t.to(dtype)
    out[_PG + "lm_head.weight"] = out[_PG + "model.language_model.embed_tokens.weight"].clone()  # tied
    return out


def _feature(kind: str, shape: tuple[int, ...]) -> dict[str, Any]:
    return {"type": kind, "shape": list(shape)}


def _features(spec: SyntheticSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    side = spec.sizes.image_size
    inputs = {camera_key(c): _feature("VISUAL", (3, side, side)) for c in spec.cameras}
    inputs["observation.state"] = _feature("STATE", (STATE_DIM,))
    return inputs, {"action": _feature("ACTION", (ACTION_DIM,))}


def config_json(spec: SyntheticSpec) -> dict[str, Any]:
    """lerobot's config.json (only keys lerobot's PI0Config / PI05Config know, so lerobot reads it too)."""
    s, (inputs, outputs) = spec.sizes, _features(spec)
    norm = NORMALIZATION[spec.variant]
    return {"type": spec.variant, "n_obs_steps": 1, "input_features": inputs, "output_features": outputs,
            "device": "cpu", "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m",
            "dtype": "float32", "chunk_size": s.chunk_size, "n_action_steps": s.n_action_steps,
            "max_state_dim": s.max_dim, "max_action_dim": s.max_dim, "num_inference_steps": s.num_steps,
            "min_period": 0.004, "max_period": 4.0, "use_relative_actions": False,
            "image_resolution": [s.image_size, s.image_size], "empty_cameras": 0,
            "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": norm, "ACTION": norm},
            "tokenizer_max_length": s.max_tokens, **dict(spec.extra_config)}


# lerobot 0.6.1 processor order (make_pi0_pre_post_processors / make_pi05_pre_post_processors).
PRE_STEPS = {
    "pi0": ("rename_observations_processor", "to_batch_processor", "pi0_new_line_processor",
            "tokenizer_processor", "device_processor", "relative_actions_processor", "normalizer_processor"),
    "pi05": ("rename_observations_processor", "to_batch_processor", "relative_actions_processor",
             "normalizer_processor", "pi05_prepare_state_tokenizer_processor_step", "tokenizer_processor",
             "device_processor"),
}
POST_STEPS = ("unnormalizer_processor", "absolute_actions_processor", "device_processor")


def _step_configs(spec: SyntheticSpec, features: dict[str, Any], post: bool) -> dict[str, dict[str, Any]]:
    norm = NORMALIZATION[spec.variant]
    normalizer = {"eps": 1e-8, "features": features,
                  "norm_map": {"VISUAL": "IDENTITY", "STATE": norm, "ACTION": norm}}
    return {"rename_observations_processor": {"rename_map": {}}, "to_batch_processor": {},
            "pi0_new_line_processor": {}, "pi05_prepare_state_tokenizer_processor_step": {},
            "tokenizer_processor": {"max_length": spec.sizes.max_tokens, "task_key": "task",
                                    "padding_side": "right", "padding": "max_length", "truncation": True,
                                    "tokenizer_name": "google/paligemma-3b-pt-224"},
            "device_processor": {"device": "cpu", "float_dtype": None},
            "relative_actions_processor": {"enabled": False, "exclude_joints": ["gripper"],
                                           "action_names": None},
            "absolute_actions_processor": {"enabled": False},
            "normalizer_processor" if not post else "unnormalizer_processor": normalizer}


def _pipeline(name: str, steps: tuple[str, ...], configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = []
    for i, step in enumerate(steps):
        entry = {"registry_name": step, "config": configs[step]}
        if step.endswith("normalizer_processor"):
            entry["state_file"] = f"{name}_step_{i}_{step}.safetensors"
        out.append(entry)
    return {"name": name, "steps": out}


def processor_jsons(spec: SyntheticSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """policy_preprocessor.json and policy_postprocessor.json as lerobot 0.6.1 saves them."""
    inputs, outputs = _features(spec)
    pre = _pipeline("policy_preprocessor", PRE_STEPS[spec.variant],
                    _step_configs(spec, {**inputs, **outputs}, post=False))
    post = _pipeline("policy_postprocessor", POST_STEPS, _step_configs(spec, outputs, post=True))
    return pre, post


def statistics(seed: int) -> dict[str, torch.Tensor]:
    """Plausible joint statistics for state and action (a gripper in [0, 1] last), lerobot's flat keys."""
    g = torch.Generator().manual_seed(seed + 1)
    out = {}
    for key, dim in (("observation.state", STATE_DIM), ("action", ACTION_DIM)):
        center, spread = torch.randn(dim, generator=g) * 0.5, torch.rand(dim, generator=g) + 0.5
        center[-1], spread[-1] = 0.5, 0.5
        stats = {"mean": center, "std": spread / 2, "min": center - 1.2 * spread,
                 "max": center + 1.2 * spread, "q01": center - spread, "q99": center + spread}
        out.update({f"{key}.{k}": v.float().contiguous() for k, v in stats.items()})
    return out


def write_metadata(folder: Path, spec: SyntheticSpec) -> None:
    """config.json, the two processor JSONs and their statistics files (everything but weights and
    tokenizer) for `spec` into `folder`."""
    from safetensors.torch import save_file

    (folder / "config.json").write_text(json.dumps(config_json(spec), indent=2))
    stats = statistics(spec.seed)
    for pipeline in processor_jsons(spec):
        (folder / f"{pipeline['name']}.json").write_text(json.dumps(pipeline, indent=2))
        for step in pipeline["steps"]:
            if "state_file" in step:
                save_file(stats, str(folder / step["state_file"]))


def write_checkpoint(folder: Path, spec: SyntheticSpec, device: str | torch.device = "cpu") -> Path:
    """Write a random-weight lerobot 0.6.1 policy dir for `spec` into `folder` (weights drawn on
    `device`, then saved from the host)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(folder / "tokenizer.model")
    shapes = lerobot_shapes(spec.variant, spec.sizes, spec.vocab or vocab)
    weights = random_weights(shapes, spec.seed, device, spec.storage)
    host = {k: v.to("cpu") for k, v in weights.items()}
    del weights
    save_file(host, str(folder / "model.safetensors"))
    del host
    write_metadata(folder, spec)
    return folder
