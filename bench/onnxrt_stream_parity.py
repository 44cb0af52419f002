"""onnxrt vs eager for the vocoders at a profile's size: one shot and streamed, max |delta| (issue #18).

The bench's quality gate compares one-shot calls; a family's default CPU backend also needs streaming to
agree. Per family: the bench adapter's vocoder (eager backend, the bench's weights), its onnxrt sibling
(same module and buckets, exports from the export cache), the first trace input decoded one shot by eager,
then by onnxrt one shot and streamed in pieces of 7 and 32 frames.

    OMP_NUM_THREADS=1 .venv/bin/python bench/onnxrt_stream_parity.py vocos hifigan [-p cpu-small]
"""

from __future__ import annotations

import sys

import torch

from flashrt.bench.harness import BenchOptions, build_adapter
from flashrt.bench.profiles import load_profile


def deltas(name: str, profile: str) -> dict[str, float]:
    adapter = build_adapter(name, load_profile(profile), BenchOptions(), "cpu", {})
    try:
        eager, onnx = adapter.voc, adapter.reference("onnxrt").voc
        specs = eager.signature.inputs
        inputs = adapter.make_inputs(0)[0]
        values = [inputs[s.name] for s in specs]
        one = eager(*values)
        frames = values[0].shape[-1] // specs[0].rate
        out = {"one-shot": float((onnx(*values) - one).abs().max())}
        for piece in (7, 32):
            pieces = [tuple(v[..., f * s.rate:(f + piece) * s.rate] for v, s in zip(values, specs))
                      for f in range(0, frames, piece)]
            out[f"stream {piece}"] = float((torch.cat(list(onnx.stream(pieces)), -1) - one).abs().max())
        return out
    finally:
        adapter.close()


def main(argv: list[str]) -> int:
    profile = "cpu-small"
    if "-p" in argv:
        i = argv.index("-p")
        profile, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    for name in argv or ["vocos"]:
        row = deltas(name, profile)
        print(f"{name} ({profile}): " + ", ".join(f"{k} max|d| {v:.2e}" for k, v in row.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
