"""The VITS text encoder time-major on packed GEMMs: the CPU form of `TextEncoder`.

Same math as `flashrt.frontends.vits.modules.TextEncoder.forward`, rearranged once at load:

* time-major: the hidden state is (P, H), so the LayerNorms over channels run on the last axis with no
  transposes; q, k and v are one GEMM, the output projection another (packed weights,
  `flashrt.nn.packed_linear`, the residual add fused into its epilogue);
* the k-tap FFN convs stay oneDNN's direct conv, run on the channels-last view of the time-major state
  ((1, C, 1, P) with channel stride 1: no copy either way). Not as im2col GEMMs: those were faster but
  round differently, and this voice's flow amplifies the text encoder's last-bit differences (see
  tests/frontends/vits/test_vits.py, ATOL): one test sentence then landed 1.6e-4 from onnxruntime
  against 4.5e-5 with the direct conv;
* the relative-position band by skewing instead of gathers: with the scores padded by w columns on each
  side, the (2w + 1) band of row i starts at column i, i.e. at flat offset i (P + 2w + 1) of rows
  P + 2w wide. So the relative logits, padded by P zero columns to rows P + 2w + 1 wide and read back
  as rows P + 2w wide, land on their band with zeros elsewhere (`_to_band`), and one add puts them in;
  the values' band is read back the other way (`_from_band`) from the padded probabilities (the pad
  columns are the zeros the gather form appended for keys outside the sequence). Only pads, reshapes
  and slices: a recorded program (trace, ONNX export) holds them as they are.

Float32 results differ from the conv form by GEMM rounding only (tests/frontends/vits).

Shape legend: P phonemes (the bucket), H hidden, C latent channels, w window, h heads, d head width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flashrt.nn.packed_linear import PackedLinear

__all__ = ["PackedTextEncoder"]


class _RowsConv:
    """A 'same' conv on a time-major (P, C) tensor through its channels-last (1, C, 1, P) view: oneDNN's
    direct conv, its output (1, O, 1, P) channels-last, i.e. (P, O) time-major."""

    def __init__(self, conv: torch.nn.Conv1d) -> None:
        self.weight, self.bias = conv.weight.detach().unsqueeze(2), conv.bias.detach()
        self.padding, self.dilation = (0, conv.padding[0]), (1, conv.dilation[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.t()[None, :, None]  # (1, C, 1, P), channel stride 1
        y = F.conv2d(rows, self.weight, self.bias, padding=self.padding, dilation=self.dilation)
        return y[0, :, 0].t()


def _to_band(rel: torch.Tensor) -> torch.Tensor:
    """(h, P, 2w + 1) band values -> (h, P, P + 2w): row i holds them at columns i .. i + 2w, zeros
    elsewhere (the band of keys i - w .. i + w in scores padded by w columns on each side)."""
    h, p, span = rel.shape
    width = p + span - 1
    return F.pad(rel, (0, p)).flatten(1)[:, : p * width].view(h, p, width)


def _from_band(padded: torch.Tensor) -> torch.Tensor:
    """(h, P, P + 2w) -> (h, P, 2w + 1): row i's columns i .. i + 2w (the inverse of `_to_band`)."""
    h, p, width = padded.shape
    span = width - p + 1
    return F.pad(padded.flatten(1), (0, p)).view(h, p, width + 1)[..., :span]


class _Layer:
    def __init__(self, attn, norm1, ffn, norm2) -> None:
        h = attn.conv_q.weight.shape[0]
        self.heads, self.head_dim, self.window = attn.heads, attn.head_dim, attn.window
        w = torch.cat([attn.conv_q.weight, attn.conv_k.weight, attn.conv_v.weight]).detach()[:, :, 0]
        b = torch.cat([attn.conv_q.bias, attn.conv_k.bias, attn.conv_v.bias]).detach()
        self.qkv = PackedLinear(w, b)
        self.o = PackedLinear(attn.conv_o.weight.detach()[:, :, 0], attn.conv_o.bias.detach())
        self.rel_k = attn.emb_rel_k.detach()[0].t().contiguous()  # (d, 2w + 1)
        self.rel_v = attn.emb_rel_v.detach()[0]  # (2w + 1, d)
        self.norm1 = (norm1.gamma.detach(), norm1.beta.detach(), norm1.eps)
        self.norm2 = (norm2.gamma.detach(), norm2.beta.detach(), norm2.eps)
        self.ffn1, self.ffn2 = _RowsConv(ffn.conv_1), _RowsConv(ffn.conv_2)
        self.hidden = h

    def attention(self, x: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        """x (P, H), fill (1, P, P) True where a key may not be attended -> x + attn(x), before norm1."""
        p, w = x.shape[0], self.window
        qkv = self.qkv(x).view(p, 3, self.heads, self.head_dim).permute(1, 2, 0, 3)  # (3, h, P, d)
        q, k, v = qkv[0] / math.sqrt(self.head_dim), qkv[1], qkv[2]
        rel = _to_band(torch.matmul(q, self.rel_k))[..., w : w + p]  # (h, P, P): the band, zeros off it
        scores = torch.matmul(q, k.transpose(-2, -1)) + rel
        probs = F.softmax(scores.masked_fill(fill, -1e4), dim=-1)
        out = torch.matmul(probs, v)
        out = out + torch.matmul(_from_band(F.pad(probs, (w, w))), self.rel_v)  # (h, P, d)
        return self.o(out.transpose(0, 1).reshape(p, self.hidden), other=x)

    def __call__(self, x: torch.Tensor, mask: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(self.attention(x, fill), (self.hidden,), *self.norm1)
        y = torch.relu_(self.ffn1(x * mask)).mul_(mask)
        y = self.ffn2(y).mul_(mask)
        return F.layer_norm(x + y, (self.hidden,), *self.norm2)


class PackedTextEncoder:
    """`TextEncoder.forward` time-major on packed GEMMs (module docstring); derived from the encoder's
    weights at `TextEncoder.pack` (rebuild after changing them)."""

    def __init__(self, enc: torch.nn.Module) -> None:
        e = enc.encoder
        self.emb, self.scale = enc.emb.weight.detach(), math.sqrt(enc.cfg.hidden_channels)
        self.layers = [_Layer(*m) for m in zip(e.attn_layers, e.norm_layers_1, e.ffn_layers, e.norm_layers_2)]
        self.proj = PackedLinear(enc.proj.weight.detach()[:, :, 0], enc.proj.bias.detach())
        self.inter = enc.cfg.inter_channels

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, index=None):
        """ids (1, P), mask (1, 1, P) -> hidden (1, H, P), m (1, C, P), logs (1, C, P) (views)."""
        mask_t = mask[0].t()  # (P, 1)
        fill = (mask_t * mask[0]).eq(0).unsqueeze(0)  # (1, P, P)
        x = F.embedding(ids[0], self.emb) * self.scale * mask_t
        for layer in self.layers:
            x = layer(x, mask_t, fill)
        x = x * mask_t
        stats = self.proj(x).mul_(mask_t).t().unsqueeze(0)  # (1, 2C, P)
        m, logs = stats.split(self.inter, dim=1)
        return x.t().unsqueeze(0), m, logs
