"""`flashrt bench serve-policy`: several robots against the policy server, batched vs one at a time.

    flashrt bench serve-policy --profile cpu-small --robots 4 --requests 20 --rounds 3

Regime: closed loop, the way robots drive `flashrt serve-policy`. ``--robots`` clients (websocket +
msgpack, openpi's protocol) each send an observation, wait for its chunk, and send the next one, all
at once. Two servers over the SAME loaded policy (a random-weight Pi0.5 of the profile's preset,
batch buckets up to ``--max-batch``): "batched" (requests arriving within ``--batch-window-ms`` share
one replay) and "one-at-a-time" (``max_batch=1``: each request its own replay, in arrival order).
Rounds alternate between the two (A, B, A, B, ...) so drift hits both alike. Metric: robots served per
second (requests answered per second over a round's wall time, all rounds pooled) and per-request
latency (client send -> reply) p50 / p99; the ratio batched / one-at-a-time. Quality gate first: every
robot's batched reply equals its request served alone (same noise) within 1e-5, else nothing is timed.

A table on stderr, results.json under ``--out``, one JSON line last on stdout.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

__all__ = ["bench_serve_policy"]

MODES = ("batched", "one-at-a-time")
GATE_ATOL = 1e-5
TIMEOUT_S = 300.0


@dataclass(frozen=True)
class _Plan:
    robots: int
    requests: int
    rounds: int
    max_batch: int
    window_ms: float
    variant: str


def bench_serve_policy(
    profile: Annotated[str, typer.Option(help="bench profile: preset sizes, backend, threads")] = "cpu-small",
    variant: Annotated[str, typer.Option(help="pi05 or pi0 (a random-weight checkpoint)")] = "pi05",
    robots: Annotated[int, typer.Option(help="clients at once, each a robot in a closed loop")] = 4,
    requests: Annotated[int, typer.Option(help="requests per robot per round")] = 10,
    rounds: Annotated[int, typer.Option(help="timed rounds per mode, interleaved")] = 3,
    max_batch: Annotated[int | None, typer.Option(help="largest batch bucket (default: --robots)")] = None,
    batch_window_ms: Annotated[float, typer.Option(help="batched server's window, ms")] = 2.0,
    out: Annotated[Path | None, typer.Option(help="output folder [bench/results/serve-policy-...]")] = None,
) -> None:
    """Robots served per second and per-request latency, batched vs one at a time (module docstring)."""
    from flashrt.bench.cli import _failure, _finish, _out_dir
    from flashrt.bench.harness import torch_threads
    from flashrt.bench.profiles import check_device, load_profile
    from flashrt.errors import ConfigError, FlashRTError

    try:
        plan = _Plan(robots, requests, rounds, max_batch or robots, batch_window_ms, variant)
        if min(robots, requests, rounds, plan.max_batch) < 1 or variant not in ("pi0", "pi05"):
            raise ConfigError("--robots, --requests, --rounds and --max-batch must be >= 1; "
                              "--variant pi0 or pi05")
        prof = load_profile(profile)
        device = check_device(prof)
    except FlashRTError as exc:
        return _finish(_failure("serve-policy", variant, profile, exc), None)
    folder = _out_dir(out, "serve-policy", variant, profile)
    try:
        with torch_threads(prof.device.threads), tempfile.TemporaryDirectory() as tmp:
            record = _measure(plan, prof, device, Path(tmp))
    except (FlashRTError, ImportError) as exc:
        return _finish(_failure("serve-policy", variant, profile, exc), folder)
    _render(record)
    line = {"bench": "serve-policy", "variant": variant, "profile": prof.name, "robots": robots,
            **{f"{m}_robots_per_s": record["modes"][m]["robots_per_s"] for m in MODES},
            "speedup": record["speedup"], "status": record["status"]}
    _finish({**record, "line": line}, folder)


def _load(plan: _Plan, prof: Any, device: str, tmp: Path) -> Any:
    from flashrt.bench.adapters.pi0 import checkpoint_spec
    from flashrt.runner.policy import batch_ladder, load_policy
    from flashrt.testing.synthetic.pi0 import write_checkpoint

    folder = write_checkpoint(tmp, checkpoint_spec(plan.variant, prof), device)
    return load_policy(folder, device=device, backend=prof.runtime.backend,
                       batches=batch_ladder(plan.max_batch))


def _measure(plan: _Plan, prof: Any, device: str, tmp: Path) -> dict[str, Any]:
    from flashrt.bench.adapters.pi0 import PRESETS, observations
    from flashrt.runtime.heap import settle
    from flashrt.serve.policy_server import PolicyServer

    start = time.perf_counter()
    policy = _load(plan, prof, device, tmp)
    load_s = time.perf_counter() - start
    heap = settle()  # as `flashrt serve-policy` does once its policy is loaded (flashrt.runtime.heap)
    messages = [{**{k: o[k] for k in ("images", "state", "prompt")}, "noise": o["noise"]}
                for o in observations(policy, plan.robots, 0, PRESETS[prof.shapes.preset].frame)]
    servers = {"batched": PolicyServer(policy, port=0, max_batch=plan.max_batch,
                                       batch_window_ms=plan.window_ms),
               "one-at-a-time": PolicyServer(policy, port=0, max_batch=1)}
    try:
        for srv in servers.values():
            srv.start()
        gate = _gate(policy, servers["batched"].port, messages)
        samples: dict[str, list] = {m: [] for m in MODES}
        if gate["passed"]:
            for mode in MODES:  # warm-up round, not counted
                _round(servers[mode].port, messages, 2)
            for _ in range(plan.rounds):
                for mode in MODES:
                    samples[mode].append(_round(servers[mode].port, messages, plan.requests))
        report = {m: _summary(samples[m], servers[m]) for m in MODES}
    finally:
        for srv in servers.values():
            srv.close()
    base = report["one-at-a-time"]["robots_per_s"]
    speedup = report["batched"]["robots_per_s"] / base if base else None
    return {"schema": "flashrt.serve-policy.result/1", "kind": "serve-policy", "variant": plan.variant,
            "profile": {"name": prof.name, "preset": prof.shapes.preset, "backend": prof.runtime.backend},
            "robots": plan.robots, "requests_per_round": plan.requests, "rounds": plan.rounds,
            "batches": list(policy.batches), "batch_window_ms": plan.window_ms, "load_s": load_s,
            "gate": gate, "modes": report, "speedup": speedup, "heap": heap.to_dict(),
            "status": "ok" if gate["passed"] else "gated-out"}


def _client(stack: contextlib.ExitStack, port: int) -> Any:
    """A connection closed with `stack`, its metadata read."""
    from websockets.sync.client import connect

    ws = stack.enter_context(connect(f"ws://127.0.0.1:{port}", max_size=None, compression=None))
    ws.recv(timeout=TIMEOUT_S)
    return ws


def _ask(ws: Any, message: dict[str, Any]) -> dict[str, Any]:
    from flashrt.serve.wire import packb, unpackb

    ws.send(packb(message))
    reply = ws.recv(timeout=TIMEOUT_S)
    if isinstance(reply, str):
        raise RuntimeError(f"the server refused a benchmark request: {reply}")
    return unpackb(reply, 2**30)


def _gate(policy: Any, port: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Every robot's reply from one batched round equals its request served alone (same noise)."""
    got = _round(port, messages, 1, keep=True)["replies"]
    worst = max(float(np.abs(got[i]["actions"] - policy.infer(
        {k: v for k, v in m.items() if k != "noise"}, noise=m["noise"])["actions"]).max())
        for i, m in enumerate(messages))
    return {"max_abs_diff": worst, "atol": GATE_ATOL, "passed": worst <= GATE_ATOL,
            "batch": max(r["server_timing"]["batch"] for r in got.values())}


def _round(port: int, messages: list[dict[str, Any]], requests: int, keep: bool = False) -> dict[str, Any]:
    """All robots at once, each `requests` requests in a closed loop: latencies, wall time, batches."""
    with contextlib.ExitStack() as stack:
        return _robots([_client(stack, port) for _ in messages], messages, requests, keep)


def _robots(clients: list[Any], messages: list[dict[str, Any]], requests: int, keep: bool) -> dict[str, Any]:
    barrier = threading.Barrier(len(clients) + 1, timeout=TIMEOUT_S)
    latencies: list[float] = []
    batches: list[int] = []
    replies: dict[int, Any] = {}
    errors: list[Exception] = []

    def robot(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(requests):
                sent = time.perf_counter()
                reply = _ask(clients[i], messages[i])
                latencies.append((time.perf_counter() - sent) * 1e3)
                batches.append(int(reply["server_timing"]["batch"]))
                if keep:
                    replies[i] = reply
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=robot, args=(i,), daemon=True) for i in range(len(clients))]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join(TIMEOUT_S)
    wall = time.perf_counter() - start
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"a robot failed: {errors[0] if errors else 'timed out'}")
    return {"wall_s": wall, "served": len(latencies), "latencies_ms": latencies, "batches": batches,
            "replies": replies}


def _summary(samples: list[dict[str, Any]], server: Any) -> dict[str, Any]:
    from flashrt.bench.serve_load import _percentiles

    latencies = [x for s in samples for x in s["latencies_ms"]]
    batches = [x for s in samples for x in s["batches"]]
    served, wall = sum(s["served"] for s in samples), sum(s["wall_s"] for s in samples)
    return {"robots_per_s": served / wall if wall else None, "served": served, "wall_s": wall,
            "latency_ms": _percentiles(latencies), "mean_batch": float(np.mean(batches)) if batches else None,
            "per_round_robots_per_s": [s["served"] / s["wall_s"] for s in samples],
            "server_rounds": dict(server.rounds), "errors": server.errors}


def _render(record: dict[str, Any]) -> None:
    gate = record["gate"]
    typer.echo(f"serve-policy {record['variant']} {record['profile']['name']}: {record['robots']} robots, "
               f"batches {record['batches']}, window {record['batch_window_ms']} ms; gate max |diff| "
               f"{gate['max_abs_diff']:.2e} ({'pass' if gate['passed'] else 'FAIL'})", err=True)
    typer.echo(f"{'mode':15} {'robots/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'mean batch':>10} {'served':>7}",
               err=True)
    for mode, r in record["modes"].items():
        lat = r["latency_ms"]
        if r["robots_per_s"] is None:
            typer.echo(f"{mode:15} (not timed)", err=True)
            continue
        typer.echo(f"{mode:15} {r['robots_per_s']:9.2f} {lat['p50']:8.1f} {lat['p99']:8.1f} "
                   f"{r['mean_batch']:10.2f} {r['served']:7d}", err=True)
    if record["speedup"] is not None:
        typer.echo(f"batched / one-at-a-time: {record['speedup']:.2f}x robots served per second", err=True)
