"""Many Orpheus-style streams at once: per-stream TTFA and RTF with 1, 4, 8, 16 concurrent streams.

    python bench/orpheus_streams.py --device cuda --preset full --streams 1,4,8,16      # the GPU row
    python bench/orpheus_streams.py --device cpu --preset tiny --streams 1,2 --frames 4  # a smoke run

One `OrpheusTTS` (random seeded weights, `flashrt.bench.adapters.tts_orpheus` sizes: an Orpheus-3B-sized
LM for "full") with as many decode rows as the largest stream count (`flashrt.runtime.slots`): N client
threads each stream one utterance of ``--frames`` frames at once (decoding constrained to valid codes,
so every utterance has exactly that length). Per level: TTFA p50/p99 (call -> first audio chunk), RTF
per stream p50/p99 (wall time / audio), playback stalls (each stream played from its first chunk as it
arrives, `flashrt.bench.serve_load.playback_stalls`: the streams that ran dry, stall ms p50/p99),
aggregate audio seconds per second, and the decode replays per batch bucket. Levels stop when
``--budget-s`` is spent (the JSON line still prints). No graph is captured after load (checked: the
level fails otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np
import torch


def _build(preset: str, device: str, rows: int, frames: int, backend: str | None):
    from flashrt.bench.adapters.tts_orpheus import SIZES, random_lm, random_snac
    from flashrt.frontends.orpheus.layout import ByteTokenizer
    from flashrt.frontends.orpheus.tts import ORPHEUS_SAMPLING, OrpheusTTS, frame_constraint
    from flashrt.quant.precision import compute_dtype
    from flashrt.runtime.slots import DEFAULT_BATCH_BUCKETS, SlotDecoder

    lm_cfg, snac_preset, layout = SIZES[preset]
    dtype = compute_dtype("bf16" if device == "cuda" else "fp32")
    lm = random_lm(lm_cfg, 0, device, dtype, cache_len=64 + 7 * frames + 8, batch=rows)
    voc = random_snac(snac_preset, layout.codebook_size, 1, device, torch.float32, backend)
    decoder = SlotDecoder(lm, (32, 64), DEFAULT_BATCH_BUCKETS, max_new_tokens=7 * frames, backend=backend,
                          constraint=frame_constraint(layout)).capture()
    return OrpheusTTS(decoder, voc, layout, ByteTokenizer(layout.bos_token_id), sample_rate=24000,
                      sampling=ORPHEUS_SAMPLING, queue_size=64)


def _level(tts, n: int, frames: int) -> dict:
    texts = ("Hello there, how are you today?", "The quick brown fox jumps over the lazy dog.",
             "Streaming speech, one frame at a time.", "Set up once, replay forever.")
    from flashrt.bench.serve_load import playback_stalls

    ttfa, rtf, audio, stalls, errors = [], [], [], [], []
    lock = threading.Lock()

    def client(k: int) -> None:
        start = time.perf_counter()
        try:
            first, samples, chunks = None, 0, []
            for chunk in tts.stream(texts[k % 4], seed=k, max_new_tokens=7 * frames):
                now = time.perf_counter()
                first = first if first is not None else now - start
                samples += chunk.shape[-1]
                chunks.append((now, chunk.shape[-1]))
            wall = time.perf_counter() - start
            with lock:
                ttfa.append(first * 1e3)
                rtf.append(wall / (samples / tts.sample_rate))
                audio.append(samples / tts.sample_rate)
                stalls.append(playback_stalls(chunks, tts.sample_rate))
        except Exception as exc:  # noqa: BLE001 - reported in the row
            with lock:
                errors.append(repr(exc))

    before = dict(tts.decoder.replays)
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - start
    buckets = {k: v - before.get(k, 0) for k, v in tts.decoder.replays.items() if v - before.get(k, 0)}
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    return {"streams": n, "served": len(ttfa), "errors": errors[:3], "ttfa_ms_p50": pct(ttfa, 50),
            "ttfa_ms_p99": pct(ttfa, 99), "rtf_p50": pct(rtf, 50), "rtf_p99": pct(rtf, 99),
            "stalled": sum(1 for _, dry in stalls if dry), "stall_ms_p50": pct([ms for ms, _ in stalls], 50),
            "stall_ms_p99": pct([ms for ms, _ in stalls], 99),
            "audio_s_per_s": sum(audio) / wall if wall else None, "wall_s": wall, "replays": buckets}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="full", choices=("tiny", "small", "full"))
    ap.add_argument("--streams", default="1,4,8,16")
    ap.add_argument("--frames", type=int, default=24, help="frames per utterance (7 tokens each)")
    ap.add_argument("--backend", default=None, help="graph backend [the device's default]")
    ap.add_argument("--budget-s", type=float, default=25.0)
    args = ap.parse_args(argv)
    levels = [int(v) for v in args.streams.split(",")]
    start = time.perf_counter()
    tts = _build(args.preset, args.device, max(levels), args.frames, args.backend)
    load_s = time.perf_counter() - start
    captures = tts.decoder.report()["captures"]
    rows = []
    _level(tts, 1, args.frames)  # warm-up (allocator, first replays), not reported
    for n in levels:
        if time.perf_counter() - start > args.budget_s:
            rows.append({"streams": n, "skipped": "budget spent"})
            continue
        row = _level(tts, n, args.frames)
        row["recaptured"] = tts.decoder.report()["captures"] != captures
        rows.append(row)
        print(f"streams {n:3d}: served {row['served']}/{n}, TTFA p50 {row['ttfa_ms_p50']:.0f} ms "
              f"p99 {row['ttfa_ms_p99']:.0f} ms, RTF p50 {row['rtf_p50']:.3f} p99 {row['rtf_p99']:.3f}, "
              f"stalled {row['stalled']}/{row['served']}, "
              f"{row['audio_s_per_s']:.2f} audio s/s, replays {row['replays']}", file=sys.stderr)
    tts.close()
    ok = all(r.get("served") == r["streams"] and not r.get("recaptured") for r in rows if "skipped" not in r)
    print(json.dumps({"bench": "orpheus-streams", "device": args.device, "preset": args.preset,
                      "frames": args.frames, "load_s": load_s, "levels": rows,
                      "status": "ok" if ok else "error"}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
