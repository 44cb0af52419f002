"""Checkpoint -> `Pi0FastNet` weight map (lerobot 0.6.1 ``pi0_fast`` layout) and the loader.

Keys are the Pi0 family's PaliGemma names (``model.paligemma_with_expert.paligemma.*``, with or without
lerobot's ``model.``); there is no action expert. Transforms (the Pi0 family's rules, checked against
lerobot 0.6.1 in tests/frontends/pi0_fast/test_model.py):

* SigLIP ``self_attn.{q,k,v}_proj`` -> ``qkv``; Gemma ``{q,k,v}_proj`` -> ``qkv``, ``{gate,up}_proj`` ->
  ``gate_up`` (concatenated along the output dim).
* Embedding: ``language_model.embed_tokens.weight``, else ``paligemma.lm_head.weight`` (tied upstream:
  lerobot's loader copies the head into the embedding); lm_head: ``paligemma.lm_head.weight``, else
  the embedding. The logits always use the lm_head matrix, as lerobot does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from flashrt.errors import CheckpointError
from flashrt.frontends.pi0.config import LLM, PG
from flashrt.frontends.pi0.weights import _gemma_rules, _siglip_rules
from flashrt.frontends.pi0_fast.config import Pi0FastConfig
from flashrt.frontends.pi0_fast.model import Pi0FastNet
from flashrt.io import Alt, Rule, WeightMap, load_module

__all__ = ["pi0_fast_weight_map", "load_pi0_fast", "key_prefix"]


def pi0_fast_weight_map(prefix: str = "model.") -> WeightMap:
    """The strict map; ``prefix`` "model." for lerobot files, "" for files saved without it."""
    rules = [*_siglip_rules(),
             Rule(PG + "model.multi_modal_projector.linear.{p}", "projector.{p}"),
             Rule(Alt(LLM + "embed_tokens.weight", PG + "lm_head.weight"), "vlm.embed.weight"),
             Rule(Alt(PG + "lm_head.weight", LLM + "embed_tokens.weight"), "lm_head.weight"),
             *_gemma_rules(LLM, "vlm", adaptive=False)]
    return WeightMap(rules).with_prefix(prefix)


def key_prefix(keys: Iterable[str]) -> str:
    """"model." or ""; CheckpointError when no PaliGemma key is there at all."""
    keys = list(keys)
    for prefix in ("model.", ""):
        if any(k.startswith(prefix + PG) for k in keys):
            return prefix
    raise CheckpointError(f"no '{PG}' keys (with or without 'model.'): not a Pi0-FAST checkpoint; "
                          f"first keys: {keys[:5]}")


def load_pi0_fast(config: Pi0FastConfig, checkpoint: Mapping[str, torch.Tensor],
                  device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                  kernels: str = "auto") -> Pi0FastNet:
    """Build on meta, map ``checkpoint`` strictly, cast to ``dtype`` (None: the storage dtype); the ops'
    forms chosen at load with ``kernels`` (`Pi0FastNet`)."""
    wmap = pi0_fast_weight_map(key_prefix(checkpoint.keys()))
    return load_module(lambda: Pi0FastNet(config, kernels), checkpoint, wmap, device, dtype)
