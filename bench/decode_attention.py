"""Benchmark: the slot-batched decode step's attention on the CPU, ``flashrt_cpu::decode_attention`` (each
row over its own keys) against SDPA under the rows' bias (the reference form), side by side in one run.

Two parts, both interleaved A/B with the minimum of several repeats per side:

* the op alone, swept over rows (1, 4, 8, 16), key buckets (128, 512, 2048) and two head layouts: the
  tiny Orpheus fixture's (4 query heads over 2 K/V heads of 16) and Orpheus-3B's (24 over 8 of 128);
  each row at its own position in the bucket's upper half (what a bucket holds: `SlotDecoder._keys`);
* the tiny Orpheus LM's slot decode block (7 tokens, the lm stage's unit) at 1, 8 and 16 live rows, the
  two forms in two decoders of the same weights (jit backend, one torch thread).

The op sweep runs at ``--threads`` torch threads (a large call is split over rows x K/V heads, as SDPA
splits its own). Prints a table on stderr, then ONE JSON line on stdout ({"bench": "decode-attention",
"op": [...], "block": [...]}, times in microseconds / milliseconds, ``speedup`` = sdpa / native).

    python bench/decode_attention.py                 # the whole sweep (about a minute on 2 cores)
    python bench/decode_attention.py --threads 2     # the op sweep at two torch threads
    python bench/decode_attention.py --quick         # one small case of each part (the CPU smoke test)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

LAYOUTS = {"tiny-4x2x16": (4, 2, 16), "orpheus3b-24x8x128": (24, 8, 128)}
ROWS, KEYS, BLOCK_ROWS = (1, 4, 8, 16), (128, 512, 2048), (1, 8, 16)
VOICE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tts" / "orpheus_tiny"


def best_of(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Minimum over ``repeats`` of the mean seconds per call over ``calls`` calls."""
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def interleaved(a: Callable[[], object], b: Callable[[], object], calls: int,
                pairs: int) -> tuple[float, float]:
    """(a, b) seconds per call: the minimum over ``pairs`` alternating runs of each."""
    a(), b()
    ta = tb = math.inf
    for _ in range(pairs):
        ta, tb = min(ta, best_of(a, calls, 1)), min(tb, best_of(b, calls, 1))
    return ta, tb


def op_case(layout: str, rows: int, keys: int, pairs: int) -> dict:
    from flashrt.nn.attention import attend
    from flashrt.nn.llama import decode_bias

    heads, kv_heads, dim = LAYOUTS[layout]
    g = torch.Generator().manual_seed(rows * keys + dim)
    q = torch.randn(rows, 1, heads, dim, generator=g)
    k, v = (torch.randn(rows, kv_heads, keys, dim, generator=g) for _ in range(2))
    position = torch.randint(keys // 2, keys, (rows,), generator=g)
    bias = decode_bias(position, keys, torch.float32)
    scale = dim ** -0.5
    calls = max(3, int(2e6 // (rows * keys * heads * dim // 8 + 1)))
    sdpa, native = interleaved(lambda: attend(q, k, v, bias),
                               lambda: torch.ops.flashrt_cpu.decode_attention(q, k, v, position, scale),
                               calls, pairs)
    return {"layout": layout, "rows": rows, "keys": keys, "sdpa_us": round(sdpa * 1e6, 2),
            "native_us": round(native * 1e6, 2), "speedup": round(sdpa / native, 2)}


def block_cases(rows_list: tuple[int, ...], pairs: int) -> list[dict]:
    import flashrt
    from flashrt import ops
    from flashrt.frontends.lm import load_lm
    from flashrt.runtime.decode import Sampling
    from flashrt.runtime.slots import SlotDecoder

    sampling = Sampling(temperature=0.6, top_p=0.8, repetition_penalty=1.3, seed=1)
    texts = ["Hello there friend.", "The robot picked up the red cube.", "Battery at forty percent.",
             "Moving on.", "What now?", "Turn left.", "Stop here please.", "Okay."]
    voice = flashrt.load_tts(VOICE, threads=1, slots=max(rows_list))
    native = voice.decoder
    lm = load_lm(VOICE, batch=native.rows, cache_len=native.model.cache_len)
    ops.select(lm.module, "cpu", torch.float32, prefer={"decode_attention": "sdpa"})
    sdpa = SlotDecoder(lm, native.buckets, native.batch_buckets, max_new_tokens=native.max_new_tokens,
                       backend=native.backend.name, constraint=native.constraint).capture()
    decoders = {"sdpa": sdpa, "native": native}
    out = []
    for rows in rows_list:
        seats = {form: [dec.join(voice.prompt_ids(texts[i % len(texts)]), 400, (), sampling)
                        for i in range(rows)] for form, dec in decoders.items()}
        steps = {form: (lambda d=dec: d.step(blocks=7)) for form, dec in decoders.items()}
        for _ in range(4):  # past the first tokens (the prompt's key bucket)
            steps["sdpa"](), steps["native"]()
        t_sdpa, t_native = interleaved(steps["sdpa"], steps["native"], 3, pairs)
        for form, dec in decoders.items():
            for seat in seats[form]:
                dec.leave(seat)
        out.append({"rows": rows, "sdpa_ms": round(t_sdpa * 1e3, 3), "native_ms": round(t_native * 1e3, 3),
                    "speedup": round(t_sdpa / t_native, 2)})
    voice.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small case of each part")
    parser.add_argument("--pairs", type=int, default=5, help="alternating runs per side [5]")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the op sweep (the block part runs one, as an LM stage) [1]")
    args = parser.parse_args(argv)
    from flashrt.ops import torch_cpu

    torch.set_num_threads(args.threads)
    if not torch_cpu.loads():
        print(json.dumps({"bench": "decode-attention", "status": "unavailable",
                          "why": "the CPU torch ops do not build here (no C++ compiler?)"}))
        return 0
    cases = [("tiny-4x2x16", 8, 128)] if args.quick else [
        (layout, rows, keys) for layout in LAYOUTS for rows in ROWS for keys in KEYS]
    op = [op_case(*case, pairs=args.pairs) for case in cases]
    err = sys.stderr
    print(f"{'layout':20s} {'rows':>4s} {'keys':>5s} {'sdpa us':>9s} {'native us':>9s} {'x':>6s}", file=err)
    for r in op:
        print(f"{r['layout']:20s} {r['rows']:4d} {r['keys']:5d} {r['sdpa_us']:9.1f} {r['native_us']:9.1f} "
              f"{r['speedup']:6.2f}", file=err)
    torch.set_num_threads(1)
    block = block_cases((2,) if args.quick else BLOCK_ROWS, 2 if args.quick else args.pairs)
    print(f"\n{'block rows':>10s} {'sdpa ms':>8s} {'native ms':>9s} {'x':>6s}", file=err)
    for r in block:
        print(f"{r['rows']:10d} {r['sdpa_ms']:8.3f} {r['native_ms']:9.3f} {r['speedup']:6.2f}", file=err)
    print(json.dumps({"bench": "decode-attention", "status": "ok", "threads": args.threads, "op": op,
                      "block": block}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
