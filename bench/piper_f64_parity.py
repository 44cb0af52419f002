"""A Piper voice in float64 as the common reference: how far are flashrt (float32) and onnxruntime from it?

The fp32 gate of `bench/tts_vs_piper.py` and tests/frontends/vits compares flashrt with onnxruntime
directly (max |diff| <= 1e-4, noise off). Both are float32 implementations of the same graph, and the
VITS flow and decoder amplify rounding, so that distance is the sum of two rounding errors, not flashrt's
error. This script builds the same voice's weights in float64 (`load_weights(dtype=torch.float64)`,
direct convs, the conv forms of the prior: no packed GEMMs) and reports, per sentence, noise off:

* flashrt - f64: the float32 voice `load_tts` gives (packed prior, buffered decoder);
* ort - f64: onnxruntime on the voice's .onnx as written (``ORT_DISABLE_ALL``, what the gate compares);
* ort opt - f64: onnxruntime with its default graph optimizations (what piper runs);
* flashrt - ort: the gate's own distance.

    .venv/bin/python bench/piper_f64_parity.py [--threads 2] [--voice en_US-joe-medium]

Prints a table on stderr, then ONE JSON line on stdout. Needs onnxruntime and the voice's package.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

TEXTS = (
    "Hi.",
    "Hello there.",
    "The quick brown fox jumps over the lazy dog.",
    "Wait; what? No: it's fine, really!",
    "It costs $1,234.50 on March 3rd, 2021, at 10:45.",
    "Dr. Smith and Mr. Jones met Prof. Brown, Ph.D., at 221 Baker St. on Jan. 5th.",
)


def _float64_voice(voice, weights):
    """The same voice with its weights (``weights``: its .onnx) in float64: direct convs, the prior's conv
    forms (no packed GEMMs), one-shot buckets only."""
    from flashrt.frontends.vits.frontend import VitsFrontend
    from flashrt.frontends.vits.model import load_weights
    from flashrt.frontends.vits.voice import VitsVoice

    fe = voice.frontend
    prior, decoder = load_weights(weights, fe.cfg, dtype=torch.float64, conv="direct")
    f64 = VitsFrontend(fe.cfg, prior, decoder, dtype=torch.float64, phoneme_buckets=fe.phoneme_buckets,
                       frame_buckets=fe.frame_buckets)
    return VitsVoice(f64, voice.config, name=f"{voice.name}-f64", threads=voice.threads, slots=1)


def _sessions(path: str):
    import onnxruntime as ort

    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return (ort.InferenceSession(path, plain, providers=["CPUExecutionProvider"]),
            ort.InferenceSession(path, providers=["CPUExecutionProvider"]))


def _far(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--voice", default="en_US-joe-medium")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from flashrt.frontends.vits.voice import find_voice, load_voice

    files = find_voice(args.voice)
    voice = load_voice(args.voice, threads=args.threads)
    exact = _float64_voice(voice, files.weights)
    plain, optimized = _sessions(str(files.weights))
    rows = []
    for text in TEXTS:
        for ids in voice.sentence_ids(text):
            feeds = {"input": np.array([ids]), "input_lengths": np.array([len(ids)]),
                     "scales": np.array([0.0, 1.0, 0.0], np.float32)}
            ort_plain = plain.run(None, feeds)[0].reshape(-1)
            ort_opt = optimized.run(None, feeds)[0].reshape(-1)
            ours = voice.synthesize_ids(ids, noise_scale=0, noise_w=0)
            ref = exact.synthesize_ids(ids, noise_scale=0, noise_w=0)
            if not ours.shape == ref.shape == ort_plain.shape == ort_opt.shape:
                rows.append({"text": text, "samples": [ours.size, ref.size, ort_plain.size, ort_opt.size]})
                continue
            rows.append({"text": text, "flashrt_f64": _far(ours, ref), "ort_f64": _far(ort_plain, ref),
                         "ort_opt_f64": _far(ort_opt, ref), "flashrt_ort": _far(ours, ort_plain)})
    print(f"{'sentence':34} {'flashrt-f64':>12} {'ort-f64':>9} {'ort opt-f64':>12} {'flashrt-ort':>12}",
          file=sys.stderr)
    for r in rows:
        if "samples" in r:
            print(f"{r['text'][:34]:34} sample counts differ: {r['samples']}", file=sys.stderr)
            continue
        print(f"{r['text'][:34]:34} {r['flashrt_f64']:12.1e} {r['ort_f64']:9.1e} {r['ort_opt_f64']:12.1e} "
              f"{r['flashrt_ort']:12.1e}", file=sys.stderr)
    print(json.dumps({"bench": "piper_f64_parity", "voice": args.voice, "threads": args.threads,
                      "rows": rows}))


if __name__ == "__main__":
    main()
