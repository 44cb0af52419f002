"""Where a vocoder's onnxrt time goes: onnxruntime's profiler, kernel time per op type (issue #18).

The family's module with the bench's random weights (`random_module`, seed 0) and a conv policy, its
padded bucket step (`ValidLength`, as the `onnxrt` backend runs a bucket) exported through the export
cache (`OnnxRuntimeBackend.export`), then run by an onnxruntime session opened as `flashrt.runtime.onnxrt`
opens it, with `SessionOptions.enable_profiling`: per op type, the kernel time per run (summed over its
nodes, averaged over the runs), its share, and nodes per run; eager's time of one call alongside.

    OMP_NUM_THREADS=1 .venv/bin/python bench/onnxrt_op_profile.py [--family bigvgan] \\
        [--preset base-24k-100band] [--frames 16] [--conv direct] [--opt-level all] [--runs 3]
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
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
