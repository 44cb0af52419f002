"""Shared audio blocks for the vocoder families (HiFi-GAN, BigVGAN, Vocos, SNAC), one import for all.

Where each lives: `flashrt.nn.valid` (ValidLength, EXACT), `flashrt.nn.reach` (Reach, receptive
fields), `flashrt.nn.conv1d` (rows layout, Conv1d, ConvTranspose1d, weight-norm rules),
`flashrt.nn.resblocks` (HiFi-GAN ResBlock1/2, mrf), `flashrt.nn.alias_free` (Snake, SnakeBeta, the
anti-aliased activation and its resamplers).

Shape legend:
    B  batch
    C  channels
    T  time steps at the block's own rate (frames x the upsampling done so far)
    K  kernel taps

Conventions every block here follows:

* Weight norm is never a module parametrization. Checkpoints store it three ways (plain ``weight``;
  legacy ``weight_g``/``weight_v``; ``parametrizations.weight.original0/1``); `conv_rules` maps all
  three declaratively and folds g, v once at load (`flashrt.io.transforms.weight_norm`). Modules hold
  plain ``weight``/``bias``.
* Layout. Every block takes (B, C, T) or "rows": (B, C, 1, T) stored channels-last (`to_rows`), the
  layout in which oneDNN runs these 1-D convs fastest on CPU (measured faster than (B, C, T) conv1d for
  the HiFi-GAN/BigVGAN shapes, transposed and depthwise convs included). Conv weights keep their
  1-D shape in the state dict; `reset_derived` stores them channels-last once (no second copy).
* Padded static shapes. Graphs run at a bucket length; the real input is ``length`` frames and the
  rest is padding. Every layer whose output near the end depends on what lies past the end must see
  what the unpadded run would have seen: a zero-padded conv needs zeros there (`ValidLength.zero`), a
  replicate-padded filter the last valid value (`ValidLength.hold`). Convs and resamplers take
  ``valid`` and fix up, in place, just the padding steps they can reach (their halo) before running;
  `EXACT` (the default) does nothing, for inputs that are not padded. Outputs past ``length`` are
  garbage and are trimmed by the caller.
* Receptive field. Each block answers ``reach(rate)``: how far an output reaches to the left and right,
  in frames, from its own geometry (`flashrt.nn.reach`); a family's top module composes its layers'
  reaches, which is the streaming context.
* Derived tensors (snake frequencies, anti-alias filters) are non-persistent buffers computed in
  ``reset_derived()`` from the config and loaded weights (called by `flashrt.io.load_module`).

The numerics follow the public definitions: HiFi-GAN (Kong et al. 2020) ResBlock1/ResBlock2 with
leaky ReLU; Snake/SnakeBeta (Liu Ziyin et al. 2020) with optional log-scale parameters as in BigVGAN;
kaiser-windowed sinc low-pass filters (julius / alias-free-torch definition) for 2x anti-aliased
activations (BigVGAN v2, `Activation1d`).
"""

from __future__ import annotations

from flashrt.nn.alias_free import (
    Activation1d,
    DownSample1d,
    Snake,
    SnakeBeta,
    UpSample1d,
    kaiser_sinc_filter1d,
)
from flashrt.nn.conv1d import (
    ROWS,
    WEIGHT_NORM_SOURCES,
    Conv1d,
    ConvTranspose1d,
    conv1d,
    conv_rules,
    conv_transpose1d,
    from_rows,
    polyphase_weight,
    to_rows,
)
from flashrt.nn.reach import Reach, get_padding, receptive_field
from flashrt.nn.resblocks import ResBlock1, ResBlock2, mrf
from flashrt.nn.valid import EXACT, ValidLength

__all__ = [
    "EXACT", "ValidLength", "Reach", "receptive_field", "ROWS", "to_rows", "from_rows", "get_padding",
    "Conv1d", "ConvTranspose1d", "polyphase_weight", "conv1d", "conv_transpose1d", "conv_rules",
    "WEIGHT_NORM_SOURCES", "ResBlock1", "ResBlock2", "mrf", "Snake", "SnakeBeta", "kaiser_sinc_filter1d",
    "UpSample1d", "DownSample1d", "Activation1d",
]
