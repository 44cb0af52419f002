"""`flashrt kernels`: the kernels one replay launches on a GPU, per model at its release size.

Counted on the meta device (`flashrt.profile.kernels`: the rule of what is one kernel is there), so it
runs anywhere in seconds, no weights and no GPU needed. Regime: batch 1; Pi0 / Pi0.5 from their model
cards (models/pi0-base.toml, pi05-base.toml: SigLIP So400m/14, Gemma 2B + 300M expert) with
``--cams`` cameras (default 2), the card's Euler steps (10) and chunk (50), its longest prompt bucket
(``tokenizer_max_length``); every vocoder card at its preset, the largest bucket of its card. Metric:
kernels per replay (total, and the most frequent ops with ``--top``), for each row of the kernel table
(`flashrt.nn.fused.KERNELS`): "aten" (the references: what the CPU and a CUDA install without the csrc
library run) and "fused" (the ``flashrt::`` custom ops, one kernel each: a CUDA install with csrc
built). Vocoders use no fused op: both rows are the same.

    flashrt kernels                       # every model, bf16 (the GPU precision), table + JSON line
    flashrt kernels pi05-base --top 12    # one model, its op breakdown (of the fused row)
    flashrt kernels --precision fp32

Prints a table on stderr and one JSON line last on stdout: {"kind": "kernels", "precision", "cams",
"models": {card: {"aten": {"total", "top"}, "fused": {"total", "top"}}}}.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from flashrt.profile.kernels import KernelCount

__all__ = ["count_card", "policy_count", "vocoder_count", "kernels"]

PRECISIONS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
ROWS = ("aten", "fused")  # rows of flashrt.nn.fused.KERNELS


def policy_count(card: dict[str, Any], dtype: Any, cams: int = 2, kernels: str = "fused") -> KernelCount:
    """Pi0 / Pi0.5 at the card's sizes: the real loader on a meta checkpoint, one replay of the longest
    prompt bucket with the kernel-table row ``kernels``."""
    from flashrt.frontends.pi0.config import config_from_card
    from flashrt.frontends.pi0.frontend import Pi0Frontend
    from flashrt.frontends.pi0.synthetic import meta_checkpoint
    from flashrt.frontends.pi0.weights import load_pi0
    from flashrt.nn.fused import use_kernels

    config = config_from_card(card)
    model = load_pi0(config, meta_checkpoint(config), device="meta", dtype=dtype)
    use_kernels(model, kernels)
    prompt = int(card.get("preprocess", {}).get("tokenizer_max_length", 48))
    return Pi0Frontend(model, cams, (prompt,), "eager").kernels_per_replay()


def vocoder_count(card: dict[str, Any], dtype: Any) -> KernelCount:
    """A vocoder at its card's preset, one replay of the card's largest bucket."""
    from flashrt.frontends.vocoders import config_for, get_family
    from flashrt.frontends.vocoders.kernels import kernels_per_replay, meta_frontend

    family = get_family(card["family"])
    config = config_for(family, card.get("preset"), card.get("config"))
    return kernels_per_replay(meta_frontend(family, config, dtype, card.get("runtime", {}).get("buckets")))


def count_card(name: str, precision: str = "bf16", cams: int = 2, kernels: str = "fused") -> KernelCount:
    """Kernels per replay of the model card ``name`` (models/<name>.toml), kernel-table row ``kernels``."""
    import torch

    from flashrt.resources import read_data

    card = read_data("models", name)
    dtype = getattr(torch, PRECISIONS[precision])
    if card.get("family") == "pi0":
        return policy_count(card, dtype, cams, kernels)
    return vocoder_count(card, dtype)


def release_cards() -> list[str]:
    """Every shipped release-size card (the tiny test cards left out)."""
    from flashrt.resources import list_data

    return [name for name in list_data("models") if not name.endswith("-tiny")]


def kernels(
    models: Annotated[list[str] | None, typer.Argument(help="model cards [all release ones]")] = None,
    precision: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = "bf16",
    cams: Annotated[int, typer.Option(help="cameras of the Pi0 / Pi0.5 step")] = 2,
    top: Annotated[int, typer.Option(help="also print the N most frequent ops of each model")] = 0,
) -> None:
    """Kernels one replay launches on a GPU, per model at its release size (counted on the meta device)."""
    from flashrt.errors import ConfigError
    from flashrt.profile.report import json_line

    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision!r}: choose one of {sorted(PRECISIONS)}")
    names = models or release_cards()
    counts = {name: {k: count_card(name, precision, cams, k) for k in ROWS} for name in names}
    typer.echo(f"{'model':32} {'aten':>8} {'fused':>8}   kernels per replay ({precision}, {cams} cameras "
               "for Pi0/Pi0.5)", err=True)
    for name, rows in counts.items():
        typer.echo(f"{name:32} {rows['aten'].total:>8,d} {rows['fused'].total:>8,d}", err=True)
        for op, n in rows["fused"].top(top):
            typer.echo(f"{'':34}{n:>8,d}  {op}", err=True)
    models = {name: {k: c.to_dict() for k, c in rows.items()} for name, rows in counts.items()}
    typer.echo(json_line({"kind": "kernels", "precision": precision, "cams": cams, "models": models}))
