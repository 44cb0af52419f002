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

from flashrt.nn.attention import StaticKV, attend
from flashrt.nn.norms import AdaRMSNorm, RMSNorm, gated_residual
from flashrt.nn.rope import apply_rope
from flashrt.ops import Form, Op, OpSlot, register
from flashrt.ops.decoder import ADD_RMS_NORM, GELU_MUL, RMS_NORM, ROPE_QKV, NormRow, csrc_loads
from flashrt.ops.platform import onednn_available, plain_f32

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin tables (B, L, 1, D) of `rope_cos_sin`


def _norm(width: int, eps: float, cond_dim: int | None) -> nn.Module:
    return RMSNorm(width, eps) if cond_dim is None else AdaRMSNorm(width, cond_dim, eps)


def norm_rows(norms: list[nn.Module], mods: torch.Tensor | None, gates: torch.Tensor | None,
              dtype: torch.dtype) -> list[NormRow]:
    """One `NormRow` per norm: plain RMSNorms their ``scale`` table; adaptive ones the rows of ``mods``
    (len(norms), 3, W), gates from ``gates`` or ``mods`` cast to ``dtype`` (one cast for all)."""
    if mods is None:
        return [NormRow(n.scale) for n in norms]
    scale, shift, gate = mods.unbind(-2)
    gate = gate if gates is None else gates
    gate = gate if gate.dtype == dtype else gate.to(dtype)
    return list(map(NormRow, scale.unbind(0), shift.unbind(0), gate.unbind(0)))


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``layer(x)`` without the module call (hooks are not used here; less host time per call)."""
    return F.linear(x, layer.weight, layer.bias)


class GemmaLayer(nn.Module):
    """Pre-norm decoder layer: norm → attention (RoPE, static K/V) → residual → norm → GeGLU → residual."""

    def __init__(self, width: int, mlp_dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float = 1e-6, cond_dim: int | None = None) -> None:
        super().__init__()
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.eps = eps
        self.input_norm = _norm(width, eps, cond_dim)
        self.qkv = nn.Linear(width, (num_heads + 2 * num_kv_heads) * head_dim, bias=False)
        self.o = nn.Linear(num_heads * head_dim, width, bias=False)
        self.post_norm = _norm(width, eps, cond_dim)
        self.gate_up = nn.Linear(width, 2 * mlp_dim, bias=False)
        self.down = nn.Linear(mlp_dim, width, bias=False)
        self.geglu = OpSlot(GEGLU)  # op slots: the references until `flashrt.ops.select`
        self.rms_norm, self.add_rms_norm = OpSlot(RMS_NORM), OpSlot(ADD_RMS_NORM)
        self.rope_qkv, self.gelu_mul = OpSlot(ROPE_QKV), OpSlot(GELU_MUL)

    def project(self, h: torch.Tensor, rope: Rope, kv: StaticKV, index: int, start: int,
                with_q: bool = True) -> torch.Tensor | None:
        """Normed h -> q (B, L, H, D) with RoPE (None unless ``with_q``); k (RoPE'd) and v are written
        straight into slots [start, start + L) of layer ``index`` of ``kv``."""
        heads, _, d = self.shape
        first = 0 if with_q else heads  # a K/V-only pass skips the query rows of the projection
        qkv = F.linear(h, self.qkv.weight[first * d:]).unflatten(-1, (-1, d))  # (B, L, [H +] 2 KV, D)
        k_slot, v_slot = kv.slots(index, start, start + h.shape[1])
        q = self.rope_qkv.run(qkv, *rope, k_slot, v_slot, heads - first)
        return q if with_q else None

    def block(self, x: torch.Tensor, h: torch.Tensor, rope: Rope, kv: StaticKV, index: int, start: int,
              bias: torch.Tensor, rows: Sequence[NormRow | None]):
        """The layer on the residual stream x and its normed input h (both (B, L, W)); ``rows``: this
        layer's input and post-attention norms and the norm after it (None: none, a plain residual).
        -> (x, that norm of x) (the norm None without one)."""
        first, post, after = rows
        q = self.project(h, rope, kv, index, start)
        end = start + x.shape[1]
        keys, values = kv.read(index, end)
        bias = bias if bias.shape[-1] == end else bias[..., :end]
        y = _linear(attend(q, keys, values, bias), self.o)
        x, h = self.add_rms_norm.run(x, y, first.gate, post.scale, post.shift, self.eps)
        if after is None:
            return gated_residual(x, self.mlp(h), post.gate), None
        return self.add_rms_norm.run(x, self.mlp(h), post.gate, after.scale, after.shift, self.eps)

    def forward(self, x: torch.Tensor, rope: Rope, kv: StaticKV, index: int, start: int,
                bias: torch.Tensor, mods: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, L, W) -> (B, L, W), the whole layer on its own; K/V of x go to slots [start, start + L)
        of layer ``index``. ``mods`` (2, 3, W): the adaRMS rows of its two norms.

        ``bias`` covers at least slots [0, start + L) (longer is sliced)."""
        first, post = norm_rows([self.input_norm, self.post_norm], mods, None, x.dtype)
        h = self.rms_norm.run(x, first.scale, first.shift, self.eps)
        return self.block(x, h, rope, kv, index, start, bias, (first, post, None))[0]

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """GeGLU ``down(gelu_tanh(gate) * up)`` with the form of the ``geglu`` slot (`GEGLU`)."""
        return self.geglu.run(self, h)

    def write_kv(self, h: torch.Tensor, rope: Rope, kv: StaticKV, index: int, start: int) -> None:
        """Only the K/V projection of the normed h, stored at [start, start + L) (the last layer of a
        prefill)."""
        self.project(h, rope, kv, index, start, with_q=False)


def _geglu_aten(layer: GemmaLayer, h: torch.Tensor) -> torch.Tensor:
    """One gate|up GEMM, tanh-GELU times up (`flashrt.ops.decoder.gelu_mul_ref`: the product formed in
    gelu's output), the down GEMM."""
    return _linear(layer.gelu_mul.run(_linear(h, layer.gate_up)), layer.down)


def _geglu_onednn(layer: GemmaLayer, h: torch.Tensor) -> torch.Tensor:
    """CPU, float32, row-major ``gate_up``: oneDNN GEMMs with the tanh-GELU fused into the gate GEMM and
    the product into the up GEMM (equal to `_geglu_aten` within float32 rounding, |Δ|/|y| ~1e-7; its GELU
    pass is ~4x cheaper than ATen's at the prefix's hundreds of rows, no gain at tens)."""
    m, w = layer.down.in_features, layer.gate_up.weight
    gate = torch.ops.mkldnn._linear_pointwise(h, w[:m], None, "gelu", [], "tanh")
    return _linear(torch.ops.mkldnn._linear_pointwise.binary(h, gate, w[m:], None, "mul"), layer.down)


GEGLU = register(Op("geglu", _geglu_aten, group="mlp", forms={
    "onednn": Form(_geglu_onednn, device="cpu", available=onednn_available,
                   fits=lambda layer: plain_f32(layer.gate_up.weight))}))  # (layer, h) -> the GeGLU's output


class Gemma(nn.Module):
    """N `GemmaLayer`s and a final norm; optional token embedding (scaled by sqrt(W), Gemma style)."""

    def __init__(self, width: int, depth: int, mlp_dim: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, vocab_size: int = 0, eps: float = 1e-6, cond_dim: int | None = None) -> None:
        super().__init__()
        self.width, self.eps = width, eps
        self.embed = nn.Embedding(vocab_size, width) if vocab_size else None
        self.layers = nn.ModuleList(
            GemmaLayer(width, mlp_dim, num_heads, num_kv_heads, head_dim, eps, cond_dim)
            for _ in range(depth))
        self.norm = _norm(width, eps, cond_dim)
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
    """One `GemmaLayer`'s weights as plain tensors for the token form (the same storage), with the norm
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
    def of(cls, layer: GemmaLayer) -> TokenLayer:
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
    """`GemmaLayer.forward` for one token (SDPA's CPU kernel costs several times more for one query row
    than the two small batched matmuls; the same math as `attend`)."""
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
