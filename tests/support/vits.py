"""A tiny Piper/VITS voice's weights as an .onnx names them (random, seeded), for the VITS tests."""

from __future__ import annotations

import torch

from flashrt.frontends.vits.config import PRESETS
from flashrt.frontends.vits.model import VitsPrior
from flashrt.frontends.vocoders.hifigan import HifiGan


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    cfg = PRESETS["tiny"]
    gen = torch.Generator().manual_seed(seed)
    prior, dec = VitsPrior(cfg), HifiGan(cfg.decoder)
    state = {}
    for name, t in prior.state_dict().items():
        state[name] = torch.randn(t.shape, generator=gen) * 0.3
    del state["dp.flows.0.inv_scale"]
    state["dp.flows.0.exp_neg_logs"] = torch.rand(2, 1, generator=gen) + 0.5  # as an .onnx names it
    for name, t in dec.state_dict().items():
        state["dec." + name] = torch.randn(t.shape, generator=gen) * 0.12
    return state
