"""Benchmark (numerics): Pi0 / Pi0.5 actions in bfloat16 against float32, lerobot's recipe vs all-bf16.

Regime: batch 1, RANDOM weights (a lerobot 0.6.1 policy dir written by
`flashrt.testing.synthetic.pi0.write_checkpoint`, stored float32) at the bench presets of
`flashrt.bench.adapters.pi0` (tiny, small); the same observations and flow-matching noise for every
variant; the eager backend on the CPU (bfloat16 runs there). Three loads of the same dir:

    fp32      precision="float32" (the reference of this comparison)
    lerobot   precision="bfloat16", fp32_modules="lerobot" (default): SigLIP, projector, norms and the
              action / state / time heads stay float32, as lerobot's bf16 mode keeps them
    all-bf16  precision="bfloat16", fp32_modules="none"

Metric: max |Δ| of the un-normalized action chunks vs fp32 over the observations, and the same relative
to the fp32 chunks' max |a| (random weights: the scale of the actions is arbitrary).

    python bench/pi0_bf16_recipe.py                       # tiny and small, pi0 and pi05, 8 observations
    python bench/pi0_bf16_recipe.py --preset small --obs 16

Prints a table on stderr and ONE JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

VARIANTS = {"fp32": ("float32", "lerobot"), "lerobot": ("bfloat16", "lerobot"),  # (precision, fp32_modules)
            "all-bf16": ("bfloat16", "none")}
OBS_KEYS = ("images", "state", "prompt")


def _actions(policy: Any, observations: list[dict[str, Any]]) -> Any:
    import numpy as np

    return np.stack([policy.infer({k: o[k] for k in OBS_KEYS}, noise=o["noise"])["actions"]
                     for o in observations])


def measure(variant: str, preset: str, n_obs: int, folder: Path) -> dict[str, Any]:
    """max |Δaction| of each bf16 variant vs fp32 for one model variant and preset."""
    import numpy as np
    import torch

    from flashrt.bench.adapters.pi0 import PRESETS, TOKENIZER_MAX, observations
    from flashrt.runner.policy import load_policy
    from flashrt.testing.synthetic.pi0 import SyntheticSpec, write_checkpoint

    p = PRESETS[preset]
    sizes = replace(p.sizes, max_tokens=TOKENIZER_MAX[variant])
    write_checkpoint(folder, SyntheticSpec(variant, sizes, ("top", "wrist"), p.vocab, torch.float32, 0))
    chunks = {}
    for name, (precision, fp32_modules) in VARIANTS.items():
        policy = load_policy(folder, precision=precision, backend="eager", fp32_modules=fp32_modules)
        obs = observations(policy.frontend, n_obs, seed=1, frame=p.frame)
        chunks[name] = _actions(policy, obs)
    ref = chunks["fp32"]
    scale = float(np.abs(ref).max())
    out = {"variant": variant, "preset": preset, "observations": n_obs, "fp32_max_abs_action": scale}
    for name in ("lerobot", "all-bf16"):
        delta = float(np.abs(chunks[name] - ref).max())
        out[name] = {"max_abs_delta": delta, "relative": delta / scale}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("tiny", "small", "both"), default="both")
    parser.add_argument("--variant", choices=("pi0", "pi05", "both"), default="both")
    parser.add_argument("--obs", type=int, default=8, help="observations per model")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    presets = ("tiny", "small") if args.preset == "both" else (args.preset,)
    variants = ("pi0", "pi05") if args.variant == "both" else (args.variant,)
    rows = []
    with tempfile.TemporaryDirectory(prefix="flashrt-bf16-") as tmp:
        for preset in presets:
            for variant in variants:
                rows.append(measure(variant, preset, args.obs, Path(tmp) / f"{variant}-{preset}"))
    print(f"{'model':14} {'max|a| fp32':>12} {'lerobot Δ':>11} {'rel':>8} {'all-bf16 Δ':>11} {'rel':>8}",
          file=sys.stderr)
    for r in rows:
        print(f"{r['variant'] + ' ' + r['preset']:14} {r['fp32_max_abs_action']:>12.4g} "
              f"{r['lerobot']['max_abs_delta']:>11.4g} {r['lerobot']['relative']:>8.2e} "
              f"{r['all-bf16']['max_abs_delta']:>11.4g} {r['all-bf16']['relative']:>8.2e}", file=sys.stderr)
    print(json.dumps({"kind": "pi0_bf16_recipe", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
