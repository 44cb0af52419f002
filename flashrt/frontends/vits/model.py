"""The VITS inference graph in two static stages and the host step between them.

    stage 1 (phoneme bucket P)   ids -> text encoder -> duration predictor (reverse) -> ceil durations,
                                 prior stats m, logs
    host step                    frames = max(1, sum(durations)); frame -> phoneme index (the
                                 alignment path); pick the frame bucket F
    stage 2 (frame bucket F)     z_p = m[index] + noise * exp(logs[index]) * noise_scale -> flow
                                 (reverse) -> z * mask
    decoder (window bucket D)    z window -> HiFi-GAN (the vocoder family's module) -> audio

The frame count depends on the data, so stage 2 cannot be in stage 1's graph; the host step reads
the P durations (one device->host copy) and is the only place where sizes are decided.

The alignment "path" of VITS is a 0/1 matrix (F, P) multiplied into m and logs; each frame row holds
exactly one 1, so the product equals a gather of one column per frame. Gathering is what stage 2 does.

Shape legend: P phonemes, F frames, C latent channels, N = F * hop samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from flashrt import ops
from flashrt.errors import CheckpointError
from flashrt.frontends.vits.config import VitsConfig
from flashrt.frontends.vits.decoder import VitsDecoder
from flashrt.frontends.vits.modules import (
    CouplingFlow,
    DurationPredictor,
    StochasticDurationPredictor,
    TextEncoder,
)
from flashrt.frontends.vits.weights import decoder_weight_map, onnx_state_dict, prior_weight_map, split_state
from flashrt.io import Checkpoint, load_module, open_checkpoint
from flashrt.nn.conv_policy import POLICIES as CONV_POLICIES
from flashrt.nn.conv_policy import apply_conv_policy

__all__ = ["VitsPrior", "load_weights", "frame_index"]


class VitsPrior(nn.Module):
    """Text encoder, duration predictor and flow; the decoder is a separate `HifiGan`.

    Multi-speaker voices: ``emb_g`` (speakers, G) gives the speaker vector g (1, G, 1) that conditions the
    duration predictor and every flow layer; ``dec_cond`` is the decoder's conditioning (VITS ``dec.cond``,
    added to conv_pre's output). g is constant over time, so ``dec_cond(g)`` is a per-channel constant:
    the frontend folds it into the decoder's conv_pre bias per utterance (`speaker_bias`)."""

    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.enc_p = TextEncoder(cfg)
        self.dp = StochasticDurationPredictor(cfg) if cfg.use_sdp else DurationPredictor(cfg)
        self.flow = CouplingFlow(cfg)
        if cfg.n_speakers > 1:
            self.emb_g = nn.Embedding(cfg.n_speakers, cfg.gin_channels)
            self.dec_cond = nn.Conv1d(cfg.gin_channels, cfg.decoder.upsample_initial_channel, 1)

    def pack(self) -> None:
        """Derive the CPU float32 forms of the text encoder, the stochastic duration predictor and the flow
        (time-major, packed GEMMs) from the loaded weights, or clear them elsewhere; `load_weights` calls
        it."""
        self.enc_p.pack()
        if isinstance(self.dp, StochasticDurationPredictor):
            self.dp.pack()
        self.flow.pack()

    def speaker(self, sid: int) -> torch.Tensor:
        """The speaker vector g (1, G, 1) of speaker `sid`."""
        return self.emb_g.weight[sid].view(1, -1, 1)

    def speaker_bias(self, g: torch.Tensor) -> torch.Tensor:
        """dec_cond(g) as a (U,) per-channel constant."""
        return self.dec_cond(g).view(-1)

    def encode(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        noise: torch.Tensor,
        scales: torch.Tensor,
        index: tuple[torch.Tensor, ...],
        g: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids (1, P), mask (1, 1, P), noise (1, 2, P), scales (3,) = (noise_scale, length_scale, noise_w),
        speaker g (1, G, 1) or None -> m (1, C, P), logs (1, C, P), ceil durations (1, P) (0 on padding)."""
        x, m, logs = self.enc_p(ids, mask, index)
        logw = self.dp(x, mask, noise * scales[2], g)
        w = torch.exp(logw) * mask * scales[1]
        return m, logs, torch.ceil(w)[:, 0]

    def latent(
        self,
        m: torch.Tensor,
        logs: torch.Tensor,
        noise: torch.Tensor,
        scales: torch.Tensor,
        mask: torch.Tensor,
        g: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Expanded prior m, logs (1, C, F), noise (1, C, F), mask (1, 1, F) -> decoder input z (1, C, F)."""
        z_p = m + noise * torch.exp(logs) * scales[0]
        return self.flow(z_p, mask, g) * mask


def frame_index(durations: np.ndarray) -> np.ndarray:
    """The host step: integer durations (P,) -> the phoneme each frame reads (F,), F = max(1, sum)."""
    d = durations.astype(np.int64)
    index = np.repeat(np.arange(d.size), d)
    return index if index.size else np.zeros(1, dtype=np.int64)


# ------------------------------------------------------------------------------------------ loading


def _state(source: Any) -> tuple[dict[str, torch.Tensor], str]:
    if isinstance(source, Mapping):
        return dict(source), getattr(source, "name", "<memory>")
    path = Path(source)
    if path.suffix == ".onnx":
        return onnx_state_dict(path), str(path)
    ckpt = open_checkpoint(path)
    return {k: ckpt[k] for k in ckpt}, str(path)


def load_weights(
    source: Any,
    cfg: VitsConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    conv: str = "auto",
    decoder_dtype: torch.dtype | None = None,
) -> tuple[VitsPrior, VitsDecoder]:
    """The prior and the decoder from a ``.onnx`` voice, a VITS training checkpoint (``.ckpt``, ``.pt``,
    ``.safetensors``; lightning ``model_g.`` keys too) or an in-memory state dict, each mapped strictly.
    ``decoder_dtype``: the decoder's own dtype (None: ``dtype``), e.g. bfloat16 beside a float32 prior."""
    decoder_dtype = dtype if decoder_dtype is None else decoder_dtype
    state, name = _state(source)
    prior_state, dec_state = split_state(state)
    if not dec_state:
        raise CheckpointError(f"{name}: no decoder tensors (dec.*); not a VITS checkpoint")
    prior_ckpt = Checkpoint.from_tensors(prior_state, name=name)
    dec_ckpt = Checkpoint.from_tensors(dec_state, name=name)
    prior = load_module(lambda: VitsPrior(cfg), prior_ckpt, prior_weight_map(cfg), device=device, dtype=dtype)
    decoder = load_module(
        lambda: VitsDecoder(cfg.decoder), dec_ckpt, decoder_weight_map(cfg, dec_ckpt), device=device,
        dtype=decoder_dtype,
    )
    prior.pack()
    apply_conv_policy(decoder, CONV_POLICIES[conv])
    for module, module_dtype in ((prior, dtype), (decoder, decoder_dtype)):
        ops.select(module, device, module_dtype)  # the one `flashrt.ops` pass (neither holds an op slot yet)
    return prior, decoder
