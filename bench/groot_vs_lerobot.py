"""Benchmark: GR00T N1.7 end to end on the CPU, flashrt's groot frontend vs lerobot 0.6.1, same weights.

Regime: batch 1, one observation -> one action chunk, float32, a small random-weight N1.7 (Qwen3 text
width 256, 4 layers kept, MLP 768, 4 heads / 2 kv heads x 64; vision width 128, 4 blocks, deepstack
after blocks 1 and 3; 256 x 256 images -> 64 tokens per camera; VL self-attention 2 layers; DiT width
256, 8 blocks; horizon 16; max state/action 32; 4 flow-matching steps; the real Qwen3-VL vocabulary of
151,936 rows, `--vocab` to change it); 2 cameras fed 240 x 320 uint8 frames. Both sides start from the
same raw observation (uint8 images, raw state, prompt text) and end with un-normalized actions:

    lerobot  its N1.7 processor steps (GrootN17PackInputsStep: normalize / pack; GrootN17VLMEncodeStep:
             image transforms + the Qwen3-VL processor and chat template, built locally), then
             `GR00TN17.get_action` (what `GrootPolicy.predict_action_chunk` runs) with the noise drawn
             after `torch.manual_seed`, then GrootN17ActionDecodeStep (un-normalize)
    flashrt  the groot frontend loaded from the same checkpoint folder (eager backend):
             check -> write (the same noise) -> replay -> read

Metric: wall time per call of each side, A/B interleaved in one process (the order flips every
pair), median per side, the ratio of medians and the median of per-pair ratios (lerobot / flashrt;
> 1 means flashrt is faster), and the ratio of process CPU time. Where the time goes: both sides do
the same backbone and DiT GEMMs; lerobot also runs its processor steps, recomputes the DiT's
cross-attention K/V on every flow step, and its Qwen3-VL forward computes the final norm and the
(tied) LM-head logits over the whole vocabulary for every token, which N1.7 never reads. A quality
gate (max |Δaction| <= 1e-4 on every observation) runs before any timing counts.

Runs in the reference environment with flashrt importable::

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD /work/ref/venv/bin/python bench/groot_vs_lerobot.py [--pairs 10]

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
GEN = ROOT / "tests" / "fixtures" / "gen" / "gen_groot_n17.py"
TOL = 1e-4
QWEN3_VL_VOCAB = 151936  # the Qwen3-VL / Cosmos-Reason2 vocabulary of every real N1.7 checkpoint
SMALL = {
    "text": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, mrope_section=[16, 8, 8]),
    "vision": dict(depth=4, hidden_size=128, intermediate_size=512, num_heads=2, out_hidden_size=256,
                   num_position_embeddings=256, deepstack_visual_indexes=[1, 3]),
    "head": dict(select_layer=4, backbone_embedding_dim=256, hidden_size=128, input_embedding_dim=256,
                 max_seq_len=64),
    "dit": dict(num_layers=8, num_attention_heads=4, attention_head_dim=64, output_dim=128),
    "vl": dict(num_layers=2, num_attention_heads=4, attention_head_dim=64),
}


def _gen_module(folder: Path) -> Any:
    """The fixture generator (lerobot pipeline pieces), pointed at ``folder`` and the small sizes."""
    spec = importlib.util.spec_from_file_location("gen_groot_n17", GEN)
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen
    spec.loader.exec_module(gen)
    gen.CK, gen.BB = folder, folder / "backbone"
    gen.H, gen.A, gen.S = 16, 32, 32
    gen.TARGET, gen.CROP = [256, 256], [230, 230]
    gen.TAGS = {"arm": dict(id=1, state=[("arm", 7), ("gripper", 1)], action=[("arm", 7), ("gripper", 1)])}
    return gen


def build(gen: Any, vocab: int) -> tuple[Any, Any]:
    gen.CK.mkdir(parents=True, exist_ok=True)
    tok = gen.make_tokenizer()
    proc = gen.make_processor(tok)
    text = {**SMALL["text"], "vocab_size": max(vocab, tok.get_vocab_size())}
    core = gen.build_model(tok, {**SMALL, "text": text})
    core.save_pretrained(gen.CK)
    tok.save(str(gen.BB / "tokenizer.json"))
    gen.write_sidecars()
    return core, proc


def observations(n: int) -> list[dict]:
    rng = np.random.default_rng(1)
    prompts = ["pick up the red cube", "open the drawer", "put the green block on the plate"]
    return [{"images": {c: rng.integers(0, 256, (240, 320, 3), dtype=np.uint8) for c in ("front", "wrist")},
             "state": rng.uniform(-1.5, 1.0, 8).astype(np.float32), "prompt": prompts[i % len(prompts)],
             "seed": 100 + i} for i in range(n)]


def run_lerobot(gen: Any, side: tuple, o: dict) -> tuple[np.ndarray, dict[str, float], torch.Tensor]:
    core, proc = side
    cpu0, t0 = time.process_time(), time.perf_counter()
    out = gen.run_case(core, proc, "arm", o["images"], o["state"], o["prompt"], o["seed"])
    stages = {"total_ms": (time.perf_counter() - t0) * 1e3, "cpu_ms": (time.process_time() - cpu0) * 1e3}
    return out["actions"].numpy(), stages, out["noise"]


def run_flashrt(frontend: Any, o: dict, noise: torch.Tensor) -> tuple[np.ndarray, dict[str, float]]:
    cpu0, t0 = time.process_time(), time.perf_counter()
    bucket, checked = frontend.check({k: o[k] for k in ("images", "state", "prompt")}, noise)
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
    parser.add_argument("--vocab", type=int, default=QWEN3_VL_VOCAB,
                        help="text vocabulary rows (the tiny tokenizer uses the first ~300)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        gen = _gen_module(Path(tmp) / "n17_small")
        lerobot = build(gen, args.vocab)
        from flashrt.frontends.groot.family import load

        start = time.perf_counter()
        frontend = load(gen.CK, embodiment="arm")
        load_s = time.perf_counter() - start
        obs = observations(args.obs)
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
    result = {"bench": "groot_vs_lerobot", "version": "n1.7", "device": "cpu", "threads": args.threads,
              "vocab": args.vocab,
              "calls": len(rec["ratio"]), "gate_max_abs": worst, "max_abs_timed": max(rec["max_abs"]),
              "lerobot_ms": lr, "flashrt_ms": fr, "ratio_of_medians": lr / fr,
              "median_pair_ratio": statistics.median(rec["ratio"]), "cpu_ratio_of_medians": lc / fc,
              "target_ratio": 2.0, "flashrt_load_s": load_s, "load_avg_1min": os.getloadavg()[0]}
    for k, v in result.items():
        print(f"{k:24} {v:.4g}" if isinstance(v, float) else f"{k:24} {v}", file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
