"""`flashrt bench serve`: the speech server under open-loop load (`flashrt.bench.serve_load`).

    flashrt bench serve --voice en_US-joe-medium --loads 1,2,4,8 --requests 24 --compare-admission
    flashrt bench serve --trace requests.jsonl --compare-admission      # a frozen trace, replayed as is
    flashrt bench serve --voice orpheus_dir --slots 1,8                 # one at a time vs batched decode

Without ``--url`` it serves the voice in this process (127.0.0.1, a free port) and measures that
server; with ``--url`` it measures a running `flashrt serve`. Requests ask for ``pcm`` (24 kHz). Admission:
"on" sends each request with ``ttfa_deadline_ms`` = its goodput deadline, so the server refuses at once
what it cannot start in time (503 ``deadline_unmeetable``); ``--compare-admission`` runs both on the
same arrivals, side by side. Variants: ``--cancel-every N`` (every Nth client hangs up after its first
audio), ``--slow-consumer N`` (every Nth client reads no audio and holds its connection ``--slow-hold``
seconds), ``--restart-at S`` (the in-process server is restarted S seconds into each level, requests in
flight cut: they must fail cleanly, never time out, and those sent after it is back are served;
reported per level). ``--slots 1,8`` serves the voice once per value (an Orpheus-style voice decodes that many
requests at once, a Piper voice interleaves them chunk by chunk) on the same arrivals, capacity and
deadline (measured on the first), side by side.
Tables on stderr, results.json (every request's record) and serve.png under ``--out``, one
JSON line last on stdout. The policy server has its own: `flashrt bench serve-policy` (robots served per
second, batched vs one at a time).

``--capacity RPS`` / ``--deadline-ms MS`` fix the loads' unit and the goodput deadline instead of
measuring them, so runs against different servers (``--url``: a Ray Serve app, `flashrt serve`) offer
the same arrivals (`bench/ray_serve.py`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

__all__ = ["bench_serve"]


def bench_serve(
    voice: Annotated[str, typer.Option(help="voice to serve in-process (a name, folder or file)")]
    = "en_US-joe-medium",
    url: Annotated[str | None, typer.Option(help="measure this running server instead (http://127.0.0.1:8000)")]
    = None,
    loads: Annotated[str, typer.Option(help="offered loads, multiples of single-stream capacity")]
    = "1,2,4,8",
    requests: Annotated[int, typer.Option(help="requests offered per load level")] = 24,
    trace: Annotated[Path | None, typer.Option(help="replay this frozen trace (JSONL: t, text, optional "
                                               "deadline_ms, cancel_s) instead of Poisson levels")] = None,
    warm: Annotated[int, typer.Option(help="sequential warm requests that measure the capacity")] = 4,
    ttfa_factor: Annotated[float, typer.Option(help="goodput deadline: this x the single-stream TTFA")] = 3.0,
    admission: Annotated[bool, typer.Option(help="send the deadline with each request")] = False,
    compare_admission: Annotated[bool, typer.Option(help="run without and with admission")] = False,
    cancel_every: Annotated[int, typer.Option(help="every Nth client hangs up after its first audio")] = 0,
    slow_consumer: Annotated[int, typer.Option(help="every Nth client reads no audio (a slow consumer)")] = 0,
    slow_hold: Annotated[float, typer.Option(help="s a slow consumer holds its connection")] = 5.0,
    timeout: Annotated[float, typer.Option(help="client timeout per request, s")] = 60.0,
    level_cap: Annotated[float, typer.Option(help="wall-clock cap per load level, s")] = 180.0,
    max_pending: Annotated[int, typer.Option(help="in-process server: requests held at once")] = 16,
    capacity: Annotated[float | None, typer.Option(
        help="requests/s the loads are multiples of, instead of the measured single-stream capacity "
             "(the same arrivals against several servers, e.g. a Ray Serve app and flashrt serve)")] = None,
    deadline_ms: Annotated[float | None, typer.Option(
        help="the goodput deadline for the first audio, ms, instead of --ttfa-factor x the measured "
             "single-stream TTFA")] = None,
    seed: Annotated[int, typer.Option(help="seed of the arrival schedules")] = 0,
    out: Annotated[Path | None, typer.Option(help="output folder [bench/results/serve-...]")] = None,
    plot: Annotated[bool, typer.Option(help="write serve.png")] = True,
    threads: Annotated[int, typer.Option(help="in-process server: torch CPU threads per op, at most (0: "
                                         "torch's default); a voice picks its own from the cores free")] = 0,
    restart_at: Annotated[float | None, typer.Option(help="in-process server: restart it this many seconds "
                                                    "into each level (requests in flight are cut)")] = None,
    slots: Annotated[str | None, typer.Option(help="in-process server: requests a voice serves at once, "
                                              "one value or a list compared side by side (e.g. 1,8); "
                                              "Orpheus-style: decoded together; Piper: interleaved")] = None,
    decoder_precision: Annotated[str | None, typer.Option(
        "--decoder-precision", help="in-process server, Piper voice: 'bf16' decodes in bfloat16 "
        "(`flashrt serve --decoder-precision`)")] = None,
) -> None:
    """Open-loop load against the speech server (`flashrt serve`; the policy server: `bench serve-policy`):
    goodput, TTFA and refusals against offered load."""
    from flashrt.bench.cli import _failure, _finish, _out_dir, _save_then_plot
    from flashrt.errors import ConfigError, FlashRTError

    name = Path(voice).name or voice
    try:
        plan = _Plan(_loads(loads), requests, warm, ttfa_factor, _modes(admission, compare_admission),
                     cancel_every, slow_consumer, slow_hold, timeout, level_cap, seed,
                     None if trace is None else _trace(trace), restart_at)
        slot_list = _slot_list(slots, url)
        if threads < 0:
            raise ConfigError("--threads must be 0 (torch's default) or more")
        if restart_at is not None and (url is not None or not restart_at > 0):
            raise ConfigError("--restart-at restarts the in-process server (not --url) and must be positive")
        if any(v is not None and not v > 0 for v in (capacity, deadline_ms)):
            raise ConfigError("--capacity and --deadline-ms must be positive")
        if min(requests, warm) < 1 or min(cancel_every, slow_consumer) < 0 \
                or not min(ttfa_factor, timeout, level_cap) > 0 or not slow_hold >= 0:
            raise ConfigError("--requests and --warm must be >= 1, --cancel-every and --slow-consumer >= 0, "
                              "--slow-hold >= 0; --ttfa-factor, --timeout, --level-cap > 0")
    except FlashRTError as exc:  # a bad option: its error and the JSON line, no output folder
        return _finish(_failure("serve", name, "speech", exc), None)
    folder = _out_dir(out, "serve", name, "speech")
    try:
        from flashrt.bench.harness import torch_threads

        record = None
        fixed = {k: v for k, v in (("capacity_rps", capacity), ("deadline_ms", deadline_ms)) if v is not None}
        with torch_threads(threads):
            for n in slot_list:  # the same capacity, deadline and arrivals for every server compared
                with _target(voice, url, max_pending, n, decoder_precision) as target:
                    base, served_name = target.url, target.name
                    run = asyncio.run(_measure(base, served_name, plan, record or fixed or None, target))
                record = _merge(record, run, n, len(slot_list) > 1)
        record["threads"], record["decoder_precision"] = threads, decoder_precision or "fp32"
    except (FlashRTError, ImportError) as exc:
        return _finish(_failure("serve", name, "speech", exc), folder)
    _render(record)
    record["status"] = "ok"
    files = _save_then_plot(record, folder, plot, "serve.png", _plot)
    line = {"bench": "serve", "voice": record["voice"], "capacity_rps": record["capacity_rps"],
            "deadline_ms": record["deadline_ms"], "trace": record["trace"],
            "goodput": {m: [lv["goodput"] for lv in r] for m, r in record["modes"].items()},
            "stalled": {m: [lv["stalled"] for lv in r] for m, r in record["modes"].items()},
            "loads": [lv["load"] for lv in next(iter(record["modes"].values()))], "status": "ok"}
    _finish({**record, "line": line}, folder, files)


def _trace(path: Path) -> list[Any]:
    from flashrt.bench.serve_load import parse_trace

    return parse_trace(path)


@dataclass(frozen=True)
class _Plan:
    """What `_measure` runs (the command's options)."""

    levels: list[float]
    requests: int
    warm: int
    factor: float
    modes: list[str]
    cancel_every: int
    slow_every: int
    slow_hold_s: float
    timeout_s: float
    cap_s: float
    seed: int
    trace: list[Any] | None
    restart_at_s: float | None = None

    def arrivals(self, capacity: float) -> list[tuple[float, list[Any]]]:
        """(load as a multiple of `capacity`, arrivals) per level: the trace once, as recorded (its
        load is its mean rate over its span), or one seeded Poisson schedule per load."""
        from flashrt.bench.serve_load import TEXTS, poisson_arrivals

        if self.trace is not None:
            span = max(self.trace[-1].t, 1e-9)
            return [(len(self.trace) / span / capacity, self.trace)]
        return [(load, poisson_arrivals(load * capacity, self.requests, self.seed + k, TEXTS,
                                        self.cancel_every, self.slow_every))
                for k, load in enumerate(self.levels)]


def _loads(text: str) -> list[float]:
    from flashrt.errors import ConfigError

    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not v > 0 for v in values):
        raise ConfigError(f"--loads {text!r}: give positive multiples, e.g. 1,2,4,8")
    return values


def _slot_list(text: str | None, url: str | None) -> list[int | None]:
    from flashrt.errors import ConfigError

    if text is None:
        return [None]
    if url is not None:
        raise ConfigError("--slots configures the in-process server; a running one (--url) has its own")
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--slots {text!r}: positive integers separated by commas") from None
    if not values or min(values) < 1:
        raise ConfigError(f"--slots {text!r}: positive integers separated by commas")
    return values


def _merge(record: dict[str, Any] | None, run: dict[str, Any], slots: int | None,
           compared: bool) -> dict[str, Any]:
    """One record for the servers compared: each run's modes named by its slots when there are several."""
    if compared:
        run["modes"] = {f"{mode}, slots {slots}": levels for mode, levels in run["modes"].items()}
    if record is None:
        run["slots"] = [slots]
        return run
    record["modes"].update(run["modes"])
    record["slots"].append(slots)
    return record


def _modes(admission: bool, compare: bool) -> list[str]:
    return ["off", "on"] if compare else (["on"] if admission else ["off"])


class _target:
    """(url, voice name, sample rate) of the server to measure; an in-process one is started and
    stopped around the run."""

    def __init__(self, voice: str, url: str | None, max_pending: int, slots: int | None = None,
                 decoder_precision: str | None = None) -> None:
        self.voice, self.url, self.max_pending, self.slots = voice, url, max_pending, slots
        self.options = {k: v for k, v in (("slots", slots), ("decoder_precision", decoder_precision))
                        if v is not None}
        self.thread = self.server = self.model = self.heap = None
        self.name = voice

    def __enter__(self) -> _target:
        if self.url is not None:
            self.url = self.url.rstrip("/")
            return self
        from flashrt.runner.tts import load_tts
        from flashrt.runtime.heap import settle
        from flashrt.serve.cli import voice_name

        self.name = voice_name(self.voice)
        self.model = load_tts(self.voice, **self.options)
        self.heap = settle()  # as `flashrt serve` does once its voices are loaded (flashrt.runtime.heap)
        self._start()
        self.url = self.thread.url
        return self

    def _start(self, port: int | None = None) -> None:
        from flashrt.serve.app import ServerLimits, SpeechServer
        from flashrt.serve.thread import ServerThread

        self.server = SpeechServer({self.name: self.model}, ServerLimits(max_pending=self.max_pending))
        self.thread = ServerThread(self.server, port=port)

    def restart(self) -> float:
        """Stop the in-process server the hard way (requests in flight cut after 0.2 s), start a new one
        on the same port over the same loaded model; the ms it was down."""
        start = time.perf_counter()
        port = self.thread.port
        self.server.close()  # its requests end first: 503 before their first audio, a cut stream after
        self.thread.stop(grace_s=0.2)
        self._start(port)
        return (time.perf_counter() - start) * 1e3

    def __exit__(self, *exc: object) -> None:
        if self.thread is not None:
            self.thread.stop()
        if self.server is not None:
            self.server.close()


async def _measure(url: str, voice: str, plan: _Plan, baseline: dict[str, Any] | None = None,
                   target: _target | None = None) -> dict[str, Any]:
    """Single-stream capacity, then every load level per mode. With a ``baseline`` record (an earlier
    server of a side-by-side run, or the --capacity / --deadline-ms given) its capacity and deadline
    are used where it has them, so the arrivals are the same."""
    from flashrt.bench.serve_load import TEXTS, run_level, single_stream, summarize
    from flashrt.serve.app import PCM_RATE

    bps = 2.0 * PCM_RATE  # the requests ask for OpenAI's pcm: 16-bit mono at 24 kHz
    cold, warm_runs = await single_stream(url, voice, TEXTS, plan.warm, plan.timeout_s, bps)
    served = [o for o in warm_runs if o.served]
    if not served:
        from flashrt.errors import ConfigError

        raise ConfigError(f"the server at {url} served none of {plan.warm} sequential requests "
                          f"({[o.status or o.error for o in warm_runs]})")
    mean_total_s = sum(o.total_ms for o in served) / len(served) / 1e3
    ttfa = sorted(o.ttfa_ms for o in served)[len(served) // 2]
    capacity, deadline = 1.0 / mean_total_s, plan.factor * ttfa
    if baseline is not None:
        capacity, deadline = baseline.get("capacity_rps", capacity), baseline.get("deadline_ms", deadline)
    record: dict[str, Any] = {
        "voice": voice, "url": url, "capacity_rps": capacity, "deadline_ms": deadline,
        "single_stream": {"cold": _outcome(cold), "warm_ttfa_ms": ttfa, "warm_total_ms": mean_total_s * 1e3,
                          "warm": [_outcome(o) for o in warm_runs]},
        "requests_per_level": len(plan.trace) if plan.trace is not None else plan.requests,
        "trace": plan.trace is not None, "variants": {"cancel_every": plan.cancel_every,
                                                      "slow_consumer": plan.slow_every,
                                                      "slow_hold_s": plan.slow_hold_s},
        "modes": {},
        "heap": target.heap.to_dict() if target is not None and target.heap is not None else None,
    }
    levels = plan.arrivals(capacity)
    for mode in plan.modes:
        results = []
        for load, arrivals in levels:
            before = await _drained_health(url, voice, plan.timeout_s)
            start = time.perf_counter()
            restart = _Restart(target, plan.restart_at_s)
            outcomes = await run_level(url, voice, arrivals, plan.timeout_s, bps, plan.cap_s,
                                       deadline if mode == "on" else None, plan.slow_hold_s)
            level = summarize(load, load * capacity, outcomes, deadline)
            level.wall_s = time.perf_counter() - start
            after = await _drained_health(url, voice, plan.timeout_s)
            level.server = _since(before, after) if not restart.done() else {"restarted": True, **after}
            results.append({**level.to_dict(), **restart.record(outcomes)})
        record["modes"][mode] = results
    return record


class _Restart:
    """A restart of the in-process server ``at_s`` into a level, on a timer thread (none: nothing)."""

    def __init__(self, target: _target | None, at_s: float | None) -> None:
        self.at_s, self.down_ms = at_s, None
        self.timer = None
        if target is not None and at_s is not None:
            self.timer = threading.Timer(at_s, self._run, args=(target,))
            self.timer.start()

    def _run(self, target: _target) -> None:
        self.down_ms = target.restart()

    def done(self) -> bool:
        if self.timer is None:
            return False
        self.timer.join(60)
        return self.down_ms is not None

    def record(self, outcomes: list[Any]) -> dict[str, Any]:
        """The restart's time and downtime, and the requests sent after the server was back: served?"""
        if not self.done():
            return {}
        back = self.at_s + self.down_ms / 1e3
        later = [o for o in outcomes if o.scheduled_s > back]
        return {"restart": {"at_s": self.at_s, "down_ms": self.down_ms,
                            "sent_after": len(later), "served_after": sum(1 for o in later if o.served),
                            "errors": sorted({o.error for o in outcomes if o.error} - {"timeout"})}}


def _outcome(o: Any) -> dict[str, Any]:
    return {"status": o.status, "ttfa_ms": o.ttfa_ms, "total_ms": o.total_ms, "error": o.error}


async def _drained_health(url: str, voice: str, timeout: float) -> dict[str, Any]:
    """The server's statistics for `voice` once it holds no request (bounded wait): refusals and
    outcomes (counts since it started), queue time and each stage's service / batch / fill."""
    import httpx

    async with httpx.AsyncClient(timeout=10.0) as client:
        deadline = time.perf_counter() + timeout
        while True:
            health = (await client.get(f"{url}/health")).json()
            chain = health.get("chains", {}).get(voice, {})
            if chain.get("pending", 0) == 0 or time.perf_counter() > deadline:
                stages = {name: {k: s.get(k) for k in ("service_ms", "items", "batch", "fill") if k in s}
                          for name, s in chain.get("stages", {}).items()}
                return {"refusals": health.get("refusals") or {}, "outcomes": chain.get("outcomes") or {},
                        "pending": chain.get("pending"), "queue_ms": chain.get("queue_ms"),
                        "stages": stages}
            await asyncio.sleep(0.05)


def _since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """`after` with its counts (refusals, outcomes) made this level's: less those of `before`. The
    latency figures (queue_ms, stages) stay the server's, over everything it has served."""
    def delta(key: str) -> dict[str, int]:
        return {k: v - before[key].get(k, 0) for k, v in after[key].items() if v - before[key].get(k, 0)}

    return {**after, "refusals": delta("refusals"), "outcomes": delta("outcomes"),
            "cumulative": {"refusals": after["refusals"], "outcomes": after["outcomes"]}}


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _render(record: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    single = record["single_stream"]
    console = Console(stderr=True, width=140)
    console.print(f"speech server, voice {record['voice']}: capacity {record['capacity_rps']:.2f} req/s "
                  f"(warm request {single['warm_total_ms']:.0f} ms, TTFA {single['warm_ttfa_ms']:.0f} ms; "
                  f"cold TTFA {_fmt(single['cold']['ttfa_ms'])} ms); goodput deadline "
                  f"{record['deadline_ms']:.0f} ms")
    for mode, levels in record["modes"].items():
        table = Table(title=f"admission {mode}")
        for col in ("load", "offered", "goodput", "served", "on time", "refused", "errors", "timeouts",
                    "apart", "TTFA p50", "TTFA p99", "total p99", "RTF p50", "stalled", "lag p99"):
            table.add_column(col, justify="right")
        for lv in levels:
            apart = lv["cancelled"] + lv["slow"] + lv["unsent"]
            table.add_row(f"{lv['load']:.3g}x", str(lv["offered"]), f"{lv['goodput']:.2f}", str(lv["served"]),
                          str(lv["on_time"]), str(sum(lv["refused"].values())), str(lv["errors"]),
                          str(lv["timeouts"]), str(apart), _fmt(lv["ttfa_ms"]["p50"]),
                          _fmt(lv["ttfa_ms"]["p99"]), _fmt(lv["total_ms"]["p99"]), _fmt(lv["rtf"]["p50"], 3),
                          str(lv["stalled"]), _fmt(lv["client_lag_ms"]["p99"]))
        console.print(table)
        codes = [f"{lv['load']:.3g}x {_refusals(lv['refused'])}" for lv in levels if lv["refused"]]
        if codes:
            console.print(f"refused by code: {'; '.join(codes)}")
    console.print("apart: clients that hang up or read nothing on purpose, or were not sent before the "
                  "level's cap (out of goodput's denominator); stalled: served requests whose playback, "
                  "started at the first audio, ran dry before the next bytes came; lag: how late the "
                  "client sent a request against its schedule (ms)")


def _refusals(refused: dict[str, int]) -> str:
    return ", ".join(f"{code} {n}" for code, n in sorted(refused.items()))


def _plot(record: dict[str, Any], path: Path) -> str:
    from flashrt.profile.plots import _pyplot

    plt = _pyplot()  # ImportError without matplotlib: `_save_then_plot` records why there is no figure
    fig, (good, p99) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, levels in record["modes"].items():
        x = [lv["load"] for lv in levels]
        good.plot(x, [lv["goodput"] for lv in levels], marker="o", label=f"admission {mode}")
        tail = [lv["ttfa_ms"]["p99"] or float("nan") for lv in levels]
        p99.plot(x, tail, marker="o", label=f"admission {mode}")  # mode: "off" / "on" [, "slots N"]
    good.set(xlabel="offered load (x single-stream capacity)", ylabel="goodput", ylim=(0, 1.05), xscale="log")
    p99.set(xlabel="offered load (x single-stream capacity)", ylabel="TTFA p99 of served (ms)", xscale="log")
    p99.axhline(record["deadline_ms"], color="gray", linestyle="--", label="deadline")
    loads = [lv["load"] for lv in next(iter(record["modes"].values()))]
    for ax in (good, p99):
        ax.set_xticks(loads, [f"{v:.3g}x" for v in loads])
        ax.minorticks_off()
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"flashrt serve, voice {record['voice']}: {record['requests_per_level']} requests per level")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
