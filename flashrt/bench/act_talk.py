"""`flashrt bench act-and-talk`: a control loop and a speech stream on one device, with and without the
runtime that owns it (`flashrt.runtime.owner.Runtime`), side by side.

    flashrt bench act-and-talk --rate-hz 20 --ticks 2000 --sweep 20,30,40,50

Two setups over the SAME loaded models, one after the other in one run:

    naive    the policy loop in the main thread, the speech in another; both simply call their models
    runtime  the same threads, the models adopted into one Runtime: the policy a control lane at the
             loop's rate (each step holds the device; its release reserved), the speech a stream lane
             (its replays wait for their turn and give way between module calls)

The policy is the demo's tiny Pi0.5 (random weights, lerobot layout; `--checkpoint` takes another
policy folder); each tick observes the toy robot, steps, applies, and sleeps to the next release. The
speech is an Orpheus-style chain (random weights, the "cpu" size of `flashrt.bench.adapters.tts_orpheus`:
a small LM over the miniature token layout and the released SNAC 24 kHz decoder, decoding constrained
to valid codes) speaking sentences back to back for the whole loop.

Reported per setup: deadline misses (a step that ends after its release + period), step end after
release p50 / p99 / max, the policy's slack and its waits caused by the speech (runtime), speech RTF
(wall / audio over the loop) and underruns (a chunk that arrives after the audio before it has
finished playing, `Lane.played`). Then ``--sweep``: the same at each rate for ``--sweep-ticks`` ticks,
to find where each setup starts to miss. A table on stderr, results.json, act_talk.png (misses vs
rate) and a Perfetto trace of the runtime setup (one track per lane) under ``--out``, the JSON line
last on stdout.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

__all__ = ["bench_act_and_talk", "run_setup"]

SETUPS = ("naive", "runtime")
SENTENCES = ("Moving the arm to the red cube now.", "Closing the gripper.",
             "Lifting it up and over to the box.", "Placing the cube. Done, going back home.")


@dataclass
class _Models:
    policy: Any
    tts: Any
    robot_cls: Any


def bench_act_and_talk(
    rate_hz: Annotated[float, typer.Option(help="control rate of the policy loop")] = 20.0,
    ticks: Annotated[int, typer.Option(help="ticks per setup at --rate-hz")] = 2000,
    sweep: Annotated[str, typer.Option(help="control rates of the sweep, Hz ('' for none)")] = "20,30,40,50",
    sweep_ticks: Annotated[int, typer.Option(help="ticks per setup at each sweep rate")] = 300,
    threads: Annotated[int, typer.Option(help="torch threads (0: keep torch's setting)")] = 2,
    frames: Annotated[int, typer.Option(help="SNAC frames per sentence (7 tokens each)")] = 36,
    stream_chunk: Annotated[int, typer.Option(help="SNAC frames decoded per stream window")] = 4,
    checkpoint: Annotated[str | None, typer.Option(help="a policy folder [the demo's tiny Pi0.5]")] = None,
    out: Annotated[Path | None, typer.Option(help="output folder [bench/results/act-and-talk-...]")] = None,
    plot: Annotated[bool, typer.Option(help="write act_talk.png")] = True,
) -> None:
    """A policy at a fixed rate with speech beside it: naive threads vs one Runtime (module docstring)."""
    from flashrt.bench.cli import _failure, _finish, _out_dir, _save_then_plot
    from flashrt.bench.harness import torch_threads
    from flashrt.errors import ConfigError, FlashRTError

    try:
        rates = [float(v) for v in sweep.split(",") if v.strip()]
        if not rate_hz > 0 or ticks < 1 or sweep_ticks < 1 or frames < 1 or stream_chunk < 1 \
                or any(r <= 0 for r in rates):
            raise ConfigError("--rate-hz and --sweep rates must be positive; --ticks, --sweep-ticks, "
                              "--frames and --stream-chunk at least 1")
    except (ValueError, FlashRTError) as exc:
        return _finish(_failure("act-and-talk", "pi05", "cpu", ConfigError(str(exc))), None)
    folder = _out_dir(out, "act-and-talk", "pi05", "cpu")
    try:
        with torch_threads(threads):
            models = _load(checkpoint, frames, stream_chunk)
            record: dict[str, Any] = {"rate_hz": rate_hz, "ticks": ticks, "threads": threads,
                                      "frames": frames, "stream_chunk": stream_chunk, "setups": {}}
            trace: list[dict[str, Any]] = []
            for setup in SETUPS:
                record["setups"][setup] = run_setup(models, setup, rate_hz, ticks, frames, trace)
            record["sweep"] = [{"rate_hz": r, **{s: run_setup(models, s, r, sweep_ticks, frames)
                                                 for s in SETUPS}} for r in rates]
    except (FlashRTError, ImportError) as exc:
        return _finish(_failure("act-and-talk", "pi05", "cpu", exc), folder)
    _render(record)
    record["status"] = "ok"
    files = {}
    if trace:
        from flashrt.profile.timers import write_chrome_trace

        files["trace"] = str(write_chrome_trace(folder / "act_talk_trace.json", trace))
    files = _save_then_plot(record, folder, plot, "act_talk.png", _plot, files)
    line = {"bench": "act-and-talk", "rate_hz": rate_hz, "ticks": ticks,
            **{f"{s}_misses": record["setups"][s]["misses"] for s in SETUPS},
            **{f"{s}_speech_rtf": record["setups"][s]["speech_rtf"] for s in SETUPS},
            "sweep": [{"rate_hz": r["rate_hz"], **{s: r[s]["misses"] for s in SETUPS}}
                      for r in record["sweep"]], "status": "ok"}
    _finish({**record, "line": line}, folder, files)


def _load(checkpoint: str | None, frames: int, stream_chunk: int) -> _Models:
    import torch

    from flashrt.bench.adapters.tts_orpheus import SIZES, random_lm, random_snac
    from flashrt.demo import ToyRobot, ensure_demo_checkpoint
    from flashrt.frontends.orpheus.layout import ByteTokenizer
    from flashrt.frontends.orpheus.tts import ORPHEUS_SAMPLING, OrpheusTTS, frame_constraint
    from flashrt.runner.policy import load_policy
    from flashrt.runner.stream import ChunkSchedule
    from flashrt.runtime.slots import SlotDecoder

    policy = load_policy(checkpoint or ensure_demo_checkpoint()[0])
    lm_cfg, snac_preset, layout = SIZES["cpu"]
    lm = random_lm(lm_cfg, 0, "cpu", torch.float32, cache_len=64 + 7 * frames + 8)
    voc = random_snac(snac_preset, layout.codebook_size, 1, "cpu", torch.float32, None)
    voc.schedule = ChunkSchedule(stream_chunk, stream_chunk)
    decoder = SlotDecoder(lm, (32, 64), (1,), max_new_tokens=7 * frames,
                          constraint=frame_constraint(layout)).capture()
    tts = OrpheusTTS(decoder, voc, layout, ByteTokenizer(layout.bos_token_id), sample_rate=24000,
                     sampling=ORPHEUS_SAMPLING)
    return _Models(policy, tts, ToyRobot)


def run_setup(models: _Models, setup: str, rate_hz: float, ticks: int, frames: int = 36,
              trace: list[dict[str, Any]] | None = None,
              cuda_priority: tuple[int | None, int | None] = (None, None)) -> dict[str, Any]:
    """One setup ("naive" or "runtime") for ``ticks`` ticks at ``rate_hz`` with speech throughout;
    ``cuda_priority``: the control and stream lanes' CUDA stream priorities (runtime setup, on a GPU)."""
    from flashrt.profile.stats import LatencyStats
    from flashrt.runtime.owner import Runtime

    runtime = Runtime()
    arm = runtime.lane("policy", "control", rate_hz=rate_hz, cuda_priority=cuda_priority[0])
    voice = runtime.lane("speech", "stream", cuda_priority=cuda_priority[1])
    if setup == "runtime":
        runtime.adopt(models.policy, arm)
        runtime.adopt(models.tts, voice)
    try:
        speech = _Speech(models.tts, voice, frames)
        speech.start()
        loop = _control_loop(models, arm if setup == "runtime" else None, rate_hz, ticks)
        speech.stop()
    finally:
        runtime.disown(models.policy)
        runtime.disown(models.tts)
    period_ms = 1e3 / rate_hz
    lateness = loop["end_ms"]
    out = {"setup": setup, "rate_hz": rate_hz, "ticks": ticks,
           "misses": int(sum(ms > period_ms for ms in lateness)),
           "end_after_release_ms": LatencyStats.from_samples(lateness).to_dict(),
           "step_ms": LatencyStats.from_samples(loop["step_ms"]).to_dict(),
           "speech_rtf": speech.rtf(), "speech_audio_s": speech.audio_s, "sentences": speech.sentences,
           "speech_errors": speech.errors[:3], "underruns": voice.stats.underruns,
           "underrun_ms": voice.stats.underrun_ms}
    if setup == "runtime":
        report = runtime.report()
        out["lanes"] = report
        out["slack_ms"] = report["policy"]["slack_ms"]
        out["waited_for_speech_ms"] = report["policy"]["waited_for_ms"].get("speech", 0.0)
        if trace is not None:
            trace.extend(runtime.chrome_events())
    return out


def _control_loop(models: _Models, arm: Any, rate_hz: float, ticks: int) -> dict[str, list[float]]:
    """Observe, step, apply, sleep to the next release; a late tick does not queue up."""
    policy, robot = models.policy, models.robot_cls()
    for _ in range(3):  # warm-up, not timed
        policy.infer(robot.observe(), seed=0)
    policy.reset()
    period = 1.0 / rate_hz
    step_ms, end_ms = [], []
    release = time.perf_counter() + period
    for _ in range(ticks):
        if arm is not None:
            arm.next_release = release
        now = time.perf_counter()
        if release > now:
            time.sleep(release - now)
        start = time.perf_counter()
        if arm is not None:
            with arm.call(release):
                robot.apply(policy.step(robot.observe()))
        else:
            robot.apply(policy.step(robot.observe()))
        end = time.perf_counter()
        step_ms.append((end - start) * 1e3)
        end_ms.append((end - release) * 1e3)
        release = max(release + period, time.perf_counter() - period / 2)
    if arm is not None:
        arm.next_release = None
    return {"step_ms": step_ms, "end_ms": end_ms}


class _Speech:
    """Sentences back to back on a thread until stopped; audio handed to the lane's playback clock."""

    def __init__(self, tts: Any, lane: Any, frames: int) -> None:
        self.tts, self.lane, self.frames = tts, lane, frames
        self.audio_s, self.sentences, self.errors = 0.0, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flashrt-bench-speech", daemon=True)
        self._wall = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        start, k = time.perf_counter(), 0
        while not self._stop.is_set():
            try:
                for chunk in self.tts.stream(SENTENCES[k % len(SENTENCES)], seed=k,
                                             max_new_tokens=7 * self.frames):
                    seconds = chunk.shape[-1] / self.tts.sample_rate
                    self.audio_s += seconds
                    self.lane.played(seconds)
                self.sentences += 1
            except Exception as exc:  # noqa: BLE001 - reported, the loop goes on
                self.errors.append(repr(exc))
            self.lane.end_of_speech()
            k += 1
        self._wall = time.perf_counter() - start

    def rtf(self) -> float | None:
        return self._wall / self.audio_s if self.audio_s else None


def _render(record: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    table = Table(title=f"policy at {record['rate_hz']:g} Hz for {record['ticks']} ticks, speech beside it")
    for col in ("setup", "misses", "end p50", "end p99", "end max", "slack min", "waited for speech",
                "speech RTF", "underruns"):
        table.add_column(col, justify="right")
    for name, s in record["setups"].items():
        end = s["end_after_release_ms"]
        slack = s.get("slack_ms", {}).get("min")
        table.add_row(name, f"{s['misses']}/{s['ticks']}", f"{end['p50']:.1f}", f"{end['p99']:.1f}",
                      f"{end['max']:.1f}", "" if slack is None else f"{slack:.1f}",
                      f"{s.get('waited_for_speech_ms', 0.0):.0f} ms" if name == "runtime" else "",
                      f"{s['speech_rtf']:.2f}" if s["speech_rtf"] else "-", str(s["underruns"]))
    console.print(table)
    if record["sweep"]:
        sweep = Table(title="sweep: misses at each control rate")
        for col in ("rate Hz", *SETUPS, *(f"{s} RTF" for s in SETUPS)):
            sweep.add_column(col, justify="right")
        for row in record["sweep"]:
            sweep.add_row(f"{row['rate_hz']:g}", *(f"{row[s]['misses']}/{row[s]['ticks']}" for s in SETUPS),
                          *(f"{row[s]['speech_rtf']:.2f}" if row[s]["speech_rtf"] else "-" for s in SETUPS))
        console.print(sweep)


def _plot(record: dict[str, Any], path: Path) -> str:
    from flashrt.profile.plots import _pyplot

    plt = _pyplot()
    fig, (miss, rtf) = plt.subplots(1, 2, figsize=(11, 4))
    rows = record["sweep"] or [{"rate_hz": record["rate_hz"], **record["setups"]}]
    rates = [r["rate_hz"] for r in rows]
    for setup in SETUPS:
        miss.plot(rates, [100.0 * r[setup]["misses"] / r[setup]["ticks"] for r in rows], marker="o",
                  label=setup)
        rtf.plot(rates, [r[setup]["speech_rtf"] or float("nan") for r in rows], marker="o", label=setup)
    miss.set(xlabel="control rate (Hz)", ylabel="missed deadlines (%)")
    rtf.set(xlabel="control rate (Hz)", ylabel="speech RTF (< 1: faster than real time)")
    rtf.axhline(1.0, color="gray", linestyle="--")
    for ax in (miss, rtf):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("a policy loop and a speech stream on one CPU: naive threads vs one Runtime")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
