"""onnxrt and eager against the same module run in float64: is onnxrt as close to exact as eager is?

For a network whose float32 floor is wide (BigVGAN: ~90 convs with snake activations between them; the
bigvgan package itself is ~9e-6 from its own float64 run), two float32 implementations need not agree to
1e-5, so onnxrt vs eager alone says little; the honest bar is each one's distance to float64. Weights: the
bench's (`random_module`, seed 0, as `flashrt bench` draws them where the family's package is missing);
inputs: mel N(0, 1) as the bench draws them. Eager runs each conv policy named (`invariant`: the family
default of `load_vocoder`; `direct`: what the bench's random module runs, no policy applied); onnxrt runs
the exported program (the same for every policy: the export records plain convs). float64: the same
module built in float64 (same drawn weights), direct convs. Also onnxrt streamed (pieces of 7 frames)
against onnxrt one shot with ``--stream``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/onnxrt_f64_parity.py [--family bigvgan] \\
        [--preset base-24k-100band] [--frames 200] [--inputs 3] [--stream]
"""

from __future__ import annotations

import argparse
import sys

import torch

from flashrt.frontends.vocoders import get_family, prepare_module
from flashrt.runner.vocoder import Vocoder
from flashrt.testing.synthetic.vocoders import random_module


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="bigvgan")
    ap.add_argument("--preset", default="base-24k-100band")
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--inputs", type=int, default=3)
    ap.add_argument("--policies", default="invariant,direct")
    ap.add_argument("--stream", action="store_true")
    args = ap.parse_args(argv)
    fam = get_family(args.family)
    cfg = fam.presets[args.preset]
    m32 = random_module(fam, cfg, 0, "cpu", torch.float32)
    m64 = random_module(fam, cfg, 0, "cpu", torch.float64)
    onnx = Vocoder(fam, cfg, m32, backend="onnxrt", buckets=(args.frames,)).capture()
    g = torch.Generator().manual_seed(0)
    mels = [torch.randn(1, cfg.num_mels, args.frames, generator=g) for _ in range(args.inputs)]
    with torch.no_grad():
        exact = [m64(mel.double()) for mel in mels]
    got = {"onnxrt": [onnx(mel) for mel in mels]}
    for name in args.policies.split(","):
        prepare_module(fam, m32, "cpu", torch.float32, name)        # as load_vocoder(conv=name) gives it
        eager = Vocoder(fam, cfg, m32, backend="eager", buckets=(args.frames,)).capture()
        got[f"eager {name}"] = [eager(mel) for mel in mels]
    peak = max(float(y.abs().max()) for y in exact)
    print(f"{args.family} {args.preset}, {args.frames} frames, {args.inputs} inputs, output peak {peak:.3f}")
    rows = [(f"{a} vs float64", got[a], exact) for a in got]
    rows += [(f"onnxrt vs {a}", got["onnxrt"], got[a]) for a in got if a != "onnxrt"]
    if len(got) > 2:
        names = [a for a in got if a != "onnxrt"]
        rows.append((f"{names[0]} vs {names[1]}", got[names[0]], got[names[1]]))
    if args.stream:
        streamed = [torch.cat(list(onnx.stream(mel[..., i:i + 7] for i in range(0, args.frames, 7))), -1)
                    for mel in mels]
        rows.append(("onnxrt streamed (7) vs onnxrt one shot", streamed, got["onnxrt"]))
    for label, ys, refs in rows:
        d = [float((y.double() - r.double()).abs().max()) for y, r in zip(ys, refs)]
        print(f"  {label:40s} max |d| {max(d):.2e}   per input {' '.join(f'{v:.2e}' for v in d)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
