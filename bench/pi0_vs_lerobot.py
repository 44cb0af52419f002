"""Benchmark: Pi0 / Pi0.5 end to end on the CPU, flashrt `Policy.infer` vs lerobot 0.6.1, same weights.

Regime: batch 1, one observation -> one action chunk, float32, a small random-weight model (Gemma width
256, 4 layers, MLP 1024; expert width 128; SigLIP width 128, 4 layers at 224 px, i.e. 256 image
tokens per camera; 2 cameras fed 480 x 640 uint8 frames; 10 denoising steps; chunk 50; prompt limit
48 tokens, 200 for Pi0.5). Both sides start from the same raw observation (uint8 images, raw state,
prompt text) and end with un-normalized actions:

    lerobot  uint8 -> float CHW / 255, `policy_preprocessor` (normalize, tokenize, ...),
             `PI0Policy.predict_action_chunk(batch, noise=...)`, `policy_postprocessor` (un-normalize)
    flashrt  `load_policy(dir).infer(obs, noise=...)` on the same lerobot policy dir (eager backend)

Metric: wall time per call of each side, measured A/B interleaved in one process (the order flips
every pair), median per side, the ratio of medians and the median of per-pair ratios
(lerobot_ms / flashrt_ms; > 1 means flashrt is faster), plus the ratio of process CPU time (less
sensitive to other jobs on a shared machine; with --threads 1 it is the work each side does).
A quality gate (max |Δaction| <= 1e-4 on every observation) runs before any timing counts. Stage
medians show where each side spends its time.

Runs in the reference environment with flashrt importable::

    PYTHONPATH=/work/main /work/ref/venv/bin/python bench/pi0_vs_lerobot.py [--variant pi05] [--pairs 10]

The reference venv lacks `sentencepiece` (flashrt's tokenizer backend); the script then appends
``--extra-site`` at the END of sys.path, so only missing packages are found there. By default that is
the site-packages of flashrt's own ``.venv`` for this Python version, looked up in this checkout and,
when the checkout is a git worktree, in the main checkout that holds the venv. Without sentencepiece
anywhere the script stops before building anything and says where it looked (installing sentencepiece
into the reference venv is not a fix: it changes the transformers side under test). Prints tables on
stderr, then ONE JSON line on stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GEN = ROOT / "tests" / "fixtures" / "gen" / "gen_pi0_e2e.py"
TOL = 1e-4


def _gen_module() -> Any:
    """The e2e fixture generator: tiny tokenizer builder, lerobot shrinking, statistics."""
    spec = importlib.util.spec_from_file_location("gen_pi0_e2e", GEN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _checkouts() -> list[Path]:
    """This checkout, then the main checkout when this one is a git worktree (it holds the .venv)."""
    found = [ROOT]
    try:
        common = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--path-format=absolute",
                                 "--git-common-dir"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return found
    main = Path(common.stdout.strip()).parent
    return found + ([main] if main.resolve() != ROOT.resolve() else [])


def default_extra_site() -> list[Path]:
    """Candidate site-packages of flashrt's .venv for the running Python version, in lookup order."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return [c / ".venv" / "lib" / version / "site-packages" for c in _checkouts()]


def sentencepiece_site(extra_site: str | None) -> Path | None:
    """None when sentencepiece imports as is; else the first candidate folder holding it (SystemExit
    naming every folder tried when none does)."""
    if importlib.util.find_spec("sentencepiece") is not None:
        return None
    tried = [Path(extra_site)] if extra_site else default_extra_site()
    for site in tried:
        if (site / "sentencepiece").is_dir():
            return site
    raise SystemExit("sentencepiece (flashrt's tokenizer backend) is not importable and is in none of "
                     f"{[str(t) for t in tried]}; pass --extra-site <a site-packages that has it>")


def _ensure_sentencepiece(site: Path | None) -> None:
    if site is not None:
        sys.path.append(str(site))
        print(f"note: sentencepiece taken from {site}", file=sys.stderr)


# ------------------------------------------------------------------------------------------ build
def _sizes(args: argparse.Namespace) -> tuple[dict, dict, dict]:
    head_dim = args.width // 8
    vlm = dict(width=args.width, depth=args.depth, mlp_dim=4 * args.width, num_heads=8, num_kv_heads=1,
               head_dim=head_dim)
    expert = dict(width=args.width // 2, depth=args.depth, mlp_dim=2 * args.width, num_heads=8,
                  num_kv_heads=1, head_dim=head_dim)
    vision = dict(hidden_size=args.width // 2, intermediate_size=2 * args.width, num_hidden_layers=args.depth,
                  num_attention_heads=args.width // 2 // head_dim, patch_size=14)
    return vlm, expert, vision


def build_lerobot(gen: Any, args: argparse.Namespace, folder: Path) -> tuple[Any, Any, Any]:
    """A random lerobot policy of the bench sizes, saved (with processors and tokenizer) into `folder`."""
    vocab = gen.build_tokenizer(folder / "tokenizer.model")
    hf_tok = gen.load_hf_tokenizer(folder / "tokenizer.model")
    gen.tokenizer_processor.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: hf_tok)
    modeling = gen.pi0_modeling if args.variant == "pi0" else gen.pi05_modeling
    gen.shrink(modeling, vocab, *_sizes(args))
    spec = dict(kind=args.variant, cameras=["top", "wrist"][: args.cams], res=args.image, state=7, action=7,
                tok_len=48 if args.variant == "pi0" else 200)
    gen.CHUNK, gen.N_ACTION_STEPS, gen.MAX_DIM, gen.STEPS = args.chunk, args.chunk, 32, args.steps
    config = gen.make_config(spec)
    policy = (modeling.PI0Policy if args.variant == "pi0" else modeling.PI05Policy)(config).eval()
    gen.randomize_(policy, seed=0)
    stats = gen.make_stats(spec, np.random.default_rng(0))
    maker = gen.make_pi0_pre_post_processors if args.variant == "pi0" else gen.make_pi05_pre_post_processors
    pre, post = maker(config, stats)
    policy.save_pretrained(folder)
    pre.save_pretrained(folder)
    post.save_pretrained(folder)
    return policy, pre, post


def observations(args: argparse.Namespace, n: int) -> list[dict]:
    rng = np.random.default_rng(1)
    prompts = ["pick up the red cube", "put the block in the box", "open the drawer", "pick up the cube"]
    return [{"images": {c: rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
                        for c in ["top", "wrist"][: args.cams]},
             "state": rng.normal(0, 1, 7).astype(np.float32), "prompt": prompts[i % len(prompts)],
             "noise": rng.normal(0, 1, (1, args.chunk, 32)).astype(np.float32)} for i in range(n)]


# ------------------------------------------------------------------------------------------ the two sides
def run_lerobot(side: tuple, o: dict) -> tuple[np.ndarray, dict[str, float]]:
    policy, pre, post = side
    cpu0, t0 = time.process_time(), time.perf_counter()
    batch = {f"observation.images.{c}": torch.from_numpy(img).permute(2, 0, 1).to(torch.float32) / 255.0
             for c, img in o["images"].items()}
    batch.update({"observation.state": torch.from_numpy(o["state"]), "task": o["prompt"]})
    batch = pre(batch)
    t1 = time.perf_counter()
    with torch.no_grad():
        actions = policy.predict_action_chunk(batch, noise=torch.from_numpy(o["noise"]))
    t2 = time.perf_counter()
    actions = post(actions)
    t3, cpu3 = time.perf_counter(), time.process_time()
    stages = {"preprocess_ms": (t1 - t0) * 1e3, "model_ms": (t2 - t1) * 1e3,
              "postprocess_ms": (t3 - t2) * 1e3, "total_ms": (t3 - t0) * 1e3, "cpu_ms": (cpu3 - cpu0) * 1e3}
    return actions[0].numpy(), stages


def run_flashrt(policy: Any, o: dict) -> tuple[np.ndarray, dict[str, float]]:
    cpu0, t0 = time.process_time(), time.perf_counter()
    out = policy.infer({k: o[k] for k in ("images", "state", "prompt")}, noise=o["noise"])
    stages = {**out["timing"], "total_ms": (time.perf_counter() - t0) * 1e3,
              "cpu_ms": (time.process_time() - cpu0) * 1e3}
    return out["actions"], stages


def gate(lerobot: tuple, flashrt: Any, obs: list[dict]) -> float:
    worst = 0.0
    for o in obs:
        a, _ = run_lerobot(lerobot, o)
        b, _ = run_flashrt(flashrt, o)
        worst = max(worst, float(np.abs(a - b).max()))
    if not worst <= TOL:
        raise SystemExit(f"quality gate failed: max |flashrt - lerobot| = {worst:.3e} > {TOL}")
    return worst


def timed_pairs(lerobot: tuple, flashrt: Any, obs: list[dict], pairs: int) -> dict[str, list]:
    rec: dict[str, list] = {"lerobot": [], "flashrt": [], "ratio": []}
    for k in range(pairs):
        for o in obs:
            order = ("lerobot", "flashrt") if k % 2 == 0 else ("flashrt", "lerobot")
            got = {}
            for side in order:
                got[side] = run_lerobot(lerobot, o)[1] if side == "lerobot" else run_flashrt(flashrt, o)[1]
            rec["lerobot"].append(got["lerobot"])
            rec["flashrt"].append(got["flashrt"])
            rec["ratio"].append(got["lerobot"]["total_ms"] / got["flashrt"]["total_ms"])
    return rec


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def report(args: argparse.Namespace, rec: dict[str, list], worst: float, info: dict) -> dict[str, Any]:
    from flashrt.profile.report import json_line, kv_table, print_tables

    lr, fr = _medians(rec["lerobot"]), _medians(rec["flashrt"])
    result = {"bench": "pi0_vs_lerobot", "variant": args.variant, "device": "cpu", "threads": args.threads,
              "sizes": {"width": args.width, "depth": args.depth, "cams": args.cams, "steps": args.steps,
                        "chunk": args.chunk, "image": args.image},
              "calls": len(rec["ratio"]), "gate_max_abs": worst,
              "lerobot_ms": lr, "flashrt_ms": fr, "ratio_of_medians": lr["total_ms"] / fr["total_ms"],
              "median_pair_ratio": statistics.median(rec["ratio"]), "target_ratio": 2.0,
              "cpu_ratio_of_medians": lr["cpu_ms"] / fr["cpu_ms"], "load_avg_1min": os.getloadavg()[0],
              "flashrt_load_s": info["load_s"]}
    print_tables(
        kv_table({f"lerobot {k}": v for k, v in lr.items()} | {f"flashrt {k}": v for k, v in fr.items()},
                 f"{args.variant}: median ms over {len(rec['ratio'])} calls each (A/B interleaved)"),
        kv_table({"ratio of medians (lerobot / flashrt)": result["ratio_of_medians"],
                  "median per-pair ratio": result["median_pair_ratio"],
                  "CPU-time ratio of medians": result["cpu_ratio_of_medians"],
                  "1-min load average": result["load_avg_1min"], "gate max |Δaction|": worst,
                  "flashrt load + capture (s)": info["load_s"]}, "speed"),
        console=_stderr_console())
    print(json_line(result))
    return result


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=("pi0", "pi05"), default="pi0")
    parser.add_argument("--pairs", type=int, default=8, help="timed rounds over all observations")
    parser.add_argument("--obs", type=int, default=3, help="distinct observations")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--cams", type=int, default=2, choices=(1, 2))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=50)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--extra-site", default=None,
                        help="site-packages to take sentencepiece from (default: flashrt's .venv)")
    args = parser.parse_args(argv)
    site = sentencepiece_site(args.extra_site)  # before any build: a missing tokenizer stops here
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    gen = _gen_module()
    with tempfile.TemporaryDirectory() as tmp:
        lerobot = build_lerobot(gen, args, Path(tmp))
        _ensure_sentencepiece(site)  # after the HF tokenizer exists: protobuf registers once
        from flashrt.runner.policy import load_policy

        start = time.perf_counter()
        flashrt = load_policy(tmp, tokenizer=Path(tmp) / "tokenizer.model")
        info = {"load_s": time.perf_counter() - start}
        obs = observations(args, args.obs)
        worst = gate(lerobot, flashrt, obs)
        timed_pairs(lerobot, flashrt, obs, args.warmup)
        return report(args, timed_pairs(lerobot, flashrt, obs, args.pairs), worst, info)


if __name__ == "__main__":
    main()
