"""Benchmark: vocoders on the CPU, flashrt against each family's reference package, same weights and input.

Regime: batch 1, one utterance of ``--frames`` mel frames decoded in one call, at a realistic size with
random weights (HiFi-GAN V1 vs transformers ``SpeechT5HifiGan``; BigVGAN-base vs the ``bigvgan``
package after its own ``remove_weight_norm()``, as its inference scripts do). Metrics: wall time per
call of each side, real-time factor (time / audio duration), and the speed ratio, measured A/B
interleaved in one process (median of per-pair ratios reference_ms / flashrt_ms, so load noise on a
shared machine hits both sides alike), and the same ratio in process CPU time (``cpu_speedup_*``: every
thread's CPU time, which other jobs on a shared machine do not inflate; with ``--threads 1`` the work
each side does); streaming time to first audio (flashrt, features arriving in
pieces of ``--piece`` frames, every input cut by its own rate) next to the reference's only option
(decode everything, then play), and the stream's max |delta| against the one-shot call and against the
``exact_stream`` one-shot (0 by construction; see flashrt.frontends.vocoders.base).
A quality gate (max |flashrt - reference| <= 1e-4) runs before any timing counts.

Runs in the reference environment with flashrt importable::

    PYTHONPATH=/work/main /work/ref/venv/bin/python bench/vocoders.py [--only hifigan-v1] [--pairs 7]

Prints tables on stderr, then ONE JSON line on stdout. ``--threads`` sets the torch threads of both
sides; ``--plot DIR`` writes one latency PNG per case. bf16 variants of flashrt (same weights; oneDNN
uses AMX where the CPU has it) are timed and reported apart (``bf16_*``: max |delta| and SNR against the
fp32 reference): a different precision, not part of the fp32 ratio. Families register their cases in
``CASES`` (vocoder-B adds vocos/snac entries with `register_case`). Each case's weights come from the
family's one synthetic writer (flashrt/testing/synthetic/vocoders.py, also used by `flashrt bench`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from flashrt.profile.report import json_line, kv_table, print_tables
from flashrt.runner.vocoder import load_vocoder
from flashrt.testing.synthetic.vocoders import WRITERS


@dataclass
class Case:
    """One comparison: the flashrt vocoder, the reference callable, one input, and what it decodes to."""

    name: str
    flashrt: Any                            # a loaded flashrt Vocoder
    reference: Callable[[Any], torch.Tensor]  # input -> audio (B, N) (any shape that flattens alike)
    inputs: Any                             # what both sides take (flashrt gets it as voc(*inputs))
    sample_rate: int
    notes: dict[str, Any] = field(default_factory=dict)
    variants: dict[str, Any] = field(default_factory=dict)   # other flashrt vocoders, e.g. {"bf16": voc}


CASES: dict[str, Callable[[argparse.Namespace, Path], Case]] = {}


def register_case(name: str):
    """Decorator: ``@register_case("vocos-mel")`` on ``make(args, workdir) -> Case``."""
    def wrap(make: Callable[[argparse.Namespace, Path], Case]) -> Callable[[argparse.Namespace, Path], Case]:
        CASES[name] = make
        return make
    return wrap


def _mel(channels: int, frames: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, channels, frames, generator=torch.Generator().manual_seed(seed))


def _package_model(family: str, preset: str, folder: Path, seed: int, **overrides: Any) -> Callable[..., Any]:
    """The family's synthetic checkpoint (its one writer, `flashrt.testing.synthetic.vocoders.WRITERS`)
    at a preset's sizes in ``folder``, and the package's decode of that folder (the bench adapter's
    loader): both sides read the same file."""
    from flashrt.bench.adapters.vocoders import SPECS
    from flashrt.frontends.vocoders import get_family

    cfg = replace(get_family(family).presets[preset], **overrides)
    _quiet(lambda: WRITERS[family](cfg, folder, seed))
    return _quiet(lambda: SPECS[family].load(folder, cfg, "cpu"))


@register_case("hifigan-v1")
def hifigan_v1(args: argparse.Namespace, workdir: Path) -> Case:
    folder = workdir / "hifigan-v1"
    ref = _package_model("hifigan", "v1", folder, seed=0)
    voc = load_vocoder(folder, buckets=(args.frames,), stream_chunk=args.chunk, conv=args.conv)
    return Case("hifigan-v1", voc, ref, (_mel(80, args.frames),), 22050,
                {"reference": "transformers SpeechT5HifiGan (V1 sizes)", "params_M": _params(voc.module)},
                {**_direct(folder, args), **_bf16(folder, args)})


def _bf16(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The same weights at bf16 (oneDNN/AMX on CPUs that have it): a different precision, reported apart."""
    return {"bf16": load_vocoder(folder, buckets=(args.frames,), precision="bf16")} if args.bf16 else {}


def _direct(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The same weights with every conv on oneDNN (``conv="direct"``): what the spectral convs add."""
    return {} if args.conv == "direct" else \
        {"direct_conv": load_vocoder(folder, buckets=(args.frames,), conv="direct")}


@register_case("bigvgan-base")
def bigvgan_base(args: argparse.Namespace, workdir: Path) -> Case:
    folder = workdir / "bigvgan-base"
    ref = _package_model("bigvgan", "base-24k-100band", folder, seed=1)   # weight norm removed on load
    voc = load_vocoder(folder, buckets=(args.frames,), stream_chunk=args.chunk, conv=args.conv)
    notes = {"reference": "bigvgan 2.4.1 BigVGAN (base 24k 100-band sizes)", "params_M": _params(voc.module)}
    return Case("bigvgan-base", voc, ref, (_mel(100, args.frames, seed=1),), 24000, notes,
                _direct(folder, args))
    # no bf16 variant here: measured 3.4x SLOWER than the reference on this CPU (bf16 sin/pad/depthwise
    # filters run unvectorized), 35.6 dB SNR; the fp32 path is the fast one for BigVGAN.


# ---------------------------------------------------------------------------------- vocoder-B entries
# Vocos (mel 24 kHz sizes) vs the `vocos` package, SNAC 24 kHz vs the `snac` package.


@register_case("vocos-mel-24khz")
def vocos_mel(args: argparse.Namespace, workdir: Path) -> Case:
    folder = workdir / "vocos-mel"
    ref = _package_model("vocos", "mel-24khz", folder, seed=2)
    voc = load_vocoder(folder, buckets=(args.frames,), stream_chunk=args.chunk)  # reads config.yaml
    return Case("vocos-mel-24khz", voc, ref, (_mel(100, args.frames, seed=2),), 24000,
                {"reference": "vocos 0.1.0 Vocos.decode (mel-24khz sizes)", "params_M": _params(voc.module)},
                _bf16(folder, args))


@register_case("snac-24khz")
def snac_24khz(args: argparse.Namespace, workdir: Path) -> Case:
    import math

    folder = workdir / "snac-24khz"
    ref = _package_model("snac", "24khz", folder, seed=3, noise=False)   # the release has noise on (random)
    frames = math.ceil(args.frames * 256 / 2048)  # the same audio length as --frames mel frames at hop 256
    voc = load_vocoder(folder, buckets=(frames,), stream_chunk=max(1, args.chunk // 8))
    g = torch.Generator().manual_seed(3)
    codes = [torch.randint(0, 4096, (1, frames * s), generator=g) for s in (1, 2, 4)]
    return Case("snac-24khz", voc, ref, tuple(codes), 24000,
                {"reference": "snac 1.2.1 SNAC.decode (snac_24khz sizes, noise off)",
                 "params_M": _params(voc.module), "frames": frames})


def _params(module: torch.nn.Module) -> float:
    return round(sum(p.numel() for p in module.parameters()) / 1e6, 2)


def _quiet(fn: Callable[[], Any]) -> Any:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return fn()


# ------------------------------------------------------------------------------------------ measure

def _time(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter_ns()
    out = fn()
    return (time.perf_counter_ns() - start) / 1e6, out


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """Quality gate, warm-up, interleaved A/B pairs, then a streaming run."""
    with torch.inference_mode():
        want = case.reference(*case.inputs).reshape(-1)
    got = case.flashrt(*case.inputs).reshape(-1)
    delta = float((got - want).abs().max())
    if got.shape != want.shape or delta > 1e-4:
        raise SystemExit(f"{case.name}: quality gate failed (max |delta| {delta:.3g}); no timing reported")
    audio_s = got.numel() / case.sample_rate
    pairs = _pairs(case, args.pairs)
    wall = [(f[0], r[0]) for f, r in pairs]
    cpu = [(f[1], r[1]) for f, r in pairs]
    ratios = [r / f for f, r in wall]
    flash_ms = statistics.median(f for f, _ in wall)
    ref_ms = statistics.median(r for _, r in wall)
    flash_cpu, ref_cpu = statistics.median(f for f, _ in cpu), statistics.median(r for _, r in cpu)
    return {"case": case.name, "max_abs_delta": delta, "audio_s": audio_s, "pairs": len(pairs),
            "flashrt_ms": [f for f, _ in wall], "reference_ms": [r for _, r in wall],
            "flashrt_ms_p50": flash_ms, "reference_ms_p50": ref_ms, "flashrt_rtf": flash_ms / 1e3 / audio_s,
            "reference_rtf": ref_ms / 1e3 / audio_s, "speedup_median_of_pairs": statistics.median(ratios),
            "speedup_min": min(ratios), "speedup_max": max(ratios),
            "flashrt_cpu_ms_p50": flash_cpu, "reference_cpu_ms_p50": ref_cpu,
            "cpu_speedup_ratio_of_medians": ref_cpu / flash_cpu,
            "cpu_speedup_median_of_pairs": statistics.median(r / f for f, r in cpu), **_stream(case, args),
            **_variants(case, want, ref_ms, args.pairs), **case.notes}


def _variants(case: Case, want: torch.Tensor, ref_ms: float, n: int) -> dict[str, Any]:
    """Each extra flashrt variant (another precision): accuracy against the fp32 reference, median time,
    and its speed against the reference's median. Not part of the fp32 A/B ratio above."""
    out: dict[str, Any] = {}
    for name, voc in case.variants.items():
        got = voc(*case.inputs).reshape(-1)
        err = got - want
        ms = statistics.median(_time(lambda v=voc: v(*case.inputs))[0] for _ in range(n))
        out.update({f"{name}_ms_p50": ms, f"{name}_speedup_vs_reference": ref_ms / ms,
                    f"{name}_max_abs_delta": float(err.abs().max()),
                    f"{name}_snr_db": float(10 * torch.log10(want.pow(2).mean() / err.pow(2).mean()))})
    return out


def _clock(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall ms, process CPU ms) of one call; the CPU time counts every thread of the process and is not
    inflated by other jobs taking the cores (what a shared machine distorts is the wall time)."""
    cpu, start = time.process_time_ns(), time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e6, (time.process_time_ns() - cpu) / 1e6


def _pairs(case: Case, n: int) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """n interleaved (flashrt, reference) pairs of (wall ms, CPU ms) after one warm-up each; the order
    alternates."""
    flash = lambda: case.flashrt(*case.inputs)

    def ref():
        with torch.inference_mode():
            return case.reference(*case.inputs)
    flash(), ref()
    out = []
    for i in range(n):
        if i % 2:
            r, f = _clock(ref), _clock(flash)
        else:
            f, r = _clock(flash), _clock(ref)
        out.append((f, r))
    return out


def stream_pieces(voc: Any, inputs: tuple[torch.Tensor, ...], piece: int) -> list[tuple[torch.Tensor, ...]]:
    """The inputs cut into pieces of `piece` frames, each input by its own rate (SNAC's code scales)."""
    rates = [s.rate for s in voc.signature.inputs]
    frames = inputs[0].shape[-1] // rates[0]
    return [tuple(x[..., i * r:(i + piece) * r] for x, r in zip(inputs, rates))
            for i in range(0, frames, piece)]


def _stream(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    voc = case.flashrt
    pieces = stream_pieces(voc, case.inputs, args.piece)
    ttfa, total = [], []
    for _ in range(3):
        ms, parts = _time(lambda: list(voc.stream(pieces)))
        report = voc.report()
        ttfa.append(report["ttfa_ms"])
        total.append(ms)
    streamed = torch.cat(parts, -1)
    exact = _exact_twin(voc)(*case.inputs)  # one-shot through the stream's windows: equal bit for bit
    return {"stream_chunk_frames": voc.stream_chunk, "stream_context_frames": list(voc.signature.context),
            "stream_ttfa_ms_p50": statistics.median(ttfa), "stream_total_ms_p50": statistics.median(total),
            "stream_vs_oneshot_max_abs_delta": float((streamed - voc(*case.inputs)).abs().max()),
            "stream_vs_exact_oneshot_max_abs_delta": float((streamed - exact).abs().max())}


def _exact_twin(voc: Any) -> Any:
    """The same module and buckets with ``exact_stream=True`` (its own buffers)."""
    from flashrt.runner.vocoder import Vocoder

    return Vocoder(voc.family, voc.config, voc.module, device=voc.device, backend=voc.backend_name,
                   buckets=voc.buckets, stream_chunk=voc.stream_chunk, batch=voc.batch, dtype=voc.dtype,
                   exact_stream=True).capture()


def _plot(folder: Path, results: list[dict[str, Any]]) -> None:
    from flashrt.profile.plots import plot_latency

    for r in results:
        plot_latency(folder / f"vocoders_{r['case']}.png", {"flashrt": r["flashrt_ms"]},
                     per_call=[{"flashrt": ms} for ms in r["flashrt_ms"]],
                     title=f"{r['case']}: one call, {r['audio_s']:.2f} s of audio (ms)",
                     compare={"reference": r["reference_ms"]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--only", nargs="*", default=None, help=f"cases to run (default all: {sorted(CASES)})")
    add("--frames", type=int, default=200, help="mel frames per utterance (~2.3 s at hop 256)")
    add("--pairs", type=int, default=7, help="interleaved A/B pairs per case")
    add("--chunk", type=int, default=32, help="flashrt stream chunk (frames)")
    add("--piece", type=int, default=8, help="frames per incoming feature piece when streaming")
    add("--threads", type=int, default=torch.get_num_threads(), help="torch threads (both sides)")
    add("--plot", type=Path, default=None, help="folder for one latency PNG per case (needs matplotlib)")
    add("--no-bf16", dest="bf16", action="store_false", help="skip the bf16 variants")
    add("--conv", default=None, help="flashrt conv policy: auto | invariant | direct | spectral "
        "(flashrt.nn.conv_policy; default: each family's own)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or sorted(CASES):
            workdir = Path(tmp) / name
            workdir.mkdir()
            results.append(run_case(CASES[name](args, workdir), args))
    print_tables(*(kv_table({k: v if isinstance(v, (int, float)) else str(v) for k, v in r.items()
                             if k not in ("case", "flashrt_ms", "reference_ms")},
                            f"{r['case']} (CPU, {args.threads} threads)") for r in results))
    if args.plot is not None:
        _plot(args.plot, results)
    print(json_line({"bench": "vocoders", "device": "cpu", "threads": args.threads, "frames": args.frames,
                     "torch": torch.__version__, "load_avg_1min": os.getloadavg()[0], "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
