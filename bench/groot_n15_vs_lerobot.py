"""Benchmark: GR00T N1.5 end to end on the CPU, flashrt's N1.5 frontend vs lerobot 0.5.1, same weights.

Regime: batch 1, one observation -> one action chunk, float32, a small random-weight N1.5 (SigLIP width
128, 4 blocks, 224 x 224 / patch 14 -> 64 tokens per camera after the pixel shuffle; Qwen3 text width
256, 4 layers kept, MLP 768, 4 heads / 2 kv heads x 64; VL self-attention 2 layers; DiT width 256,
8 blocks, 32 future tokens; horizon 16; max state/action 32; 4 flow-matching steps; the real Qwen3
vocabulary of 151,680 rows, `--vocab` to change it); 2 cameras fed 240 x 320 frames. Both sides start
from the same raw observation (float frames in [0, 1], raw state, task text) and end with
un-normalized actions:

    lerobot  0.5.1's own processor pipeline (`make_groot_pre_post_processors`: pack + min/max
             normalize, the Eagle 2.5 processor with its chat template, collate), then
             `GR00TN15.get_action` (what `GrootPolicy.predict_action_chunk` runs) with the noise drawn
             after `torch.manual_seed`, the slice to the action size and the postprocessor on each step
    flashrt  the policy folder through the groot family's loader (eager backend):
             check -> write (the same noise) -> replay -> read

Metric: wall time per call of each side, A/B interleaved in one process (the order flips every pair),
median per side, the ratio of medians and the median of per-pair ratios (lerobot / flashrt; > 1 means
flashrt is faster), and the ratio of process CPU time. A quality gate (max |Δaction| <= 1e-4 on every
observation) runs before any timing counts. lerobot 0.5.1's code runs next to lerobot 0.6.1 as the
fixture generator tests/fixtures/gen/gen_groot_n15.py sets it up (its stand-ins are documented there).

Runs in the reference environment, after shared/reference/patches/make_n15_pkg.sh, flashrt importable::

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD REF_HOME=/work/ref /work/ref/venv/bin/python \\
        bench/groot_n15_vs_lerobot.py [--pairs 8]

Prints a table on stderr, then ONE JSON line on stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GEN = ROOT / "tests" / "fixtures" / "gen" / "gen_groot_n15.py"
TOL = 1e-4
QWEN3_VOCAB = 151680  # the Eagle 2.5 / Qwen3 vocabulary of the real N1.5 backbone
SIGLIP = dict(
    model_type="siglip_vision_model",
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=2,
    image_size=224,
    patch_size=14,
)
TEXT = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
SIZES = {
    "select_layer": 4,
    "head": dict(
        backbone_embedding_dim=256,
        hidden_size=128,
        input_embedding_dim=256,
        max_num_embodiments=32,
        num_target_vision_tokens=32,
        max_seq_len=1024,
    ),
    "dit": dict(
        num_layers=8, num_attention_heads=4, attention_head_dim=64, output_dim=128, cross_attention_dim=256
    ),
    "vl": dict(num_layers=2, num_attention_heads=4, attention_head_dim=64),
}
FRAME = (240, 320)


def _gen_module(root: Path, vocab: int) -> Any:
    """The fixture generator (lerobot 0.5.1 pieces), pointed at ``root`` and the small sizes."""
    spec = importlib.util.spec_from_file_location("gen_groot_n15", GEN)
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen
    spec.loader.exec_module(gen)
    home = root / "lerobot_home"
    os.environ["HF_LEROBOT_HOME"] = str(home)  # before lerobot is imported
    gen.HOME, gen.CACHE = home, home / "lerobot/eagle2hg-processor-groot-n1p5"
    gen.CK, gen.POLICY = root / "n15_tiny", root / "n15_policy"
    gen.H, gen.A, gen.S = 16, 32, 32
    gen.EAGLE = {
        **gen.EAGLE,
        "vision_config": SIGLIP,
        "text_config": {**gen.EAGLE["text_config"], **TEXT, "num_hidden_layers": 4, "vocab_size": vocab},
    }
    gen.PREPROCESSOR = {**gen.PREPROCESSOR, "size": {"height": 224, "width": 224}}
    gen.PROCESSOR = {**gen.PROCESSOR, "tokens_per_tile": 64}
    return gen


def build(gen: Any) -> tuple[Any, Any, Any]:
    from safetensors.torch import save_file

    gen.eagle_cache()
    model = gen.build(SIZES)
    model.save_pretrained(gen.CK)
    gen.write_assets(gen.CK / "backbone")
    pre, post = gen.write_policy(*gen.lerobot_051())
    weights = {f"_groot_model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(gen.POLICY / "model.safetensors"))
    return model, pre, post


def observations(gen: Any, n: int) -> list[dict]:
    rng = np.random.default_rng(1)
    tasks = ["pick up the red cube", "open the drawer", "put the green block on the plate"]
    out = []
    for i in range(n):
        batch = {
            f"observation.images.{c}": torch.from_numpy(
                rng.integers(0, 256, (3, *FRAME), dtype=np.uint8)
            ).float()
            / 255.0
            for c in gen.CAMS
        }
        batch["observation.state"] = torch.from_numpy(rng.uniform(-3, 3, gen.STATE_DIM).astype(np.float32))
        batch["task"] = tasks[i % len(tasks)]
        out.append({"batch": batch, "seed": 100 + i})
    return out


def run_lerobot(gen: Any, side: tuple, o: dict) -> tuple[np.ndarray, dict[str, float], torch.Tensor]:
    model, pre, post = side
    cpu0, t0 = time.process_time(), time.perf_counter()
    out = pre({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in o["batch"].items()})
    keep = ("state", "state_mask", "embodiment_id")
    inputs = {k: v for k, v in out.items() if k in keep or k.startswith("eagle_")}
    torch.manual_seed(o["seed"])
    with torch.no_grad():
        pred = model.get_action(inputs)["action_pred"]
    chunk = pred[:, :, : gen.ACTION_DIM]
    actions = torch.stack([post(chunk[:, t].clone()) for t in range(chunk.shape[1])], dim=1)[0]
    stages = {"total_ms": (time.perf_counter() - t0) * 1e3, "cpu_ms": (time.process_time() - cpu0) * 1e3}
    torch.manual_seed(o["seed"])
    return actions.numpy(), stages, torch.randn(pred.shape)


def run_flashrt(frontend: Any, o: dict, noise: torch.Tensor) -> tuple[np.ndarray, dict[str, float]]:
    cpu0, t0 = time.process_time(), time.perf_counter()
    bucket, checked = frontend.check(o["batch"], noise)
    frontend.write(bucket, checked)
    frontend.replay(bucket)
    actions = frontend.read(checked)
    stages = {"total_ms": (time.perf_counter() - t0) * 1e3, "cpu_ms": (time.process_time() - cpu0) * 1e3}
    return actions, stages


def timed_pairs(gen: Any, lerobot: tuple, frontend: Any, obs: list[dict], pairs: int) -> dict[str, list]:
    rec: dict[str, list] = {"lerobot": [], "flashrt": [], "ratio": [], "max_abs": []}
    noises = {o["seed"]: run_lerobot(gen, lerobot, o)[2] for o in obs}
    for k in range(pairs):
        for o in obs:
            got, acts = {}, {}
            for side in ("lerobot", "flashrt") if k % 2 == 0 else ("flashrt", "lerobot"):
                if side == "lerobot":
                    acts[side], got[side], _ = run_lerobot(gen, lerobot, o)
                else:
                    acts[side], got[side] = run_flashrt(frontend, o, noises[o["seed"]])
            rec["lerobot"].append(got["lerobot"])
            rec["flashrt"].append(got["flashrt"])
            rec["ratio"].append(got["lerobot"]["total_ms"] / got["flashrt"]["total_ms"])
            rec["max_abs"].append(float(np.abs(acts["lerobot"] - acts["flashrt"]).max()))
    return rec


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=8, help="timed rounds over all observations")
    parser.add_argument("--obs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=QWEN3_VOCAB, help="text vocabulary rows")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        gen = _gen_module(Path(tmp), args.vocab)
        lerobot = build(gen)
        from flashrt.frontends.groot.n15 import frontend as n15_frontend

        start = time.perf_counter()
        frontend = n15_frontend.load(n15_frontend.n15_layout(gen.POLICY), backend="eager")
        load_s = time.perf_counter() - start
        obs = observations(gen, args.obs)
        gate = timed_pairs(gen, lerobot, frontend, obs, 1)
        worst = max(gate["max_abs"])
        if not worst <= TOL:
            raise SystemExit(f"quality gate failed: max |flashrt - lerobot| = {worst:.3e} > {TOL}")
        timed_pairs(gen, lerobot, frontend, obs, 1)  # warm-up
        rec = timed_pairs(gen, lerobot, frontend, obs, args.pairs)
    lr = statistics.median(r["total_ms"] for r in rec["lerobot"])
    fr = statistics.median(r["total_ms"] for r in rec["flashrt"])
    lc = statistics.median(r["cpu_ms"] for r in rec["lerobot"])
    fc = statistics.median(r["cpu_ms"] for r in rec["flashrt"])
    result = {
        "bench": "groot_n15_vs_lerobot",
        "version": "n1.5",
        "device": "cpu",
        "threads": args.threads,
        "vocab": args.vocab,
        "calls": len(rec["ratio"]),
        "gate_max_abs": worst,
        "max_abs_timed": max(rec["max_abs"]),
        "lerobot_ms": lr,
        "flashrt_ms": fr,
        "ratio_of_medians": lr / fr,
        "median_pair_ratio": statistics.median(rec["ratio"]),
        "cpu_ratio_of_medians": lc / fc,
        "flashrt_load_s": load_s,
        "load_avg_1min": os.getloadavg()[0],
    }
    for k, v in result.items():
        print(f"{k:24} {v:.4g}" if isinstance(v, float) else f"{k:24} {v}", file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
