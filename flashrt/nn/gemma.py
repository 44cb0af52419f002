"""Gemma decoder stack writing its keys and values into static buffers (PaliGemma LM and Pi0 expert).

Shapes: B batch, L tokens of this call, W width, H query heads, KV key/value heads, D head_dim,
M mlp_dim, T static K/V length, N depth, V vocabulary.

Differences from a textbook Gemma, all exact re-arrangements of the same math:

* q|k|v are one fused projection ``qkv`` (W -> (H + 2 KV) D) and gate|up one ``gate_up``
  (W -> 2M); the weight map concatenates the checkpoint's separate matrices at load.
* Every call writes its keys/values at token slots ``[start, start + L)`` of a `StaticKV` and attends
  to slots ``[0, start + L)`` under a key-padding bias; the caller decides the layout (prefix first,
  expert tokens after). Nothing is concatenated per call.
* ``kv_only_last=True`` stops the last layer after its K/V projection: a prefix pass only needs the
  cache, never the prefix's output (that skips the last query rows, attention, MLP and final norm).
* The rotated keys are written straight into their K/V slots (``rope_qkv``: q and k rotated, v
  stored, in one op), no copy.
* Every residual add is fused with the norm after it (``add_rms_norm``): layer i ends with the input
  norm of layer i + 1 (the last layer with the final norm), so a layer takes the residual stream and
  its own normed input, ``(x, h)``. The norms' ``1 + w`` are load-time tables (`RMSNorm.scale`).
* Norm, RoPE and GeGLU products run through op slots (`flashrt.ops.OpSlot`: ``rms_norm``,
  ``add_rms_norm``, ``rope_qkv``, ``gelu_mul`` of `flashrt.ops.decoder`): "aten" (the references,
  default) or "fused" (the ``flashrt::`` custom ops: one CUDA kernel each where csrc is built). The
  GeGLU's GEMMs run through the ``geglu`` slot (`GEGLU`): "aten" (default) or "onednn" (CPU, float32,
  row-major weights: GELU and product fused into oneDNN GEMMs). `flashrt.ops.select` picks at load.
* With ``cond_dim`` (Pi0.5 expert) the norms are adaptive; the caller passes a modulation table
  ``mods`` (2N + 1, 3, W) float32 (rows: layer i input norm at 2i, post-attention norm at 2i + 1,
  final norm last), typically precomputed once per denoise schedule (`Gemma.modulation`), and may pass
  its gate rows ``gates`` (2N + 1, W) already in the activation dtype (else cast once per call).
* The token form (`TokenLayer`, the op `DECODE_TOKENS`): the same layer for one decode token (batch 1)
  whose cache slot is a device tensor (Pi0-FAST's decode step): K/V stored with ``index_copy_``,
  attention of the single query row as ``baddbmm`` + ``bmm`` over every slot under a bias. Its
  reference "aten" is written for the CPU's per-op dispatch (plain-tensor weights, torch's one-op
  RMSNorm, ATen GeGLU); its form "fused" (group "decoder", chosen with the other decoder ops by
  `flashrt.ops.select`) runs the ``flashrt::`` ops (norm + residual, RoPE, GeGLU product) as the
  stack does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from flashrt.nn.attention import StaticKV
from flashrt.nn.llama import GEGLU, DecoderLayer, LayerShape, norm_rows  # noqa: F401  (GEGLU re-exported)
from flashrt.nn.norms import AdaRMSNorm, RMSNorm
from flashrt.nn.rope import apply_rope
from flashrt.ops import Form, Op, OpSlot, register
from flashrt.ops.decoder import RMS_NORM, csrc_loads
from flashrt.ops.platform import onednn_available  # noqa: F401  (re-exported)

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin tables (B, L, 1, D) of `rope_cos_sin`


def gemma_layer(width: int, mlp_dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
                eps: float = 1e-6, cond_dim: int | None = None) -> DecoderLayer:
    """A Gemma layer: the one decoder layer (`flashrt.nn.llama.DecoderLayer`) with Gemma's flags
    (``1 + w`` norms, the float32 norm product, GeGLU, a key-only prefill bias; ``cond_dim``: adaptive
    norms)."""
    return DecoderLayer(LayerShape(width, mlp_dim, num_heads, num_kv_heads, head_dim, eps, cast_first=False,
                                   offset=True, act="gelu_tanh", causal=False, cond_dim=cond_dim))


class Gemma(nn.Module):
    """N Gemma layers (`gemma_layer`) and a final norm; optional token embedding (scaled by sqrt(W),
    Gemma style)."""

    def __init__(self, width: int, depth: int, mlp_dim: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, vocab_size: int = 0, eps: float = 1e-6, cond_dim: int | None = None) -> None:
        super().__init__()
        self.width, self.eps = width, eps
        self.embed = nn.Embedding(vocab_size, width) if vocab_size else None
        self.layers = nn.ModuleList(
            gemma_layer(width, mlp_dim, num_heads, num_kv_heads, head_dim, eps, cond_dim)
            for _ in range(depth))
        self.norm = RMSNorm(width, eps) if cond_dim is None else AdaRMSNorm(width, cond_dim, eps)
        self.register_buffer("embed_scale", torch.tensor(width**0.5), persistent=False)
        self.rms_norm = OpSlot(RMS_NORM)  # the first layer's input norm

    def reset_derived(self) -> None:
        """sqrt(W) rounded to the embedding dtype, as the reference multiplies in that dtype."""
        dtype = self.embed.weight.dtype if self.embed is not None else torch.float32
        self.embed_scale = torch.tensor(self.width**0.5, dtype=torch.float32).to(dtype)

    @property
    def adaptive(self) -> bool:
        return isinstance(self.norm, AdaRMSNorm)

    @property
    def norms(self) -> list[nn.Module]:
        """Every norm in order: layer i's input norm at 2i, its post-attention norm at 2i + 1, final last."""
        return [n for layer in self.layers for n in (layer.input_norm, layer.post_norm)] + [self.norm]

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, L) int64 -> (B, L, W) ``embedding * sqrt(W)``."""
        return self.embed(tokens) * self.embed_scale.to(self.embed.weight.dtype)

    def modulation(self, cond: torch.Tensor) -> torch.Tensor:
        """adaRMS table for conditioning ``cond`` (..., C) -> (..., 2N + 1, 3, W) float32."""
        return torch.stack([n.modulation(cond) for n in self.norms], dim=-3)

    def forward(self, x: torch.Tensor, rope: Rope, kv: StaticKV, start: int, bias: torch.Tensor,
                mods: torch.Tensor | None = None, kv_only_last: bool = False,
                gates: torch.Tensor | None = None) -> torch.Tensor | None:
        """x (B, L, W) -> final-normed (B, L, W), or None with ``kv_only_last`` (cache filled only)."""
        rows = norm_rows(self.norms, mods, gates, x.dtype)
        h = self.rms_norm.run(x, rows[0].scale, rows[0].shift, self.eps)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if kv_only_last and i == last:
                layer.write_kv(h, rope, kv, i, start)
                return None
            x, h = layer.block(x, h, rope, kv, i, start, bias, rows[2 * i: 2 * i + 3])
        return h


# ------------------------------------------------------------------------------------------ token form
@dataclass(frozen=True)
class TokenLayer:
    """One Gemma layer's weights as plain tensors for the token form (the same storage), with the norm
    gains ``1 + w`` in float32. Valid while the module's weights keep their storage."""

    heads: int
    kv_heads: int
    head_dim: int
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    gain_in: torch.Tensor
    gain_post: torch.Tensor
    eps: float

    @classmethod
    def of(cls, layer: DecoderLayer) -> TokenLayer:
        return cls(*layer.shape, layer.qkv.weight, layer.o.weight, layer.gate_up.weight, layer.down.weight,
                   1.0 + layer.input_norm.weight.float(), 1.0 + layer.post_norm.weight.float(),
                   layer.input_norm.eps)


TokenCache = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # keys (KV, T, D), values, keys (KV, D, T)


def _token_stack_aten(layers: Sequence[TokenLayer], final: tuple[torch.Tensor, float], x: torch.Tensor,
                      rope: Rope, caches: Sequence[TokenCache], slot: torch.Tensor,
                      bias: torch.Tensor) -> torch.Tensor:
    """One token x (1, 1, W) at cache slot ``slot`` (1,) int64 through ``layers`` -> final-normed
    (1, 1, W); ``final``: the final norm's (gain, eps); ``rope`` rows (1, D); ``caches`` per layer: views
    of batch row 0 of the static K/V; ``bias`` (1, 1, T). The reference of `DECODE_TOKENS`."""
    for layer, cache in zip(layers, caches):
        x = _token_layer_aten(layer, x, rope, cache, slot, bias)
    return _norm_one(x, *final)


def _token_layer_aten(p: TokenLayer, x: torch.Tensor, rope: Rope, cache: TokenCache, slot: torch.Tensor,
                      bias: torch.Tensor) -> torch.Tensor:
    """A Gemma `DecoderLayer.forward` for one token (SDPA's CPU kernel costs several times more for one
    query row than the two small batched matmuls; the same math as `attend`)."""
    heads, kv, d = p.heads, p.kv_heads, p.head_dim
    keys, values, keys_t = cache
    qkv = F.linear(_norm_one(x, p.gain_in, p.eps), p.qkv).view(-1, d)  # (H + 2KV, D)
    qk = apply_rope(qkv[:heads + kv], *rope)  # q and k rotated together; rope rows (1, D)
    keys.index_copy_(1, slot, qk[heads:, None])
    values.index_copy_(1, slot, qkv[heads + kv:, None])
    scores = torch.baddbmm(bias, qk[:heads].view(kv, heads // kv, d), keys_t, alpha=d**-0.5)
    att = torch.bmm(scores.softmax(-1), values).view(1, 1, heads * d)  # head i uses kv head i // (H/KV)
    x = x + F.linear(att, p.o)
    gate, up = F.linear(_norm_one(x, p.gain_post, p.eps), p.gate_up).chunk(2, dim=-1)
    # plain ATen GeGLU: oneDNN's fused kernel (the prefill's choice) is far slower for one row
    return x + F.linear(F.gelu(gate, approximate="tanh").mul_(up), p.down)


def _norm_one(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm of one token as one fused op, ``gain`` = 1 + weight (float32, precomputed)."""
    y = F.rms_norm(_as(x, torch.float32), gain.shape, gain, eps)
    return _as(y, x.dtype)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without the dispatch when it already is (the decode step counts its ops)."""
    return x if x.dtype == dtype else x.to(dtype)


def _token_stack_fused(layers: Sequence[TokenLayer], final: tuple[torch.Tensor, float], x: torch.Tensor,
                       rope: Rope, caches: Sequence[TokenCache], slot: torch.Tensor,
                       bias: torch.Tensor) -> torch.Tensor:
    """The token form on the ``flashrt::`` ops: each residual add fused with the norm after it."""
    ops = torch.ops.flashrt
    cos, sin = (t.view(1, 1, 1, -1) for t in rope)
    gains = [p.gain_in for p in layers[1:]] + [final[0]]
    h = ops.rms_norm(x, layers[0].gain_in, None, layers[0].eps)
    for p, cache, after in zip(layers, caches, gains):
        heads, kv, d = p.heads, p.kv_heads, p.head_dim
        keys, values, keys_t = cache
        qkv = F.linear(h, p.qkv).view(1, 1, -1, d)  # (1, 1, H + 2KV, D)
        k, v = qkv.new_empty((1, 1, kv, d)), qkv.new_empty((1, 1, kv, d))
        q = ops.rope_qkv(qkv, cos, sin, k, v, heads)
        keys.index_copy_(1, slot, k[0].transpose(0, 1))
        values.index_copy_(1, slot, v[0].transpose(0, 1))
        scores = torch.baddbmm(bias, q.view(kv, heads // kv, d), keys_t, alpha=d**-0.5)
        att = torch.bmm(scores.softmax(-1), values).view(1, 1, heads * d)
        x, h = ops.add_rms_norm(x, F.linear(att, p.o), None, p.gain_post, None, p.eps)
        x, h = ops.add_rms_norm(x, F.linear(ops.gelu_mul(F.linear(h, p.gate_up)), p.down), None, after, None,
                                p.eps)
    return h


# (layers, final, x, rope, caches, slot, bias) -> the final-normed token (`_token_stack_aten`)
DECODE_TOKENS = register(Op("decode_tokens", _token_stack_aten, group="decoder", forms={
    "fused": Form(_token_stack_fused, device="cuda", available=csrc_loads)}))
