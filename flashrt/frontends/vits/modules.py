"""The VITS prior at inference: text encoder, duration predictors (run in reverse), coupling flow (reverse).

Written from the VITS paper (Kim et al. 2021) and checked against onnxruntime running a Piper voice
(tests/frontends/vits). State-dict names are the VITS training names (``enc_p.*``, ``dp.*``, ``flow.*``) so a
training checkpoint maps one to one; flips and the SDP flow unused in reverse are parameter-free
placeholders that keep the indices.

Shape legend:
    B  batch (1 in the frontend)
    P  phonemes (padded to the phoneme bucket); ``mask`` (B, 1, P) is 1 on real phonemes
    F  frames (padded to the frame bucket); ``mask`` (B, 1, F)
    H  hidden channels; C latent (inter) channels; K bins of a rational-quadratic spline

Every op is graph-safe: no host syncs, no data-dependent shapes. Padded steps are zeroed by the mask
before every convolution, so a padded bucket computes the real steps exactly as an unpadded run does.
Differences from the training code, all exact re-arrangements for inference:

* relative-position attention gathers the (2w+1) band with a precomputed index instead of pad/reshape
  skewing (the same products; out-of-window terms are exact zeros either way);
* the spline of the SDP's ConvFlow is evaluated on every element and selected with ``where`` (no
  boolean-mask indexing), the identity outside the tail bound as in the "linear tails" definition;
* the ElementwiseAffine of the SDP stores ``exp(-logs)`` (``inv_scale``), the factor its reverse uses.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flashrt.frontends.vits.config import VitsConfig

__all__ = [
    "TextEncoder",
    "StochasticDurationPredictor",
    "DurationPredictor",
    "CouplingFlow",
    "relative_index",
]

MIN_BIN = 1e-3
MIN_DERIVATIVE = 1e-3
MASK_VALUE = -1e4


class LayerNorm(nn.Module):
    """LayerNorm over the channel axis of (B, C, T) (VITS names: gamma, beta)."""

    def __init__(self, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.transpose(1, -1), (x.shape[1],), self.gamma, self.beta, self.eps)
        return y.transpose(1, -1)


def _packable(weight: torch.Tensor) -> bool:
    """The packed time-major forms run CPU float32 weights (`flashrt.nn.packed_linear`)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def same_conv(cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1) -> nn.Conv1d:
    return nn.Conv1d(
        cin, cout, kernel, dilation=dilation, groups=groups, padding=(kernel * dilation - dilation) // 2
    )


# ---------------------------------------------------------------------------------- text encoder


def relative_index(
    length: int, window: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, ...]:
    """Index tensors of the relative-position band for `length` steps and window `window`:
    key_index (L, L) into [0, 2w+1] (2w+1 = an appended zero column) and, for the values, frame_index
    (L, 2w+1) into [0, L] (L = an appended zero column)."""
    pos = torch.arange(length, device=device)
    rel = pos[None, :] - pos[:, None] + window  # (L, L) offset j - i + w
    key_index = torch.where((rel >= 0) & (rel <= 2 * window), rel, torch.full_like(rel, 2 * window + 1))
    key = pos[:, None] + torch.arange(2 * window + 1, device=device)[None, :] - window  # (L, 2w+1): j
    frame_index = torch.where((key >= 0) & (key < length), key, torch.full_like(key, length))
    return key_index, frame_index


class RelativeSelfAttention(nn.Module):
    """Multi-head self-attention with shared relative-position key/value embeddings (window w)."""

    def __init__(self, channels: int, heads: int, window: int) -> None:
        super().__init__()
        self.heads, self.window, self.head_dim = heads, window, channels // heads
        self.conv_q, self.conv_k, self.conv_v, self.conv_o = (
            nn.Conv1d(channels, channels, 1) for _ in range(4)
        )
        self.emb_rel_k = nn.Parameter(torch.zeros(1, 2 * window + 1, self.head_dim))
        self.emb_rel_v = nn.Parameter(torch.zeros(1, 2 * window + 1, self.head_dim))

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, _, t = x.shape
        return x.view(b, self.heads, self.head_dim, t).transpose(2, 3)  # (B, heads, L, d)

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor, index: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        key_index, frame_index = index
        q = self._split(self.conv_q(x)) / math.sqrt(self.head_dim)
        k, v = self._split(self.conv_k(x)), self._split(self.conv_v(x))
        scores = torch.matmul(q, k.transpose(-2, -1))  # (B, heads, L, L)
        rel = torch.matmul(q, self.emb_rel_k.transpose(-2, -1))  # (B, heads, L, 2w+1)
        rel = F.pad(rel, (0, 1))  # zero column for out-of-band
        scores = scores + rel.gather(-1, key_index.expand(*rel.shape[:2], -1, -1))
        p = F.softmax(scores.masked_fill(attn_mask == 0, MASK_VALUE), dim=-1)
        out = torch.matmul(p, v)
        band = F.pad(p, (0, 1)).gather(-1, frame_index.expand(*p.shape[:2], -1, -1))  # (B, heads, L, 2w+1)
        out = out + torch.matmul(band, self.emb_rel_v)
        b, h, t, d = out.shape
        return self.conv_o(out.transpose(2, 3).reshape(b, h * d, t))


class FFN(nn.Module):
    """conv -> relu -> conv with 'same' zero padding, masked before each conv."""

    def __init__(self, channels: int, filters: int, kernel: int) -> None:
        super().__init__()
        self.conv_1 = same_conv(channels, filters, kernel)
        self.conv_2 = same_conv(filters, channels, kernel)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv_1(x * mask))
        return self.conv_2(x * mask) * mask


class Encoder(nn.Module):
    """Post-norm transformer encoder (attention, FFN) over (B, H, P)."""

    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        h, n = cfg.hidden_channels, cfg.n_layers
        self.attn_layers = nn.ModuleList(
            RelativeSelfAttention(h, cfg.n_heads, cfg.window_size) for _ in range(n)
        )
        self.norm_layers_1 = nn.ModuleList(LayerNorm(h) for _ in range(n))
        self.ffn_layers = nn.ModuleList(FFN(h, cfg.filter_channels, cfg.kernel_size) for _ in range(n))
        self.norm_layers_2 = nn.ModuleList(LayerNorm(h) for _ in range(n))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, index: tuple[torch.Tensor, ...]) -> torch.Tensor:
        attn_mask = mask.unsqueeze(2) * mask.unsqueeze(-1)  # (B, 1, P, P)
        x = x * mask
        for attn, norm1, ffn, norm2 in zip(
            self.attn_layers, self.norm_layers_1, self.ffn_layers, self.norm_layers_2
        ):
            x = norm1(x + attn(x, attn_mask, index))
            x = norm2(x + ffn(x, mask))
        return x * mask


class TextEncoder(nn.Module):
    """ids (B, P) -> hidden (B, H, P), prior mean m (B, C, P), log-std logs (B, C, P)."""

    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Embedding(cfg.n_vocab, cfg.hidden_channels)
        self.encoder = Encoder(cfg)
        self.proj = nn.Conv1d(cfg.hidden_channels, 2 * cfg.inter_channels, 1)
        self.packed = None  # the time-major packed-GEMM form (`pack`), derived from the weights

    def pack(self) -> None:
        """Derive the CPU float32 form (`flashrt.frontends.vits.encoder.PackedTextEncoder`: the same math
        time-major on oneDNN-packed GEMMs) from the loaded weights; elsewhere clear it. Call after
        loading or changing the weights."""
        from flashrt.frontends.vits.encoder import PackedTextEncoder

        self.packed = PackedTextEncoder(self) if _packable(self.proj.weight) else None

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, index: tuple[torch.Tensor, ...]):
        if self.packed is not None:
            return self.packed(ids, mask)
        x = (self.emb(ids) * math.sqrt(self.cfg.hidden_channels)).transpose(1, 2)  # (B, H, P)
        x = self.encoder(x * mask, mask, index)
        stats = self.proj(x) * mask
        m, logs = stats.split(self.cfg.inter_channels, dim=1)
        return x, m, logs


# ------------------------------------------------------------------------------ duration predictors


class DDSConv(nn.Module):
    """Dilated depth-separable conv stack (dilation kernel^i), GELU, LayerNorms, residual."""

    def __init__(self, channels: int, kernel: int, layers: int) -> None:
        super().__init__()
        self.convs_sep = nn.ModuleList(
            same_conv(channels, channels, kernel, kernel**i, groups=channels) for i in range(layers)
        )
        self.convs_1x1 = nn.ModuleList(nn.Conv1d(channels, channels, 1) for _ in range(layers))
        self.norms_1 = nn.ModuleList(LayerNorm(channels) for _ in range(layers))
        self.norms_2 = nn.ModuleList(LayerNorm(channels) for _ in range(layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        if g is not None:
            x = x + g
        for sep, pw, n1, n2 in zip(self.convs_sep, self.convs_1x1, self.norms_1, self.norms_2):
            y = F.gelu(n1(sep(x * mask)))
            x = x + F.gelu(n2(pw(y)))
        return x * mask


def _bins(unnormalized: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Bin edges (..., K+1) and sizes (..., K) of a spline axis from unnormalized logits (..., K)."""
    k = unnormalized.shape[-1]
    sizes = MIN_BIN + (1 - MIN_BIN * k) * F.softmax(unnormalized, dim=-1)
    edges = F.pad(torch.cumsum(sizes, dim=-1), (1, 0))
    edges = (high - low) * edges + low
    edges = torch.cat(
        [torch.full_like(edges[..., :1], low), edges[..., 1:-1], torch.full_like(edges[..., :1], high)],
        dim=-1,
    )
    return edges, edges[..., 1:] - edges[..., :-1]


def spline_inverse(
    y: torch.Tensor, uw: torch.Tensor, uh: torch.Tensor, ud: torch.Tensor, bound: float
) -> torch.Tensor:
    """Inverse of the monotonic rational-quadratic spline (Durkan et al. 2019) with linear tails on
    [-bound, bound]: y (...,) and its K widths, K heights, K-1 inner derivatives (..., *) -> x (...,)."""
    const = math.log(math.exp(1 - MIN_DERIVATIVE) - 1)
    ud = F.pad(ud, (1, 1), value=const)
    xs, widths = _bins(uw, -bound, bound)
    ys, heights = _bins(uh, -bound, bound)
    derivs = MIN_DERIVATIVE + F.softplus(ud)
    search = torch.cat([ys[..., :-1], ys[..., -1:] + 1e-6], dim=-1)
    idx = (torch.sum(y[..., None] >= search, dim=-1) - 1).clamp(0, uw.shape[-1] - 1)[..., None]

    def at(t: torch.Tensor) -> torch.Tensor:
        return t.gather(-1, idx)[..., 0]

    x0, w, y0, h = at(xs), at(widths), at(ys), at(heights)
    delta = at(heights / widths)
    d0, d1 = at(derivs), derivs[..., 1:].gather(-1, idx)[..., 0]
    dy = y - y0
    a = dy * (d0 + d1 - 2 * delta) + h * (delta - d0)
    b = h * d0 - dy * (d0 + d1 - 2 * delta)
    c = -delta * dy
    root = (2 * c) / (-b - torch.sqrt(b.pow(2) - 4 * a * c))
    inside = (y >= -bound) & (y <= bound)
    return torch.where(inside, root * w + x0, y)


class ConvFlow(nn.Module):
    """Neural-spline coupling: x1 transformed by a spline whose parameters come from x0 (and g)."""

    def __init__(self, channels: int, kernel: int, layers: int, bins: int, bound: float) -> None:
        super().__init__()
        self.bins, self.bound, self.filters = bins, bound, channels
        self.pre = nn.Conv1d(1, channels, 1)
        self.convs = DDSConv(channels, kernel, layers)
        self.proj = nn.Conv1d(channels, 3 * bins - 1, 1)

    def reverse(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        x0, x1 = x[:, :1], x[:, 1:]
        h = self.proj(self.convs(self.pre(x0), mask, g=g)) * mask
        b, _, t = x0.shape
        h = h.reshape(b, 1, -1, t).permute(0, 1, 3, 2)  # (B, 1, P, 3K-1)
        k, scale = self.bins, math.sqrt(self.filters)
        x1 = spline_inverse(x1, h[..., :k] / scale, h[..., k : 2 * k] / scale, h[..., 2 * k :], self.bound)
        return torch.cat([x0, x1], 1) * mask


class ElementwiseAffine(nn.Module):
    """y = m + exp(logs) * x; reverse x = (y - m) * inv_scale (inv_scale = exp(-logs))."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.m = nn.Parameter(torch.zeros(channels, 1))
        self.inv_scale = nn.Parameter(torch.ones(channels, 1))

    def reverse(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return (x - self.m) * self.inv_scale * mask


class Flip(nn.Module):
    """Channel reversal between couplings (no parameters)."""

    def reverse(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        return torch.flip(x, [1])


class StochasticDurationPredictor(nn.Module):
    """hidden (B, H, P), noise (B, 2, P) already scaled by noise_w -> log durations (B, 1, P).

    Training order of ``flows``: ElementwiseAffine, then (ConvFlow, Flip) x n. Reverse runs them
    backwards without the first ConvFlow (index 1, kept as a placeholder), as VITS does."""

    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        ch = cfg.hidden_channels
        self.pre = nn.Conv1d(ch, ch, 1)
        self.convs = DDSConv(ch, cfg.dp_kernel_size, cfg.sdp_layers)
        self.proj = nn.Conv1d(ch, ch, 1)
        flows: list[nn.Module] = [ElementwiseAffine(2)]
        for i in range(cfg.sdp_flows):
            conv = ConvFlow(ch, cfg.dp_kernel_size, cfg.sdp_layers, cfg.num_bins, cfg.tail_bound)
            flows += [nn.Identity() if i == 0 else conv, Flip()]
        self.flows = nn.ModuleList(flows)
        if cfg.gin_channels:
            self.cond = nn.Conv1d(cfg.gin_channels, ch, 1)
        self.packed = None  # the time-major form (`pack`), derived from the weights

    def pack(self) -> None:
        """Derive the CPU float32 form (`flashrt.frontends.vits.duration.PackedDurationPredictor`: the same
        math time-major, 1x1 convs on packed GEMMs) from the loaded weights; elsewhere clear it."""
        from flashrt.frontends.vits.duration import PackedDurationPredictor

        self.packed = PackedDurationPredictor(self) if _packable(self.pre.weight) else None

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, noise: torch.Tensor, g: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x, mask, noise, g)
        x = self.pre(x)
        if g is not None:
            x = x + self.cond(g)
        x = self.proj(self.convs(x, mask)) * mask
        z = noise
        for flow in [*reversed(self.flows[2:]), self.flows[0]]:
            z = flow.reverse(z, mask, g=x)
        return z[:, :1]


class DurationPredictor(nn.Module):
    """The deterministic predictor (voices trained without SDP): log durations (B, 1, P)."""

    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        f, k = cfg.dp_filter_channels, cfg.dp_kernel_size
        self.conv_1 = same_conv(cfg.hidden_channels, f, k)
        self.norm_1 = LayerNorm(f)
        self.conv_2 = same_conv(f, f, k)
        self.norm_2 = LayerNorm(f)
        self.proj = nn.Conv1d(f, 1, 1)
        if cfg.gin_channels:
            self.cond = nn.Conv1d(cfg.gin_channels, cfg.hidden_channels, 1)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        noise: torch.Tensor | None = None,
        g: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if g is not None:
            x = x + self.cond(g)
        x = self.norm_1(torch.relu(self.conv_1(x * mask)))
        x = self.norm_2(torch.relu(self.conv_2(x * mask)))
        return self.proj(x * mask) * mask


# ------------------------------------------------------------------------------------------ flow


class WN(nn.Module):
    """WaveNet-style gated dilated conv stack; with a speaker, each layer's gate input adds its slice of
    ``cond_layer(g)``."""

    def __init__(self, channels: int, kernel: int, dilation_rate: int, layers: int, gin: int = 0) -> None:
        super().__init__()
        self.channels = channels
        if gin:
            self.cond_layer = nn.Conv1d(gin, 2 * channels * layers, 1)
        self.in_layers = nn.ModuleList(
            same_conv(channels, 2 * channels, kernel, dilation_rate**i) for i in range(layers)
        )
        self.res_skip_layers = nn.ModuleList(
            nn.Conv1d(channels, 2 * channels if i < layers - 1 else channels, 1) for i in range(layers)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        c, out = self.channels, None
        cond = None if g is None else self.cond_layer(g)  # (B, 2C * layers, 1)
        for i, (inp, res_skip) in enumerate(zip(self.in_layers, self.res_skip_layers)):
            h = inp(x)
            if cond is not None:
                h = h + cond[:, 2 * c * i : 2 * c * (i + 1)]
            rs = res_skip(torch.tanh(h[:, :c]) * torch.sigmoid(h[:, c:]))
            skip = rs[:, c:] if i < len(self.in_layers) - 1 else rs
            out = skip if out is None else out + skip
            if i < len(self.in_layers) - 1:
                x = (x + rs[:, :c]) * mask
        return out * mask


class ResidualCoupling(nn.Module):
    """Mean-only affine coupling: x1 -= post(WN(pre(x0))) in reverse."""

    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        half = cfg.inter_channels // 2
        self.pre = nn.Conv1d(half, cfg.hidden_channels, 1)
        self.enc = WN(
            cfg.hidden_channels,
            cfg.flow_kernel_size,
            cfg.flow_dilation_rate,
            cfg.flow_layers,
            cfg.gin_channels,
        )
        self.post = nn.Conv1d(cfg.hidden_channels, half, 1)

    def reverse(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        half = x.shape[1] // 2
        x0, x1 = x[:, :half], x[:, half:]
        m = self.post(self.enc(self.pre(x0) * mask, mask, g)) * mask
        return torch.cat([x0, (x1 - m) * mask], 1)


class CouplingFlow(nn.Module):
    """(ResidualCoupling, Flip) x n; `forward` runs the reverse direction (prior -> latent)."""

    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        self.flows = nn.ModuleList(m for _ in range(cfg.flow_flows) for m in (ResidualCoupling(cfg), Flip()))
        self.packed = None  # the time-major packed-GEMM form (`pack`), derived from the weights

    def pack(self) -> None:
        """Derive the CPU float32 form (`flashrt.frontends.vits.flow.PackedFlow`: the same math time-major
        on oneDNN-packed GEMMs) from the loaded weights; elsewhere (a GPU, another dtype) clear it. Call
        after loading or changing the weights."""
        from flashrt.frontends.vits.flow import PackedFlow

        self.packed = PackedFlow(self) if _packable(self.flows[0].pre.weight) else None

    def forward(self, z: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(z, mask, g)
        for flow in reversed(self.flows):
            z = flow.reverse(z, mask, g)
        return z
