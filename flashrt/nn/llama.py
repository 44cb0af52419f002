"""The one decoder layer (`DecoderLayer`, its family differences flags of `LayerShape`) and the Llama /
Qwen2 / Qwen3 stack over a static K/V cache (the causal LMs of TTS). The same layer runs without a cache
(GR00T's Qwen3 / Qwen3-VL text layers, `flashrt.nn.qwen3vl.qwen3_layer`) and in Gemma's stack
(`flashrt.nn.gemma`: Pi0, Pi0.5, Pi0-FAST).

Shapes: B batch, L tokens of this call, W width, H query heads, KV key/value heads (H % KV == 0),
D head_dim, M mlp width, T static K/V length (cache slots), N depth.

Differences from transformers' `LlamaForCausalLM` / `Qwen3ForCausalLM`, all exact re-arrangements:

* q|k|v are one fused projection ``qkv`` (W -> (H + 2 KV) D, with bias when the checkpoint has one:
  Qwen2) and gate|up one ``gate_up`` (W -> 2M); the weight map concatenates the separate matrices.
* RoPE tables for every cache slot are computed once at load (`rope_table`, float32, any scaling in
  `ROPE_SCALINGS`) and gathered by position inside the step, so positions can live in device tensors.
* Three ways to store this call's keys/values (`Slot`): ``int start`` writes slots [start, start + L)
  (a prefill bucket, shapes fixed at capture) and attends to [0, start + L); a ``(1,) int64 tensor``
  writes the single decode token at that slot with ``index_copy_`` and attends to all T slots under a
  bias that masks slots beyond the position; `RowPositions` ((B,) int64) writes each row's decode token
  at that row's own slot (``scatter_``: the rows of a slot-batched decode are different requests at
  different positions). Either way nothing is concatenated per call and no value is read on the host.
* Qwen3's q/k RMSNorms over head_dim run before RoPE, as in the reference.
* Norms are the one `flashrt.nn.norms.RMSNorm` in the Llama form (``offset`` off, ``cast_first``:
  ``w * normalize(x).to(dtype)``, statistics in float32; ``LayerShape.cast_first`` False: the float32
  product GR00T computes for its Qwen3-VL text layers); every residual add is fused with the norm
  after it (``add_rms_norm``: layer i ends with layer i + 1's input norm, the last with the final norm),
  so `DecoderLayer.block` takes the residual stream and its normed input ``(x, h)``.
* Norms, RoPE (q rotated, k rotated into its cache slot and v stored, one ``rope_qkv``) and the gated
  MLP's product run through op slots (`flashrt.ops.OpSlot`: ``rms_norm``, ``add_rms_norm``,
  ``rope_qkv``, ``act_mul`` (``silu_mul`` or ``gelu_mul``) of `flashrt.ops.decoder`, and ``token_rope``,
  `TOKEN_ROPE`: the RoPE of a decode token not stored in place): "aten" (the references, default: the
  same ops as before) or "fused" (the ``flashrt::`` custom ops, one CUDA kernel each where csrc is
  built). A GeGLU layer's GEMMs run through its ``geglu`` slot (`GEGLU`): "aten" (default) or "onednn"
  (CPU, float32, row-major weights: GELU and product fused into oneDNN GEMMs). `flashrt.ops.select`
  picks every form at load.

`DecoderLayer.causal` (``forward`` without a cache): one pass over the call's own tokens, causal SDPA
(``is_causal``), nothing stored.

Attention is SDPA with an additive bias from `causal_bias` / `decode_bias` (finite `mask_value`, never
-inf): a prefill with ``enable_gqa`` (its causal mask depends on the query), a decode token through
`flashrt.nn.attention.attend` (its bias depends on the key only, so the queries of each K/V group fold
into one call: no ``enable_gqa`` with a mask, which CUDA's fused SDPA kernels refuse, sending the call
to the math path, op by op). A slot-batched decode token (`RowPositions`) goes through the Llama stack's
``decode_attention`` slot (`DECODE_ATTENTION`): "sdpa" (that call, its bias built once per step and
shared by the layers) or "native" (CPU float32: ``flashrt_cpu::decode_attention``, each row over its
own keys, no bias; `flashrt.ops.torch_cpu`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from flashrt.errors import CheckpointError
from flashrt.nn.attention import StaticKV, attend, mask_value
from flashrt.nn.norms import AdaRMSNorm, RMSNorm, gated_residual
from flashrt.nn.rope import apply_rope
from flashrt.ops import Form, Op, OpSlot, register
from flashrt.ops.decoder import ADD_RMS_NORM, GELU_MUL, RMS_NORM, ROPE_QKV, SILU_MUL, NormRow, csrc_loads
from flashrt.ops.platform import onednn_available, plain_f32
from flashrt.ops.torch_cpu import loads as torch_cpu_loads

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin (B, L, 1, D) as in `flashrt.nn.rope`


@dataclass(frozen=True)
class RowPositions:
    """One decode token per row, each stored at its own cache slot: ``positions`` (B,) int64. The
    attention bias of those positions (`decode_bias`) is built by the first layer that asks for it and
    shared by the others (a form that reads the positions itself never builds it)."""

    positions: torch.Tensor
    _biases: dict = field(default_factory=dict, compare=False, repr=False)

    def bias(self, slots: int, dtype: torch.dtype) -> torch.Tensor:
        """(B, 1, 1, slots) additive bias: each row sees the slots up to its position."""
        if (slots, dtype) not in self._biases:
            self._biases[slots, dtype] = decode_bias(self.positions, slots, dtype)
        return self._biases[slots, dtype]


Slot = int | torch.Tensor | RowPositions   # prefill start slot, a (1,) decode position, or one per row


# ------------------------------------------------------------------------------------------ RoPE

@dataclass(frozen=True)
class RopeScaling:
    """transformers' ``rope_parameters`` / ``rope_scaling`` (the fields flashrt implements)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, where: str = "config.json") -> RopeScaling:
        d = dict(d or {})
        kind = d.pop("rope_type", d.pop("type", "default"))
        if kind not in ROPE_SCALINGS:
            raise CheckpointError(f"{where}: rope_type {kind!r} is not supported; supported: "
                                  f"{sorted(ROPE_SCALINGS)}")
        d.pop("rope_theta", None)
        known = {k: d[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings") if k in d}
        return cls(kind, **known)


def _default_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    return inv_freq


def _linear_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    return inv_freq / s.factor


def _llama3_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1+: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between."""
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


ROPE_SCALINGS = {"default": _default_freq, "linear": _linear_freq, "llama3": _llama3_freq}


def rope_table(head_dim: int, theta: float, length: int, scaling: RopeScaling = RopeScaling(),
               device: torch.device | str | None = None) -> Rope:
    """``[c | c]``, ``[-s | s]`` tables (T, D) float32 for positions 0..T-1 (see `flashrt.nn.rope`)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = ROPE_SCALINGS[scaling.rope_type](1.0 / (theta ** exponent), scaling)
    freqs = torch.arange(length, device=device).float()[:, None] * inv_freq[None, :]  # (T, D/2)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)


def gather_rope(table: Rope, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
    """Rows of a `rope_table` at positions (B, L) int64 -> (B, L, 1, D) tables in ``dtype``."""
    cos, sin = table
    return cos[positions][:, :, None].to(dtype), sin[positions][:, :, None].to(dtype)


# ------------------------------------------------------------------------------------------ masks

def causal_bias(length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(1, 1, L, L) additive bias: query i sees keys 0..i."""
    i = torch.arange(length, device=device)
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(i[None, :] <= i[:, None], zero, torch.full((), mask_value(dtype), dtype=dtype,
                                                                   device=device))[None, None]


def decode_bias(position: torch.Tensor, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """(R, 1, 1, T) additive bias for one token per row at ``position`` ((R,), R = 1 for a shared
    position): each row sees slots <= its position."""
    s = torch.arange(slots, device=position.device)
    zero = torch.zeros((), dtype=dtype, device=position.device)
    masked = torch.full((), mask_value(dtype), dtype=dtype, device=position.device)
    return torch.where(s[None, :] <= position[:, None], zero, masked)[:, None, None]


# ------------------------------------------------------------------------------------------ layers

@dataclass(frozen=True)
class LayerShape:
    """Sizes and switches of the one decoder layer (the family differences are flags, not classes):
    Llama / Qwen2 / Qwen3 (defaults and bias / q-k norm flags), GR00T's Qwen3-VL text layers
    (``cast_first`` off), Gemma (``act`` "gelu_tanh", ``offset``, ``cast_first`` off, ``causal`` off;
    ``cond_dim``: Pi0.5's adaptive norms)."""

    width: int
    mlp: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float = 1e-6
    qkv_bias: bool = False     # Qwen2 (and Llama with attention_bias)
    o_bias: bool = False       # Llama with attention_bias
    qk_norm: bool = False      # Qwen3
    cast_first: bool = True    # the norms' rounding (`RMSNorm`); False: Gemma, GR00T's Qwen3-VL text layers
    offset: bool = False       # norm gain 1 + w (Gemma)
    act: str = "silu"          # gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    causal: bool = True        # a prefill's bias depends on the query (SDPA); False: key-only (`attend`)
    cond_dim: int | None = None  # adaptive norms conditioned on a (cond_dim,) vector (Pi0.5's expert)


ACTIVATIONS = {"silu": SILU_MUL, "gelu_tanh": GELU_MUL}  # act -> its product op (`flashrt.ops.decoder`)


def _norm(dim: int, s: LayerShape) -> nn.Module:
    if s.cond_dim is not None:
        return AdaRMSNorm(dim, s.cond_dim, s.eps)
    return RMSNorm(dim, s.eps, offset=s.offset, cast_first=s.cast_first)


def norm_rows(norms: Sequence[nn.Module], mods: torch.Tensor | None, gates: torch.Tensor | None,
              dtype: torch.dtype) -> list[NormRow]:
    """One `NormRow` per norm: plain RMSNorms their ``scale`` table; adaptive ones the rows of ``mods``
    (len(norms), 3, W), gates from ``gates`` or ``mods`` cast to ``dtype`` (one cast for all)."""
    if mods is None:
        return [NormRow(n.scale) for n in norms]
    scale, shift, gate = mods.unbind(-2)
    gate = gate if gates is None else gates
    gate = gate if gate.dtype == dtype else gate.to(dtype)
    return list(map(NormRow, scale.unbind(0), shift.unbind(0), gate.unbind(0)))


class DecoderLayer(nn.Module):
    """The one pre-norm decoder layer: norm -> attention (RoPE, static K/V) -> residual -> norm -> gated
    MLP -> residual, the families' differences in its `LayerShape`."""

    def __init__(self, s: LayerShape) -> None:
        super().__init__()
        if s.act not in ACTIVATIONS:
            raise ValueError(f"act={s.act!r}; choose one of {sorted(ACTIVATIONS)}")
        self.s, self.eps = s, s.eps
        self.shape = (s.heads, s.kv_heads, s.head_dim)
        self.input_norm = _norm(s.width, s)
        self.qkv = nn.Linear(s.width, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=s.qkv_bias)
        self.o = nn.Linear(s.heads * s.head_dim, s.width, bias=s.o_bias)
        self.q_norm = RMSNorm(s.head_dim, s.eps, False, s.cast_first) if s.qk_norm else None
        self.k_norm = RMSNorm(s.head_dim, s.eps, False, s.cast_first) if s.qk_norm else None
        self.post_norm = _norm(s.width, s)
        self.gate_up = nn.Linear(s.width, 2 * s.mlp, bias=False)
        self.down = nn.Linear(s.mlp, s.width, bias=False)
        # op slots: the references until `flashrt.ops.select`
        self.rms_norm, self.add_rms_norm = OpSlot(RMS_NORM), OpSlot(ADD_RMS_NORM)
        self.rope_qkv, self.token_rope = OpSlot(ROPE_QKV), OpSlot(TOKEN_ROPE)
        self.act_mul = OpSlot(ACTIVATIONS[s.act])
        self.geglu = OpSlot(GEGLU) if s.act == "gelu_tanh" else None  # a GeGLU's GEMMs (`GEGLU`)
        # the attention of a slot-batched decode step (`RowPositions`): the `Llama` stack sets the slot
        self.decode_attention: OpSlot | None = None

    def project(self, h: torch.Tensor, rope: Rope, kv: StaticKV, index: int, start: int,
                with_q: bool = True) -> torch.Tensor | None:
        """Normed h -> q (B, L, H, D) with RoPE (None unless ``with_q``); k (RoPE'd) and v are written
        straight into slots [start, start + L) of layer ``index`` of ``kv`` (a cache with slot views)."""
        heads, _, d = self.shape
        first = 0 if with_q else heads  # a K/V-only pass skips the query rows of the projection
        b = self.qkv.bias
        qkv = F.linear(h, self.qkv.weight[first * d:], None if b is None else b[first * d:])
        k_slot, v_slot = kv.slots(index, start, start + h.shape[1])
        q = self.rope_qkv.run(qkv.unflatten(-1, (-1, d)), *rope, k_slot, v_slot, heads - first)
        return q if with_q else None

    def _attend(self, h: torch.Tensor, rope: Rope, kv: StaticKV, index: int, slot: Slot,
                bias: torch.Tensor | None) -> torch.Tensor:
        """Normed h (B, L, W) -> attention output (B, L, H D); this call's K/V stored at ``slot``."""
        s = self.s
        if self.q_norm is None and isinstance(slot, int) and kv.slot_views:
            q = self.project(h, rope, kv, index, slot)  # k rotated into its cache slots, v stored
            keys, values = kv.read(index, slot + h.shape[1])
        else:
            qkv = F.linear(h, self.qkv.weight, self.qkv.bias).unflatten(-1, (-1, s.head_dim))
            if self.q_norm is not None:  # Qwen3: q/k norms before RoPE
                q, k, v = qkv.split((s.heads, s.kv_heads, s.kv_heads), dim=2)
                q = self.rms_norm.run(q, self.q_norm.scale, None, s.eps, s.cast_first)
                k = self.rms_norm.run(k, self.k_norm.scale, None, s.eps, s.cast_first)
                cos, sin = rope
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            else:  # a decode token (or a cache without slot views): k, v rotated once, then stored
                q, k, v = self.token_rope.run(qkv, rope, s)
            keys, values = _store(kv, index, slot, k, v)
        if s.causal and isinstance(slot, int):  # a causal prefill: the mask depends on the query
            att = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=bias,
                                                 scale=s.head_dim ** -0.5, enable_gqa=True)
            return att.transpose(1, 2).flatten(2)
        if isinstance(slot, RowPositions):  # one token per row, each over its own keys
            run = _decode_attention_sdpa if self.decode_attention is None else self.decode_attention.run
            return run(q, keys, values, slot, s.head_dim ** -0.5)
        end = keys.shape[2]  # a key-only bias: each group's queries fold into one call
        return attend(q, keys, values, bias if bias.shape[-1] == end else bias[..., :end])

    def block(self, x: torch.Tensor, h: torch.Tensor, rope: Rope, kv: StaticKV, index: int, slot: Slot,
              bias: torch.Tensor | None, rows: Sequence[NormRow | None]):
        """The layer on the residual stream x and its normed input h (both (B, L, W)); ``rows``: this
        layer's input and post-attention norms and the norm after it (None: none, a plain residual).
        -> (x, that norm of x) (the norm None without one)."""
        (first, post, after), s = rows, self.s
        y = F.linear(self._attend(h, rope, kv, index, slot, bias), self.o.weight, self.o.bias)
        x, h = self.add_rms_norm.run(x, y, first.gate, post.scale, post.shift, s.eps, s.cast_first)
        if after is None:
            return gated_residual(x, self.mlp(h), post.gate), None
        return self.add_rms_norm.run(x, self.mlp(h), post.gate, after.scale, after.shift, s.eps, s.cast_first)

    def forward(self, x: torch.Tensor, rope: Rope, kv: StaticKV | None = None, index: int = 0, slot: Slot = 0,
                bias: torch.Tensor | None = None, mods: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, L, W) -> (B, L, W), the layer on its own; its K/V stored at ``slot`` (module docstring);
        ``mods`` (2, 3, W): the adaptive rows of its two norms. Without ``kv``: `causal` (no cache)."""
        if kv is None:
            return self.causal(x, rope)
        first, post = norm_rows([self.input_norm, self.post_norm], mods, None, x.dtype)
        h = self.rms_norm.run(x, first.scale, first.shift, self.s.eps, self.s.cast_first)
        return self.block(x, h, rope, kv, index, slot, bias, (first, post, None))[0]

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The gated MLP ``down(act(gate) * up)``: a GeGLU in the form of its ``geglu`` slot (`GEGLU`), a
        SwiGLU as `_mlp_aten`."""
        return _mlp_aten(self, h) if self.geglu is None else self.geglu.run(self, h)

    def write_kv(self, h: torch.Tensor, rope: Rope, kv: StaticKV, index: int, start: int) -> None:
        """Only the K/V projection of the normed h, stored at [start, start + L) (the last layer of a
        prefill whose output is never read)."""
        self.project(h, rope, kv, index, start, with_q=False)

    def causal(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """x (B, L, W) -> (B, L, W) without a cache: causal attention over this call's own tokens (the
        prefill-only form of GR00T's backbone, nothing kept); ``rope`` (B or 1, L, 1, D) tables."""
        s, norm = self.s, self.rms_norm.run
        b, n, _ = x.shape
        h = norm(x, self.input_norm.scale, None, s.eps, s.cast_first)
        qkv = F.linear(h, self.qkv.weight, self.qkv.bias).unflatten(-1, (-1, s.head_dim))
        if self.q_norm is not None:
            q, k, v = qkv.split((s.heads, s.kv_heads, s.kv_heads), dim=2)
            q = apply_rope(norm(q, self.q_norm.scale, None, s.eps, s.cast_first), *rope)
            k = apply_rope(norm(k, self.k_norm.scale, None, s.eps, s.cast_first), *rope)
        else:
            k, v = (qkv.new_empty((b, n, s.kv_heads, s.head_dim)) for _ in range(2))
            q = self.rope_qkv.run(qkv, *rope, k, v, s.heads)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=s.kv_heads != s.heads)
        y = F.linear(att.transpose(1, 2).reshape(b, n, -1), self.o.weight, self.o.bias)
        x, h = self.add_rms_norm.run(x, y, None, self.post_norm.scale, None, s.eps, s.cast_first)
        return x + self.mlp(h)


def _mlp_aten(layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
    """One gate|up GEMM, the activation times up (its ``act_mul`` slot: `flashrt.ops.decoder.gelu_mul_ref`
    / `silu_mul_ref`, the product formed in the activation's output, or their fused forms), the down
    GEMM."""
    return F.linear(layer.act_mul.run(F.linear(h, layer.gate_up.weight)), layer.down.weight)


def _geglu_onednn(layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
    """CPU, float32, row-major ``gate_up``, GeGLU only: oneDNN GEMMs with the tanh-GELU fused into the
    gate GEMM and the product into the up GEMM (equal to `_mlp_aten` within float32 rounding, |Δ|/|y|
    ~1e-7; its GELU pass is ~4x cheaper than ATen's at the prefix's hundreds of rows, no gain at tens)."""
    m, w = layer.down.in_features, layer.gate_up.weight
    gate = torch.ops.mkldnn._linear_pointwise(h, w[:m], None, "gelu", [], "tanh")
    return F.linear(torch.ops.mkldnn._linear_pointwise.binary(h, gate, w[m:], None, "mul"), layer.down.weight)


# (layer, h) -> the GeGLU's output: a GeGLU layer's GEMMs (group "mlp")
GEGLU = register(Op("geglu", _mlp_aten, group="mlp", forms={
    "onednn": Form(_geglu_onednn, device="cpu", available=onednn_available,
                   fits=lambda layer: plain_f32(layer.gate_up.weight))}))


def _rope_split(qkv: torch.Tensor, rope: Rope, s: LayerShape) -> tuple[torch.Tensor, ...]:
    """q, k rotated (new tensors), v a view: the fewest ops where each runs on its own (the CPU)."""
    q, k, v = qkv.split((s.heads, s.kv_heads, s.kv_heads), dim=2)
    return apply_rope(q, *rope), apply_rope(k, *rope), v


def _rope_fused(qkv: torch.Tensor, rope: Rope, s: LayerShape) -> tuple[torch.Tensor, ...]:
    """q, k rotated and v copied by one ``flashrt::rope_qkv`` (one kernel on a GPU), into new tensors."""
    shape = (*qkv.shape[:2], s.kv_heads, s.head_dim)
    k, v = qkv.new_empty(shape), qkv.new_empty(shape)
    return torch.ops.flashrt.rope_qkv(qkv, *rope, k, v, s.heads), k, v


# the RoPE of a token not stored in place: (qkv (B, L, H + 2 KV, D), rope, shape) -> q, k, v
TOKEN_ROPE = register(Op("token_rope", _rope_split, group="decoder", forms={
    "fused": Form(_rope_fused, device="cuda", available=csrc_loads)}))


def _decode_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: RowPositions,
                           scale: float) -> torch.Tensor:
    """q (B, 1, H, D) over k, v (B, KV, S, D), each row up to its position -> (B, 1, H D): SDPA under the
    rows' bias (``scale`` is SDPA's default, 1 / sqrt(D))."""
    return attend(q, k, v, rows.bias(k.shape[2], q.dtype))


def _decode_attention_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: RowPositions,
                             scale: float) -> torch.Tensor:
    """The same by ``flashrt_cpu::decode_attention`` (csrc/decode_attention_cpu.cpp): each row reads its
    own keys only, no bias."""
    return torch.ops.flashrt_cpu.decode_attention(q, k, v, rows.positions, scale)


def _native_decode_fits(layer: DecoderLayer) -> bool:
    """What the kernel takes: float32 weights, head_dim a multiple of 16 up to 256, at most 16 query heads
    per K/V head."""
    heads, kv_heads, dim = layer.shape
    return layer.qkv.weight.dtype == torch.float32 and dim % 16 == 0 and dim <= 256 and heads <= 16 * kv_heads


# (q, k, v, rows, scale) -> (B, 1, H D): a slot-batched decode token's attention (`RowPositions`)
DECODE_ATTENTION = register(Op("decode_attention", _decode_attention_sdpa, reference_name="sdpa", forms={
    "native": Form(_decode_attention_native, device="cpu", available=torch_cpu_loads,
                   dtypes=(torch.float32,), fits=_native_decode_fits)}))


def _store(kv: StaticKV, index: int, slot: Slot, k: torch.Tensor,
           v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write k, v (B, L, KV, D) at ``slot``; return the keys/values to attend to, (B, KV, S, D) each."""
    if isinstance(slot, int):
        kv.write(index, slot, k, v)
        return kv.read(index, slot + k.shape[1])
    if isinstance(slot, RowPositions):
        rows, _, heads, dim = k.shape
        at = slot.positions.view(rows, 1, 1, 1).expand(rows, heads, 1, dim)
        kv.k[index].scatter_(2, at, k.transpose(1, 2))
        kv.v[index].scatter_(2, at, v.transpose(1, 2))
        return kv.k[index], kv.v[index]
    kv.k[index].index_copy_(2, slot, k.transpose(1, 2))
    kv.v[index].index_copy_(2, slot, v.transpose(1, 2))
    return kv.k[index], kv.v[index]


class Llama(nn.Module):
    """Embedding, N `DecoderLayer`s, final norm and the LM head (``head`` None: tied to the embedding)."""

    def __init__(self, s: LayerShape, depth: int, vocab_size: int, tied: bool) -> None:
        super().__init__()
        self.s = s
        self.embed = nn.Embedding(vocab_size, s.width)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(depth))
        self.norm = _norm(s.width, s)
        self.head = None if tied else nn.Linear(s.width, vocab_size, bias=False)
        self.rms_norm = OpSlot(RMS_NORM)  # the first layer's input norm
        for layer in self.layers:
            layer.decode_attention = OpSlot(DECODE_ATTENTION)
        # every norm in order, a plain tuple (no ModuleList slicing per call): layer i's input norm at 2i,
        # its post-attention norm at 2i + 1, the final norm last (as `flashrt.nn.gemma.Gemma.norms`)
        self._norms = (*(n for layer in self.layers for n in (layer.input_norm, layer.post_norm)), self.norm)

    def hidden(self, tokens: torch.Tensor, rope: Rope, kv: StaticKV, slot: Slot,
               bias: torch.Tensor | None) -> torch.Tensor:
        """tokens (B, L) int64 -> final-normed hidden states (B, L, W)."""
        x = self.embed(tokens)
        rows = [NormRow(n.scale) for n in self._norms]
        h = self.rms_norm.run(x, rows[0].scale, None, self.s.eps, self.s.cast_first)
        for i, layer in enumerate(self.layers):
            x, h = layer.block(x, h, rope, kv, i, slot, bias, rows[2 * i: 2 * i + 3])
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., W) -> (..., V) float32 logits."""
        weight = self.embed.weight if self.head is None else self.head.weight
        return F.linear(h, weight).float()
