"""`flashrt kernels`: the kernels one step launches on the CUDA code path, per family at its release size.

Counted on the meta device, so it runs anywhere in seconds, no weights and no GPU needed. "The CUDA
code path": every device-type check takes its CUDA branch -- the model built as a CUDA load builds it
(the CPU's oneDNN and layout choices left out), attention under the family's pinned SDPA priority.
What counts as one launch (the rule, with its reasons, is `flashrt.profile.kernels`):

* an aten op that writes memory is one kernel; views, metadata ops and bare allocations are none;
* a ``flashrt::`` custom op (rms_norm, add_rms_norm, rope_qkv, gelu_mul, silu_mul) is one kernel where
  its csrc CUDA kernel takes the call (`flashrt.ops.csrc_ops.CUDA_FORMS`), else its reference op by op;
* scaled_dot_product_attention: the backend torch's CUDA build picks from the priority -- flash: one
  kernel (+2 per q/k/v head dim not a multiple of 8, which torch pads per call); memory-efficient: one
  kernel, +2 to convert a boolean mask, +2 when the bias is unaligned (a stride before the last dim
  not a multiple of 8: torch pads it on every call); math: its decomposition, op by op;
* ``rms_norm``: one kernel (torch's fused CUDA RMSNorm) where torch takes it.

``--path``: ``cuda`` (a CUDA install with the csrc library built: each family's fused ops, which every
family's loader selects there with its one `flashrt.ops.select` pass) or ``cuda-aten`` (without it:
the ATen references of the same ops). Regime: batch 1, bf16 unless ``--precision``, ``--cams`` cameras
(default 2):

    pi0, pi05     the model cards (models/pi0-base.toml, pi05-base.toml: SigLIP So400m/14, Gemma 2B +
                  300M expert), the card's 10 Euler steps and 50-action chunk, its longest prompt bucket;
                  one whole step (vision, prefill, every denoise step)
    groot         GR00T N1.7 at its published sizes (`flashrt.testing.synthetic.groot` "full": the
                  Cosmos-Reason2-2B backbone, 16 text layers kept, VL self-attention 4, AlternateVLDiT
                  32 blocks, 4 flow steps), the largest default prompt bucket; one whole step
    pi0-fast      Pi0-FAST (PaliGemma 2B, preset "pi0_fast", prompts up to 200 tokens): two rows, the
                  prefill of the largest bucket (with the first token's pick) and one decode step
                  (one token, greedy)
    lm            the Orpheus-3B LM (Llama-3.2-3B sizes) as the Orpheus runner loads it (a slot-batched
                  decoder of 8 rows): the prefill of the 256-token bucket into one row, and one sampled
                  decode step at 1 and at 8 live rows (per step: every row advances one token)
    <card>        any model card (models/<card>.toml): Pi0 / Pi0.5 cards, every vocoder at its preset,
                  the largest bucket of its card

Metric: kernels per step; the fused share (kernels of ``flashrt::`` custom ops over the total); the
split by stage (Pi0: vision, prefix, expert, other; GR00T: vision, text, vl, dit, other); the most
frequent ops with ``--top``.

    flashrt kernels                        # every family and vocoder card, table + JSON line
    flashrt kernels pi0 pi05 --path cuda   # the two policies, the CUDA path with csrc built
    flashrt kernels groot --top 12         # one family, its op breakdown

Prints a table on stderr and one JSON line last on stdout: {"kind": "kernels", "path", "precision",
"cams", "models": {row: {"total", "fused", "fused_share", "stages", "top"}}}.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from flashrt.ops.csrc_ops import CUDA_FORMS
from flashrt.profile.kernels import KernelCount, count_kernels

__all__ = ["FAMILIES", "PATHS", "count_card", "count_family", "groot_count", "lm_count", "pi0_fast_count",
           "policy_count", "vocoder_count", "kernels"]

PRECISIONS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
PATHS = {"cuda": "fused", "cuda-aten": "aten"}  # --path -> the "decoder" ops' form (flashrt.ops.decoder)


def policy_count(card: dict[str, Any], dtype: Any, cams: int = 2, kernels: str = "fused") -> KernelCount:
    """Pi0 / Pi0.5 at the card's sizes: the real loader on a meta checkpoint, one replay of the longest
    prompt bucket with the "decoder" ops' form ``kernels``."""
    from flashrt.frontends.pi0.config import config_from_card
    from flashrt.frontends.pi0.frontend import Pi0Frontend
    from flashrt.frontends.pi0.weights import load_pi0
    from flashrt.testing.synthetic.pi0 import meta_checkpoint

    config = config_from_card(card)
    model = load_pi0(config, meta_checkpoint(config), device="meta", dtype=dtype, kernels=kernels)
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
    from flashrt.resources import read_data

    card = read_data("models", name)
    dtype = _dtype(precision)
    if card.get("family") == "pi0":
        return policy_count(card, dtype, cams, kernels)
    return vocoder_count(card, dtype)


def groot_count(dtype: Any, cams: int = 2, kernels: str = "fused") -> KernelCount:
    """GR00T N1.7 at its published sizes (module docstring), built on meta, the "decoder" ops' form
    ``kernels``, one step of the largest bucket."""
    import torch

    from flashrt import ops
    from flashrt.frontends.groot.common.config import GrootN17Config, TokenIds, text_config, vision_config
    from flashrt.frontends.groot.common.frontend import select_prefer
    from flashrt.frontends.groot.common.preprocess import PromptTokenizer
    from flashrt.frontends.groot.n17.model import GrootN17Model
    from flashrt.io.loading import reset_derived
    from flashrt.testing.synthetic import groot as synthetic

    with tempfile.TemporaryDirectory() as folder:
        tokenizer = PromptTokenizer(synthetic.write_tokenizer(Path(folder)))
    p, ids = synthetic.PRESETS["full"], tokenizer.ids
    tokens = TokenIds(ids["<|image_pad|>"], ids["<|vision_start|>"], ids["<|vision_end|>"])
    config = GrootN17Config(vision_config(p.backbone, "full"),
                            text_config(p.backbone, p.select_layer, "full"), tokens, p.head)
    with torch.device("meta"):
        model = GrootN17Model(config).to(dtype).eval().requires_grad_(False)
    reset_derived(model, "meta")
    ops.select(model, "meta", dtype, select_prefer(kernels))  # as the loader's one pass (`load_model`)
    frontend = synthetic.frontend(model, tokenizer, "full", cams, backend="eager", capture=False)
    return count_kernels(frontend.raw_step(frontend.buckets[-1]), stages=frontend.kernel_stages(),
                         custom=CUDA_FORMS)


def pi0_fast_count(dtype: Any, cams: int = 2, prompt: int = 200,
                   kernels: str = "fused") -> dict[str, KernelCount]:
    """Pi0-FAST (preset "pi0_fast") built on meta as its loader builds it, the "decoder" ops' form
    ``kernels``: the prefill of the largest default bucket and one greedy decode step."""
    from flashrt.frontends.pi0.frontend import default_buckets
    from flashrt.frontends.pi0_fast.config import preset
    from flashrt.frontends.pi0_fast.model import Pi0FastDecodeModel, Pi0FastNet
    from flashrt.io.loading import meta_twin
    from flashrt.runtime.decode import Decoder

    config = preset("pi0_fast")
    net = meta_twin(lambda: Pi0FastNet(config, kernels), dtype)  # its `reset_derived` selects the forms
    buckets = default_buckets(prompt + 1)  # the prompt and its bos, as the family's loader sizes them
    slots = max(buckets) + config.max_decoding_steps
    model = Pi0FastDecodeModel(net, cams, slots, net.vlm.embed.weight.device)
    decoder = Decoder(model, buckets, max_new_tokens=config.max_decoding_steps, backend="eager",
                      candidates=1, penalty=False)
    stages = {"vision": [net.vision, net.projector], "prefix": [net.vlm]}
    return {"pi0-fast prefill": count_kernels(decoder._prefill_body(decoder.buckets[-1]), stages=stages,
                                              custom=CUDA_FORMS),
            "pi0-fast decode/token": count_kernels(decoder._decode_body("greedy"), custom=CUDA_FORMS)}


def lm_count(dtype: Any, kernels: str = "fused") -> dict[str, KernelCount]:
    """The Orpheus-3B LM (Llama-3.2-3B, preset "orpheus-3b") built on meta as `flashrt.runner.orpheus`
    loads it (8 slots of 2,048 cache positions, prompt buckets up to 256, sampling): the prefill of the
    largest bucket into one row, and one sampled decode step at 1 and at 8 live rows over the whole cache
(the largest key bucket: the kernels are the same for every key bucket, only their sizes differ)."""
    from flashrt.frontends.lm.config import preset
    from flashrt.frontends.lm.frontend import CausalLM
    from flashrt.io.loading import meta_twin
    from flashrt.nn.llama import Llama
    from flashrt.runtime.slots import SlotDecoder

    cfg = preset("orpheus-3b")
    module = meta_twin(lambda: Llama(cfg.layer, cfg.depth, cfg.vocab_size, cfg.tied), dtype)
    lm = CausalLM(cfg, module, device="meta", dtype=dtype, cache_len=2048, batch=8, kernels=kernels)
    decoder = SlotDecoder(lm, (32, 64, 128, 256), max_new_tokens=1200, backend="eager")
    prefill = count_kernels(decoder._prefill_body(decoder.buckets[-1]), custom=CUDA_FORMS)
    return {"orpheus-lm prefill": prefill,
            **{f"orpheus-lm decode/{unit} @{rows}": count_kernels(
                decoder._decode_body("sample", decoder.key_buckets[-1], rows), custom=CUDA_FORMS)
               for unit, rows in (("token", 1), ("step", 8))}}


def _pi0(card: str) -> Callable[[Any, int, str], dict[str, KernelCount]]:
    def count(dtype: Any, cams: int, row: str) -> dict[str, KernelCount]:
        from flashrt.resources import read_data

        return {card: policy_count(read_data("models", card), dtype, cams, row)}

    return count


# family -> count(dtype, cams, kernel-table row) -> {row name: count}
FAMILIES: dict[str, Callable[[Any, int, str], dict[str, KernelCount]]] = {
    "pi0": _pi0("pi0-base"),
    "pi05": _pi0("pi05-base"),
    "groot": lambda dtype, cams, row: {"groot-n1.7": groot_count(dtype, cams, row)},
    "pi0-fast": lambda dtype, cams, row: pi0_fast_count(dtype, cams, kernels=row),
    "lm": lambda dtype, cams, row: lm_count(dtype, row),
}


def count_family(name: str, precision: str = "bf16", cams: int = 2,
                 path: str = "cuda") -> dict[str, KernelCount]:
    """The rows of a family (`FAMILIES`) or a model card ``name`` on the code path ``path`` (`PATHS`)."""
    from flashrt.errors import ConfigError

    if path not in PATHS:
        raise ConfigError(f"--path {path!r}: choose one of {sorted(PATHS)}")
    if name in FAMILIES:
        return FAMILIES[name](_dtype(precision), cams, PATHS[path])
    if name not in release_cards(tiny=True):
        raise ConfigError(f"unknown family or model card {name!r}: families {sorted(FAMILIES)}, cards "
                          f"{release_cards(tiny=True)}")
    return {name: count_card(name, precision, cams, PATHS[path])}


def _dtype(precision: str) -> Any:
    import torch

    from flashrt.errors import ConfigError

    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision!r}: choose one of {sorted(PRECISIONS)}")
    return getattr(torch, PRECISIONS[precision])


def release_cards(tiny: bool = False) -> list[str]:
    """Every shipped release-size card (the tiny test cards left out unless ``tiny``)."""
    from flashrt.resources import list_data

    return [name for name in list_data("models") if tiny or not name.endswith("-tiny")]


def default_rows() -> list[str]:
    """What a bare ``flashrt kernels`` counts: every family, then every vocoder release card."""
    policies = {"pi0-base", "pi05-base"}
    return [*FAMILIES, *(c for c in release_cards() if c not in policies)]


def _stages(count: KernelCount) -> str:
    return " ".join(f"{k} {n:,d}" for k, n in count.by_stage.most_common() if n)


def kernels(
    models: Annotated[list[str] | None, typer.Argument(help="families (pi0, pi05, groot, pi0-fast, lm) or "
                                                       "model cards [every family and vocoder card]")] = None,
    path: Annotated[str, typer.Option(help="cuda (csrc fused ops built) or cuda-aten (without)")] = "cuda",
    precision: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = "bf16",
    cams: Annotated[int, typer.Option(help="cameras of a policy step")] = 2,
    top: Annotated[int, typer.Option(help="also print the N most frequent ops of each row")] = 0,
) -> None:
    """Kernels one step launches on the CUDA code path, per family at its release size (counted on the
    meta device, no GPU needed): total, fused share, split by stage."""
    from flashrt.profile.report import json_line

    counts: dict[str, KernelCount] = {}
    for name in models or default_rows():
        counts.update(count_family(name, precision, cams, path))
    typer.echo(f"{'model':28} {'kernels':>8} {'fused':>7} {'share':>6}   stages   ({path} path, {precision}, "
               f"{cams} cameras)", err=True)
    for name, c in counts.items():
        typer.echo(f"{name:28} {c.total:>8,d} {c.fused:>7,d} {c.fused_share:>6.1%}   {_stages(c)}", err=True)
        for op, n in c.top(top):
            typer.echo(f"{'':30}{n:>8,d}  {op}", err=True)
    rows = {name: c.report() for name, c in counts.items()}
    typer.echo(json_line({"kind": "kernels", "path": path, "precision": precision, "cams": cams,
                          "models": rows}))
