"""GR00T N1.7 checkpoint (``GR00TN17.save_pretrained`` keys) → `GrootN17Model`: the strict weight map
built from the shared rules (`flashrt.frontends.groot.common.weights`, which says what is deliberately
unused), and the loader.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flashrt.frontends.groot.common.config import GrootN17Config
from flashrt.frontends.groot.common.weights import LM, head_rules, popped_layers, text_rules, vision_rules
from flashrt.frontends.groot.n17.model import GrootN17Model
from flashrt.io import WeightMap, load_module


def n17_weight_map(config: GrootN17Config, keys: list[str]) -> WeightMap:
    """The strict map; ``keys`` (the checkpoint's, with or without lerobot's ``_groot_model.``) name the
    dropped decoder layers to ignore."""
    raw, keys = list(keys), [k.removeprefix("_groot_model.") for k in keys]
    popped = popped_layers(keys, LM, config.text.layers)
    ignore = [LM + "norm.weight", "backbone.model.lm_head.weight", *popped]
    wmap = WeightMap([*vision_rules(), *text_rules(), *head_rules()], ignore=ignore)
    return wmap.auto_prefix(raw, ("", "_groot_model."))


def load_n17(
    config: GrootN17Config,
    checkpoint: Mapping[str, torch.Tensor],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> GrootN17Model:
    """Build on meta, map strictly, cast to ``dtype`` (None: storage dtype)."""
    wmap = n17_weight_map(config, list(checkpoint))
    return load_module(lambda: GrootN17Model(config), checkpoint, wmap, device, dtype)
