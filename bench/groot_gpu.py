"""Benchmark: full-size GR00T N1.7 / N1.6 / N1.5 on a GPU: captured-step replay, `infer` latency.

Regime: batch 1, one observation -> one action chunk of 40, bf16, RANDOM weights at the real sizes
(Cosmos-Reason2-2B / Qwen3-VL backbone: vision 1024 wide x 24 blocks, deepstack after 5/11/17; Qwen3
2048 wide, 16 of 28 layers kept, 151,936-token embedding; VL self-attention 4 layers; AlternateVLDiT
1536 wide x 32 blocks; max state/action 132; 4 flow steps), images 256 x 256 (64 tokens per camera),
1 and 2 cameras fed 480 x 640 uint8 frames. ``--variant n16`` / ``n15`` build the real N1.6 (Eagle 3 VL:
SigLIP2 1152 x 27, Qwen3 2048 with 16 layers kept; AlternateVLDiT 1536 x 32; 256-px edge -> 252 x 252,
81 tokens per camera) / N1.5 (Eagle 2.5 VL: SigLIP 1152 x 27 at 224, Qwen3 2048 with 12 layers kept;
DiT 1536 x 16 with 32 future tokens, VL self-attention 4 layers; 64 tokens per camera) models and
frontends of `flashrt.testing.synthetic.groot_eagle` instead. The model is built directly on the
device (matrices ~N(0, 0.02²), gains 1, biases 0; no checkpoint file), wrapped in the groot frontend and
the generic `Policy` runner.

Metrics per camera count:
  replay p50/p90   the captured step alone (inputs written), CUDA-synchronized host time
  wall p50/p90/p99 `Policy.infer` end to end (validate + resize + tokenize, h2d, replay, actions back)
  eager            the same weights behind the eager backend: wall p50, eager / graph, gate max |Δ|

    python bench/groot_gpu.py --out /tmp/groot-gpu                    # GPU: N1.7, 1 and 2 cameras
    python bench/groot_gpu.py --variant n16 --out /tmp/groot-gpu-n16  # GPU: N1.6 (n15: N1.5)
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
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt.testing.synthetic import groot as synthetic
from flashrt.testing.synthetic import synthetic_eagle


class N17Models:
    """GR00T N1.7: one random model, a frontend per camera count and backend."""

    def __init__(self, args: argparse.Namespace, dtype: torch.dtype, tmp: Path) -> None:
        from flashrt.frontends.groot.common.preprocess import PromptTokenizer

        self.preset = args.preset
        self.tok = PromptTokenizer(synthetic.write_tokenizer(tmp))
        self.model = synthetic.random_model(args.preset, self.tok, args.device, dtype)

    def policy(self, n_cams: int, backend: str) -> Any:
        from flashrt.runner.policy import Policy

        return Policy(synthetic.frontend(self.model, self.tok, self.preset, n_cams, backend))

    def observations(self, n_cams: int) -> list[dict]:
        return synthetic.observations(self.preset, n_cams, 3)


class EagleModels:
    """GR00T N1.6 / N1.5 (`synthetic_eagle`): a random model per camera count (the chat layout is built
    with it), frontends per backend."""

    def __init__(self, args: argparse.Namespace, dtype: torch.dtype, tmp: Path) -> None:
        self.args, self.dtype, self.tmp, self.built = args, dtype, tmp, {}

    def _built(self, n_cams: int) -> Any:
        if n_cams not in self.built:
            self.built.clear()
            a = self.args
            folder = self.tmp / f"{a.variant}-{n_cams}"
            built = synthetic_eagle.build(a.variant, a.preset, n_cams, folder, a.device, self.dtype)
            self.built[n_cams] = built
        return self.built[n_cams]

    def policy(self, n_cams: int, backend: str) -> Any:
        from flashrt.runner.policy import Policy

        return Policy(self._built(n_cams).frontend(backend))

    def observations(self, n_cams: int) -> list[dict]:
        return synthetic_eagle.observations(self._built(n_cams).frame, n_cams, 3)


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


def measure(models: Any, n_cams: int, args: argparse.Namespace, backend: str) -> dict[str, Any]:
    graph = models.policy(n_cams, backend)
    eager = models.policy(n_cams, "eager")
    obs = models.observations(n_cams)
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
    p.add_argument("--preset", choices=tuple(synthetic.PRESETS), default="full")
    p.add_argument("--variant", choices=("n17", "n16", "n15"), default="n17")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    backend = "cuda" if args.device.startswith("cuda") else "trace"
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    record: dict[str, Any] = {
        "bench": "groot_gpu",
        "variant": args.variant,
        "preset": args.preset,
        "device": args.device,
        "dtype": str(dtype),
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        models = (N17Models if args.variant == "n17" else EagleModels)(args, dtype, Path(tmp))
        for n_cams in (1, 2):
            row = measure(models, n_cams, args, backend)
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
