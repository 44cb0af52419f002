"""ConvNeXt blocks (Vocos backbone) in a channels-last layout, AdaLayerNorm by condition id, and a linear
layer that runs prepacked oneDNN GEMMs (bias and residual fused, GELU in place after) on CPU.

Shape legend:
    B batch, T frames, D model width, I intermediate width, K depthwise kernel taps, E condition ids.

Layout: the residual stream is (B, T, D) contiguous ("channels last") for the whole backbone, so the
LayerNorm and both pointwise GEMMs read it without the transposes and copies that a (B, D, T) layout
needs; the depthwise convolution runs on a channels-last view of it (one oneDNN call, no copies; 2x
faster than transposing around ``F.conv1d`` on CPU).

Folding done by the weight map at load time, never at run time (`fold_norm_weight`, `fold_norm_bias`,
`fold_scale`): a plain LayerNorm's affine goes into the next linear (``W diag(g)``, ``b + W beta``), and
the layer scale ``gamma`` goes into ``pwconv2``. AdaLayerNorm's scale and shift depend on the condition
id, so they stay an elementwise op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashrt.nn.reach import Reach
from flashrt.nn.valid import EXACT

__all__ = ["AdaLayerNorm", "ChannelsLastValid", "ConvNeXtBlock", "DepthwiseConv", "FusedLinear",
           "channels_last", "fold_norm_bias", "fold_norm_weight", "fold_scale", "fold_scale_bias",
           "taps_last", "zero_padding_cl", "zero_padding_cl_"]

ACTIVATIONS = {"none": lambda x: x, "gelu": F.gelu}


def _onednn_linear_available() -> bool:
    return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class FusedLinear(nn.Linear):
    """``act(x @ W.T + b)`` with act in {"none", "gelu"} (exact erf GELU).

    On CPU in float32, `reset_derived` prepacks the weight for oneDNN and the forward runs one oneDNN
    GEMM with the bias (and a residual add) in its epilogue, then the GELU as ATen's in-place kernel on
    the GEMM's output. Not oneDNN's GELU epilogue: on AVX2 CPUs that epilogue costs several times
    ATen's kernel (figures in docs/benchmarks/vocoders.md; the results are bit for bit the same).
    Anywhere else (GPU, other dtypes, no oneDNN) it is ``F.linear`` then the activation. The packed
    copy is a derived attribute: call `reset_derived` again after
    changing ``weight`` (`load_module` does).
    """

    def __init__(self, in_features: int, out_features: int, activation: str = "none", bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        self._packed: torch.Tensor | None = None

    def reset_derived(self) -> None:
        w = self.weight
        usable = w.device.type == "cpu" and w.dtype == torch.float32 and _onednn_linear_available()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None) if usable else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """act(x W^T + b), plus ``residual`` if given (fused into the GEMM epilogue; no activation)."""
        if self._packed is not None and x.device.type == "cpu" and x.dtype == torch.float32:
            if residual is not None and self.activation == "none":
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self._packed, self.bias, "add")
            y = torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
            if self.activation == "gelu":  # a fresh tensor: in place (no second allocation) unless autograd
                y = F.gelu(y) if y.requires_grad else torch.ops.aten.gelu_(y)
        else:
            y = ACTIVATIONS[self.activation](F.linear(x, self.weight, self.bias))
        return y if residual is None else y + residual


class ChannelsLastValid:
    """A `flashrt.nn.audio.ValidLength` for channels-last (B, T, C) tensors (time on dim 1).

    The (T, 1) padding mask of each length is made once and reused for the life of this object (one
    forward), so a model wraps its ``valid`` once at the top and hands the wrapper to every block.
    """

    def __init__(self, valid) -> None:
        self.valid = valid
        self._masks: dict[int, torch.Tensor] = {}

    def _mask(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = self._masks.get(t)
        if mask is None:
            mask = self._masks[t] = (self.valid.zero(x.new_ones(t)) == 0)[:, None]  # (T, 1) True past the end
        return mask

    def zero(self, x: torch.Tensor) -> torch.Tensor:
        """x with its padding rows set to 0 (a new tensor)."""
        return x.masked_fill(self._mask(x), 0.0)

    def zero_(self, x: torch.Tensor) -> torch.Tensor:
        """The same, in place: for a tensor the caller just made and owns."""
        return x.masked_fill_(self._mask(x), 0.0)


def channels_last(valid):
    """EXACT stays EXACT; a ValidLength is wrapped once (`ChannelsLastValid`)."""
    return valid if valid is EXACT or isinstance(valid, ChannelsLastValid) else ChannelsLastValid(valid)


def zero_padding_cl(x: torch.Tensor, valid=EXACT) -> torch.Tensor:
    """`ValidLength.zero` for a channels-last (B, T, D) tensor (time on dim 1); EXACT: x unchanged."""
    return x if valid is EXACT else channels_last(valid).zero(x)


def zero_padding_cl_(x: torch.Tensor, valid=EXACT) -> torch.Tensor:
    """In-place `zero_padding_cl`, for a tensor the caller made itself (no copy)."""
    return x if valid is EXACT else channels_last(valid).zero_(x)


def taps_last(weight: torch.Tensor) -> torch.Tensor:
    """Depthwise Conv1d weight (D, 1, K) -> (D, 1, 1, K), the 2-D layout `DepthwiseConv` keeps."""
    return weight.unsqueeze(2)


class DepthwiseConv(nn.Module):
    """Depthwise 1-D convolution over (B, T, D) with zero padding ``(K - 1) // 2`` on each side.

    Runs as one oneDNN conv2d on the channels-last view (B, D, 1, T) with strides (T*D, 1, ., D): the
    output comes back channels-last too, so no transpose copy is made either way. ``weight`` is
    (D, 1, 1, K) (see `taps_last`).
    """

    def __init__(self, dim: int, kernel: int = 7) -> None:
        super().__init__()
        self.dim, self.pad = dim, (kernel - 1) // 2
        self.weight = nn.Parameter(torch.empty(dim, 1, 1, kernel))
        self.bias = nn.Parameter(torch.empty(dim))

    def reach(self, rate: int = 1) -> Reach:
        return Reach.conv(self.weight.shape[-1], 1, rate, self.pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.conv2d(x.transpose(1, 2).unsqueeze(2), self.weight, self.bias, padding=(0, self.pad),
                     groups=self.dim)  # (B, D, 1, T), channels-last
        return y.squeeze(2).transpose(1, 2).contiguous()  # no copy when oneDNN kept channels-last


class AdaLayerNorm(nn.Module):
    """LayerNorm (no affine) then scale and shift chosen by a condition id per batch row.

    x (B, T, D), cond (B,) long in [0, E) -> (B, T, D). (Vocos passes one id for the whole batch; a
    (1,) cond broadcasts the same way.)
    """

    def __init__(self, num_embeddings: int, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Embedding(num_embeddings, dim)
        self.shift = nn.Embedding(num_embeddings, dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x, x.shape[-1:], eps=self.eps)
        return torch.addcmul(self.shift(cond)[:, None], h, self.scale(cond)[:, None])


class _PlainNorm(nn.Module):
    """LayerNorm without affine (its affine was folded into the next linear); ignores the condition."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], eps=self.eps)


class ConvNeXtBlock(nn.Module):
    """x + pw2(gelu(pw1(norm(dwconv(x))))) on (B, T, D); ``adanorm`` = number of condition ids or None.

    Slots: ``dwconv.{weight (K, D), bias}``, ``pw1.{weight (I, D), bias}`` (plain-norm affine folded in),
    ``pw2.{weight (D, I), bias}`` (layer scale folded in), and ``norm.{scale,shift}.weight (E, D)`` when
    ``adanorm`` is set.
    """

    def __init__(self, dim: int, intermediate: int, adanorm: int | None = None, kernel: int = 7,
                 eps: float = 1e-6) -> None:
        super().__init__()
        self.dwconv = DepthwiseConv(dim, kernel)
        self.norm = AdaLayerNorm(adanorm, dim, eps) if adanorm else _PlainNorm(eps)
        self.pw1 = FusedLinear(dim, intermediate, activation="gelu")
        self.pw2 = FusedLinear(intermediate, dim)

    def reach(self, rate: int = 1) -> Reach:
        return self.dwconv.reach(rate)          # everything else is per frame

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None, valid=EXACT) -> torch.Tensor:
        """x (B, T, D). With a padded ``valid``, x's frames past the valid length must be zero (what the
        depthwise conv of an unpadded run sees there); the block zeroes them in its own output (in place,
        no copy), so a stack of blocks keeps the invariant and only its input needs zeroing once."""
        h = self.norm(self.dwconv(x), cond)
        return zero_padding_cl_(self.pw2(self.pw1(h), residual=x), valid)


# ------------------------------------------------------------------ load-time folds (weight-map transforms)

def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """Linear after an affine LayerNorm: W diag(g). weight (O, D), norm_weight (D,)."""
    return weight * norm_weight[None, :]


def fold_norm_bias(weight: torch.Tensor, bias: torch.Tensor, norm_bias: torch.Tensor) -> torch.Tensor:
    """Linear after an affine LayerNorm: b + W beta, computed in float64 then cast back."""
    return (bias.double() + weight.double() @ norm_bias.double()).to(bias.dtype)


def fold_scale(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A per-output scale after a linear (ConvNeXt's gamma): diag(s) W. weight (O, I), scale (O,)."""
    return weight * scale[:, None]


def fold_scale_bias(bias: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The bias of `fold_scale`: s * b."""
    return bias * scale
