"""A robot that acts and talks on one GPU: full-size Pi0.5 at 50 Hz with an Orpheus-3B-sized speech
stream beside it, naive threads vs one `flashrt.Runtime` (control lane on a high-priority CUDA stream).

    python bench/act_talk_gpu.py --budget-s 25                          # H200: the GPU script's row
    python bench/act_talk_gpu.py --device cpu --preset tiny --ticks 20  # a CPU smoke run

RANDOM weights at the real sizes ("full": Pi0.5 with SigLIP So400m/14, Gemma 2B + 300M expert, 2
cameras at 480 x 640, bf16, CUDA graphs; the Orpheus LM at Llama-3.2-3B size with SNAC 24 kHz, decoding
constrained to valid codes). Both setups of `flashrt bench act-and-talk` (`flashrt.bench.act_talk.run_setup`)
on the same models: misses at the rate, step end after release p50/p99/max, speech RTF and underruns.
``--budget-s`` skips a setup that would start after that many seconds (reported); one JSON line last.
``--fp32-modules none`` loads Pi0.5 all in bf16. The first H200 run used the default recipe (fp32 SigLIP,
under which Pi0's replay at 2 cameras took 38 ms, longer than the 20 ms period): both setups missed
(5 and 11 of 250 ticks, p99 end after release ~60 ms), which says little about scheduling yet.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch


class _Robot:
    """Cycles through a few full-size observations; actions are applied to a state vector."""

    observations: list = []

    def __init__(self) -> None:
        self.i = 0
        self.state = None

    def observe(self) -> dict:
        obs = self.observations[self.i % len(self.observations)]
        self.i += 1
        return obs

    def apply(self, action) -> None:
        self.state = action


def _models(args: argparse.Namespace, tmp: Path):
    from flashrt.bench.act_talk import _Models
    from flashrt.bench.adapters import pi0 as pb
    from flashrt.bench.adapters.tts_orpheus import SIZES, random_lm, random_snac
    from flashrt.frontends.orpheus.layout import ByteTokenizer
    from flashrt.frontends.orpheus.tts import ORPHEUS_SAMPLING, OrpheusTTS, frame_constraint
    from flashrt.quant.precision import compute_dtype
    from flashrt.runner.policy import load_policy
    from flashrt.runtime.slots import SlotDecoder
    from flashrt.testing.synthetic.pi0 import SyntheticSpec, write_checkpoint

    preset = pb.PRESETS[args.preset]
    sizes = replace(preset.sizes, max_tokens=pb.TOKENIZER_MAX["pi05"])
    spec = SyntheticSpec("pi05", sizes, pb.CAMERAS[:2], preset.vocab, preset.storage)
    write_checkpoint(tmp / "pi05", spec, args.device)
    precision = "bfloat16" if args.device == "cuda" else "fp32"
    extra = {"fp32_modules": args.fp32_modules} if args.fp32_modules else {}
    policy = load_policy(tmp / "pi05", device=args.device, precision=precision, **extra)
    _Robot.observations = pb.observations(policy, 4, seed=0, frame=preset.frame)
    lm_cfg, snac_preset, layout = SIZES["full" if args.preset == "full" else "tiny"]
    dtype = compute_dtype("bf16" if args.device == "cuda" else "fp32")
    lm = random_lm(lm_cfg, 0, args.device, dtype, cache_len=64 + 7 * args.frames + 8)
    voc = random_snac(snac_preset, layout.codebook_size, 1, args.device, torch.float32, None)
    decoder = SlotDecoder(lm, (32, 64), (1,), max_new_tokens=7 * args.frames,
                          constraint=frame_constraint(layout)).capture()
    tts = OrpheusTTS(decoder, voc, layout, ByteTokenizer(layout.bos_token_id), sample_rate=24000,
                     sampling=ORPHEUS_SAMPLING)
    return _Models(policy, tts, _Robot)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="full", choices=("tiny", "full"))
    ap.add_argument("--rate-hz", type=float, default=50.0)
    ap.add_argument("--ticks", type=int, default=250)
    ap.add_argument("--frames", type=int, default=24, help="SNAC frames per sentence")
    ap.add_argument("--budget-s", type=float, default=25.0)
    ap.add_argument("--fp32-modules", choices=("lerobot", "none"), default=None,
                    help="Pi0.5's float32 modules in bf16 (`load_policy`): 'lerobot' (the family default: "
                         "fp32 SigLIP) or 'none' (under 'lerobot' Pi0's replay at 2 cameras took 38 ms on an "
                         "H200, longer than the 20 ms period)")
    args = ap.parse_args(argv)
    from flashrt.bench.act_talk import SETUPS, run_setup

    start = time.perf_counter()
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = _models(args, Path(tmp))
        load_s = time.perf_counter() - start
        priorities = (-1, 0) if args.device == "cuda" else (None, None)
        for setup in SETUPS:
            if time.perf_counter() - start > args.budget_s:
                rows[setup] = {"skipped": "budget spent"}
                continue
            row = run_setup(models, setup, args.rate_hz, args.ticks, args.frames, cuda_priority=priorities)
            rows[setup] = {k: row[k] for k in ("misses", "ticks", "end_after_release_ms", "speech_rtf",
                                               "underruns", "speech_errors")}
            end = row["end_after_release_ms"]
            print(f"{setup:8s} misses {row['misses']}/{row['ticks']} at {args.rate_hz:g} Hz, end after "
                  f"release p50 {end['p50']:.2f} p99 {end['p99']:.2f} max {end['max']:.2f} ms, speech RTF "
                  f"{row['speech_rtf'] or float('nan'):.3f}, underruns {row['underruns']}", file=sys.stderr)
        models.tts.close()
    ok = all("skipped" in r or not r["speech_errors"] for r in rows.values())
    print(json.dumps({"bench": "act-talk-gpu", "device": args.device, "preset": args.preset,
                      "rate_hz": args.rate_hz, "load_s": load_s, "setups": rows,
                      "status": "ok" if ok else "error"}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
