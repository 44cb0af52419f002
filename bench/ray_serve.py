"""`flashrt bench serve` against the speech chain on Ray Serve: 1 vs 2 LM replicas, and Serve's overhead
against `flashrt serve`, on the same offered loads.

    python bench/ray_serve.py --voice tests/fixtures/tts/orpheus_tiny --loads 1,2,4 --requests 24

1. `flashrt serve --voice orpheus=VOICE --threads 1` in its own process on 127.0.0.1;
   `flashrt bench serve --url` against it measures the single-stream capacity and TTFA; its capacity
   and goodput deadline are then given (``--capacity``, ``--deadline-ms``) to every other run, so all
   offer the same arrivals.
2. A one-node Ray cluster on 127.0.0.1 (`init_local`, ``--cpus``), Serve's proxy on 127.0.0.1, the voice
   deployed as lm -> vocoder -> ingress (`deploy_speech`; each replica one torch thread, ``--lm-cpus``
   per lm replica) with 1, then 2 lm replicas; `flashrt bench serve --url` against each.
3. Serve's overhead per request: with 1 lm replica, ``--pairs`` requests one at a time, alternately to
   `flashrt serve` and to the Ray app (nothing else in flight), the TTFA difference per pair.
4. `flashrt serve` again, on the same arrivals (the machine's other load drifts: two runs of the
   baseline bracket the Ray runs).

Per run: the warm single-stream TTFA (sequential requests, nothing else in flight), and per load served
requests per second (served / the level's wall time), TTFA p50 / p99 and goodput. A table on stdout,
every run's results.json under ``--out``, one JSON line last. Every request goes to 127.0.0.1; each run's
levels are bounded by ``--requests`` and the client timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PORT = 18531  # Serve's proxy
LOCAL_PORT = 18532  # flashrt serve


def bench(args: list[str], out: Path) -> dict[str, Any]:
    """One `flashrt bench serve` run (a child process); its results.json."""
    command = [sys.executable, "-m", "flashrt.cli", "bench", "serve", *args, "--no-plot", "--out", str(out)]
    print("$", " ".join(command[2:]), file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"bench serve failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads((out / "results.json").read_text())


def summary(record: dict[str, Any]) -> dict[str, Any]:
    levels = record["modes"]["off"]
    return {"warm_ttfa_ms": record["single_stream"]["warm_ttfa_ms"],
            "warm_total_ms": record["single_stream"]["warm_total_ms"],
            "levels": [{"load": lv["load"], "rate_per_s": lv["rate_per_s"], "served": lv["served"],
                        "offered": lv["offered"], "served_per_s": lv["served"] / lv["wall_s"],
                        "ttfa_p50_ms": lv["ttfa_ms"].get("p50"), "ttfa_p99_ms": lv["ttfa_ms"].get("p99"),
                        "goodput": lv["goodput"], "refused": sum(lv["refused"].values()),
                        "errors": lv["errors"], "timeouts": lv["timeouts"]} for lv in levels]}


def deploy(voice: str, replicas: int, lm_cpus: float) -> None:
    """The voice on the running Serve as lm -> vocoder -> ingress, `replicas` lm replicas."""
    from flashrt.integrations.ray_serve import SpeechApp, StageScale, deploy_speech

    one = {"threads": 1, "max_ongoing_requests": 8, "max_queued_requests": 16}
    deploy_speech(SpeechApp(str(Path(voice).resolve()),
                            lm=StageScale(replicas=replicas, num_cpus=lm_cpus, **one),
                            vocoder=StageScale(num_cpus=0.5, **one),
                            ingress=StageScale(num_cpus=0.25, threads=1, max_ongoing_requests=64,
                                               max_queued_requests=64)))


@contextmanager
def flashrt_serve(voice: str) -> Iterator[str]:
    """`flashrt serve` in its own process (as the Ray replicas are) on 127.0.0.1; its URL."""
    import httpx

    command = [sys.executable, "-m", "flashrt.cli", "serve", "--voice", f"orpheus={voice}", "--threads", "1",
               "--port", str(LOCAL_PORT)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{LOCAL_PORT}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"flashrt serve did not come up ({server.returncode})")
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)


def ttfa_ms(url: str, text: str) -> float:
    """One streamed request's time to its first audio bytes, ms (raises on anything but a 200)."""
    import httpx

    body = {"model": "tts-1", "voice": "tara", "input": text, "response_format": "pcm", "seed": 1}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=60) as reply:
        reply.raise_for_status()
        parts = reply.iter_raw()
        next(parts)
        first = (time.perf_counter() - start) * 1e3
        for _ in parts:
            pass
    return first


def paired_overhead(local: str, ray_url: str, rounds: int) -> dict[str, Any]:
    """Serve's TTFA added per request: the same request, one at a time, alternately to `flashrt serve`
    and to the Ray app (both idle otherwise), so the machine's drifting load falls on both alike; the
    percentiles of the per-pair differences and of each side."""
    texts = ("Hello there.", "How can I help you today?", "The weather is fine.")
    pairs = []
    for k in range(rounds):
        text = texts[k % len(texts)]
        first, second = (local, ray_url) if k % 2 == 0 else (ray_url, local)
        a, b = ttfa_ms(first, text), ttfa_ms(second, text)
        local_ms, ray_ms = (a, b) if first == local else (b, a)
        pairs.append((local_ms, ray_ms))

    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    added = [r - loc for loc, r in pairs]
    return {"rounds": rounds, "added_ms": {"p10": pct(added, 0.1), "p50": pct(added, 0.5),
                                           "p90": pct(added, 0.9)},
            "flashrt_serve_ttfa_ms": {"p50": pct([p[0] for p in pairs], 0.5)},
            "ray_ttfa_ms": {"p50": pct([p[1] for p in pairs], 0.5)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--voice", default="tests/fixtures/tts/orpheus_tiny")
    parser.add_argument("--loads", default="1,2,4")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--warm", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=40, help="alternating requests of the overhead pairing")
    parser.add_argument("--cpus", type=float, default=2.0, help="the local Ray cluster's CPUs")
    parser.add_argument("--lm-cpus", type=float, default=0.5, help="CPUs per lm replica")
    parser.add_argument("--out", type=Path,
                        default=Path("bench/results") / time.strftime("ray-serve-%Y%m%d-%H%M%S"))
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    levels = ["--loads", opts.loads, "--requests", str(opts.requests), "--warm", str(opts.warm),
              "--timeout", "60", "--level-cap", "120"]

    import builtins

    import ray
    from ray import serve

    from flashrt.integrations.ray_serve import init_local

    with flashrt_serve(opts.voice) as local_url:
        local = bench(["--url", local_url, "--voice", "orpheus", *levels], opts.out / "flashrt-serve")
        shared = [*levels, "--capacity", str(local["capacity_rps"]),
                  "--deadline-ms", str(local["deadline_ms"])]
        runs = {"flashrt serve": summary(local)}
        saved_print = builtins.print  # Ray patches it
        init_local(num_cpus=opts.cpus, log_to_driver=False)
        try:
            assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
            serve.start(http_options={"host": "127.0.0.1", "port": PORT})
            overhead = None
            for replicas in (1, 2):
                deploy(opts.voice, replicas, opts.lm_cpus)
                try:
                    record = bench(["--url", f"http://127.0.0.1:{PORT}", "--voice", "orpheus", *shared],
                                   opts.out / f"ray-lm{replicas}")
                    runs[f"ray, {replicas} lm"] = summary(record)
                    if replicas == 1:
                        overhead = paired_overhead(local_url, f"http://127.0.0.1:{PORT}", opts.pairs)
                finally:
                    serve.delete("flashrt-speech")
        finally:
            serve.shutdown()
            ray.shutdown()
            builtins.print = saved_print
        again = bench(["--url", local_url, "--voice", "orpheus", *shared], opts.out / "flashrt-serve-2")
        runs["flashrt serve, again"] = summary(again)
    result = {"bench": "ray_serve", "voice": opts.voice, "capacity_rps": local["capacity_rps"],
              "deadline_ms": local["deadline_ms"], "cpus": os.cpu_count(),
              "loadavg_after": os.getloadavg(), "overhead": overhead, "runs": runs}
    (opts.out / "ray_serve.json").write_text(json.dumps(result, indent=1))
    table(result)
    print(json.dumps(result))


def table(result: dict[str, Any]) -> None:
    print(f"capacity {result['capacity_rps']:.2f} req/s, deadline {result['deadline_ms']:.0f} ms, "
          f"load average after {result['loadavg_after']}")
    base = result["runs"]["flashrt serve"]["warm_ttfa_ms"]
    if result["overhead"]:
        added = result["overhead"]["added_ms"]
        print(f"Serve's TTFA added per request ({result['overhead']['rounds']} pairs): "
              f"p10 {added['p10']:.1f} p50 {added['p50']:.1f} p90 {added['p90']:.1f} ms")
    for name, run in result["runs"].items():
        print(f"{name}: warm TTFA {run['warm_ttfa_ms']:.1f} ms (+{run['warm_ttfa_ms'] - base:.1f}), "
              f"warm request {run['warm_total_ms']:.0f} ms")
        for lv in run["levels"]:
            print(f"  {lv['load']:g}x ({lv['rate_per_s']:.2f}/s): served {lv['served']}/{lv['offered']} "
                  f"{lv['served_per_s']:.2f}/s, TTFA p50 {lv['ttfa_p50_ms'] or 0:.0f} p99 "
                  f"{lv['ttfa_p99_ms'] or 0:.0f} ms, goodput {lv['goodput']:.2f}, refused {lv['refused']}, "
                  f"errors {lv['errors']}, timeouts {lv['timeouts']}")


if __name__ == "__main__":
    main()
