"""Benchmark: full-size GR00T N1.7 (and the N1.6 head shape) on a GPU: captured-step replay, `infer` latency.

Regime: batch 1, one observation -> one action chunk of 40, bf16, RANDOM weights at the real sizes
(Cosmos-Reason2-2B / Qwen3-VL backbone: vision 1024 wide x 24 blocks, deepstack after 5/11/17; Qwen3
2048 wide, 16 of 28 layers kept, 151,936-token embedding; VL self-attention 4 layers; AlternateVLDiT
1536 wide x 32 blocks; max state/action 132; 4 flow steps), images 256 x 256 (64 tokens per camera),
1 and 2 cameras fed 480 x 640 uint8 frames. ``--variant n16`` drops the VL self-attention (the N1.6
head; its Eagle3-VL backbone is not built here, so the N1.7 backbone stands in). The model is built
directly on the device (matrices ~N(0, 0.02²), gains 1, biases 0; no checkpoint file), wrapped in the
groot frontend and the generic `Policy` runner.

Metrics per camera count:
  replay p50/p90   the captured step alone (inputs written), CUDA-synchronized host time
  wall p50/p90/p99 `Policy.infer` end to end (validate + resize + tokenize, h2d, replay, actions back)
  eager            the same weights behind the eager backend: wall p50, eager / graph, gate max |Δ|

    python bench/groot_gpu.py --out /tmp/groot-gpu                    # GPU: N1.7, 1 and 2 cameras
    python bench/groot_gpu.py --device cpu --preset small --iters 3   # CPU smoke test

Prints a table on stderr and ONE JSON line last on stdout (also written to --out/groot_gpu.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
PROMPTS = ["pick up the red cube and put it in the bowl", "open the top drawer", "stack the green blocks"]


def presets() -> dict[str, Any]:
    from flashrt.frontends.groot.config import COSMOS_REASON2_2B, HeadConfig

    full_head = HeadConfig(
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
    small_bb = {
        **COSMOS_REASON2_2B,
        "text_config": {
            **COSMOS_REASON2_2B["text_config"],
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "rope_scaling": {"mrope_section": [16, 8, 8]},
        },
        "vision_config": {
            **COSMOS_REASON2_2B["vision_config"],
            "hidden_size": 128,
            "depth": 4,
            "intermediate_size": 512,
            "num_heads": 2,
            "num_position_embeddings": 256,
            "out_hidden_size": 256,
            "deepstack_visual_indexes": [1, 3],
        },
    }
    small_head = replace(
        full_head,
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
    )
    return {"full": (COSMOS_REASON2_2B, 16, full_head), "small": (small_bb, 4, small_head)}


def tokenizer_file(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        PROMPTS * 10,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=SPECIALS,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def build_model(preset: str, variant: str, device: str, tok_path: Path) -> Any:
    from flashrt.frontends.groot.config import GrootN17Config, TokenIds, text_config, vision_config
    from flashrt.frontends.groot.model import GrootN17Model
    from flashrt.frontends.groot.preprocess import PromptTokenizer

    bb, select, head = presets()[preset]
    if variant == "n16":
        head = replace(head, vl_layers=0)
    ids = PromptTokenizer(tok_path).ids
    tokens = TokenIds(ids["<|image_pad|>"], ids["<|vision_start|>"], ids["<|vision_end|>"])
    config = GrootN17Config(vision_config(bb, "preset"), text_config(bb, select, "preset"), tokens, head)
    torch.manual_seed(0)
    with torch.device(device):
        model = GrootN17Model(config)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if t.dim() >= 2:
                t.normal_(0.0, 0.02)
            else:
                t.fill_(0.0 if name.endswith(("bias", ".b")) else 1.0)
    model = model.to(torch.bfloat16 if device != "cpu" else torch.float32).eval().requires_grad_(False)
    model.vision.reset_derived()
    return model


def make_policy(model: Any, n_cams: int, backend: str, tok_path: Path) -> Any:
    from flashrt.frontends.groot.checkpoint import Embodiment
    from flashrt.frontends.groot.frontend import GrootFrontend, Options
    from flashrt.frontends.groot.preprocess import ImageSpec, MinMax, PromptTokenizer
    from flashrt.runner.policy import Policy
    from flashrt.runtime.graphs import backend_for_device

    h = model.config.head
    lo = np.full(7, -1.0, np.float32)
    emb = Embodiment("bench", 0, tuple(f"cam{i}" for i in range(n_cams)), MinMax(lo, -lo), MinMax(lo, -lo))
    frontend = GrootFrontend(
        model,
        emb,
        emb.cameras,
        ImageSpec((256, 256), 256, 230 / 256),
        PromptTokenizer(tok_path),
        Options(),
        None,
        backend_for_device(backend, model.embed.weight.device),
    )
    frontend.capture()
    assert h.horizon == frontend.chunk_size
    return Policy(frontend)


def observations(n_cams: int, n: int = 3) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "images": {f"cam{c}": rng.integers(0, 256, (480, 640, 3), dtype=np.uint8) for c in range(n_cams)},
            "state": rng.uniform(-1, 1, 7).astype(np.float32),
            "prompt": PROMPTS[i % 3],
        }
        for i in range(n)
    ]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def wall(policy: Any, obs: list[dict], iters: int, device: str) -> list[float]:
    out = []
    for k in range(iters):
        _sync(device)
        t = time.perf_counter()
        policy.infer(obs[k % len(obs)], seed=k)
        _sync(device)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def replay(policy: Any, o: dict, iters: int, device: str) -> list[float]:
    fe = policy.frontend
    bucket, checked = fe.check(o)
    fe.write(bucket, checked, 0)
    out = []
    for _ in range(iters):
        _sync(device)
        t = time.perf_counter()
        fe.replay(bucket)
        _sync(device)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def pct(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    q = lambda p: s[min(len(s) - 1, int(round(p * (len(s) - 1))))]  # noqa: E731
    return {"p50": statistics.median(s), "p90": q(0.9), "p99": q(0.99)}


def measure(model: Any, n_cams: int, args: argparse.Namespace, tok: Path, backend: str) -> dict[str, Any]:
    graph = make_policy(model, n_cams, backend, tok)
    eager = make_policy(model, n_cams, "eager", tok)
    obs = observations(n_cams)
    worst = max(
        float(np.abs(graph.infer(o, seed=1)["actions"] - eager.infer(o, seed=1)["actions"]).max())
        for o in obs
    )
    wall(graph, obs, args.warmup, args.device)
    w = pct(wall(graph, obs, args.iters, args.device))
    r = pct(replay(graph, obs[0], args.iters, args.device))
    e = pct(wall(eager, obs, max(3, args.iters // 4), args.device))
    return {
        "cameras": n_cams,
        "backend": backend,
        "wall_ms": w,
        "replay_ms": r,
        "eager_wall_p50": e["p50"],
        "eager_over_graph": e["p50"] / w["p50"],
        "gate_max_abs": worst,
        "bucket": graph.frontend.check(obs[0])[0],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", choices=("full", "small"), default="full")
    p.add_argument("--variant", choices=("n17", "n16"), default="n17")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    backend = "cuda" if args.device.startswith("cuda") else "trace"
    record: dict[str, Any] = {
        "bench": "groot_gpu",
        "variant": args.variant,
        "preset": args.preset,
        "device": args.device,
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        tok = tokenizer_file(Path(tmp))
        model = build_model(args.preset, args.variant, args.device, tok)
        record["dtype"] = str(model.dtype)
        for n_cams in (1, 2):
            row = measure(model, n_cams, args, tok, backend)
            record["rows"].append(row)
            w, r = row["wall_ms"], row["replay_ms"]
            print(
                f"{n_cams} cam(s): wall p50 {w['p50']:.2f} p90 {w['p90']:.2f} p99 {w['p99']:.2f} ms | replay "
                f"p50 {r['p50']:.2f} ms | eager {row['eager_wall_p50']:.2f} ms "
                f"({row['eager_over_graph']:.2f}x) | gate {row['gate_max_abs']:.2e}",
                file=sys.stderr,
            )
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "groot_gpu.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
