"""Attention over static key/value buffers, and masks built without host syncs.

Shapes: B batch, L query tokens, S key tokens, H query heads, KV key/value heads (H % KV == 0),
G = H / KV, D head_dim, T the fixed length of a static K/V buffer, N layers.

`attend` runs `torch.nn.functional.scaled_dot_product_attention` with grouped queries folded into the
query axis: q (B, L, H, D) becomes (B, KV, L*G, D) (a view when KV == 1, which is Pi0's multi-query
case), so one SDPA call serves every head of a group without repeating K/V. Folding is exact only
when the mask does not depend on the query, which holds for every mask used here: they are key-padding
biases (B, 1, 1, S) (`key_padding_bias`). Masked keys get a large finite negative bias (not -inf), so a
query with no valid key yields a finite uniform average rather than NaN, as in the reference.

A bias is allocated with its key rows padded to a multiple of `BIAS_ALIGN` (8) and handed out as the
(B, 1, 1, S) view of the first S keys (the padded keys masked, never read). On a GPU the Gemmas'
masked attention runs torch's memory-efficient kernel, which pads any bias whose strides before the
last dim are not multiples of 8, on EVERY call (two kernels each); rows 8 apart are taken as they are,
and slicing the key dim for a shorter call keeps them so. The values are the same, so the numerics are.

`StaticKV` owns nothing: it wraps two preallocated tensors (normally the frontend's static buffers
``prefix_k`` / ``prefix_v``) and documents the contract of the Pi0 prefix cache (see its docstring).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812


def mask_value(dtype: torch.dtype) -> float:
    """The additive bias of a masked key: 70% of the dtype's most negative value (finite)."""
    return 0.7 * torch.finfo(dtype).min


BIAS_ALIGN = 8  # key rows of a bias are this many elements apart (or a multiple): no per-call pad


def aligned_keys(keys: int) -> int:
    """``keys`` rounded up to a multiple of `BIAS_ALIGN`: the row length a bias is allocated with."""
    return -(-keys // BIAS_ALIGN) * BIAS_ALIGN


def key_padding_bias(valid: torch.Tensor, dtype: torch.dtype, always_valid: int = 0) -> torch.Tensor:
    """(B, S) bool validity -> (B, 1, 1, S + always_valid) additive bias: 0 where valid and on the
    ``always_valid`` keys after them, `mask_value` elsewhere. Its rows are `aligned_keys` long (the
    keys past the end masked): a view of them, aligned for every slice of the key dim."""
    b, s = valid.shape
    keys = s + always_valid
    bias = torch.full((b, aligned_keys(keys)), mask_value(dtype), dtype=dtype, device=valid.device)
    bias[:, :s].masked_fill_(valid, 0.0)
    if always_valid:
        bias[:, s:keys].zero_()
    return bias[:, None, None, :keys]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """q (B, L, H, D); k, v (B, KV, S, D); bias (B, 1, 1, S) or None -> (B, L, H*D)."""
    b, n, h, d = q.shape
    kv = k.shape[1]
    if kv == 1:  # multi-query: every head of every token is one more query row (a view if q is dense)
        out = F.scaled_dot_product_attention(q.reshape(b, 1, n * h, d), k, v, attn_mask=bias, scale=d**-0.5)
        return out.reshape(b, n, h * d)
    g = h // kv
    qg = q.view(b, n, kv, g, d).transpose(1, 2).reshape(b, kv, n * g, d)  # (B, KV, L*G, D)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=d**-0.5)
    return out.reshape(b, kv, n, g, d).transpose(1, 2).reshape(b, n, h * d)


class StaticKV:
    """Per-layer keys and values at fixed addresses: ``k``, ``v`` each (N, B, KV, T, D).

    Pi0 layout along T: ``[prefix (P) | cached expert tokens (pi0's state token) | per-step tokens]``.

    * Owner: whoever allocated the tensors (the frontend's `Buffers`, names ``prefix_k``/``prefix_v``);
      this object is a thin view and never reallocates, so captured graphs stay valid.
    * Lifetime: slots [0, P + cached) are written once per observation (prefill) and stay valid until
      the next prefill into the same buffers; the per-step slots are rewritten by every denoise step.
    * Reuse hazard: the buffers fix B and T. Another batch size, camera count or prompt bucket needs
      its own buffers; writing a longer prefix would overrun the expert slots (checked in `write`
      only for shapes, never for values, to stay sync-free).
    """

    slot_views = True  # `slots` gives writable views (a writer may rotate keys straight into them)

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.shape != v.shape or k.dim() != 5:
            raise ValueError(f"StaticKV needs k, v of one shape (N, B, KV, T, D), got {tuple(k.shape)} "
                             f"and {tuple(v.shape)}")
        self.k, self.v = k, v

    @property
    def length(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (B, L, KV, D) at token slots [start, start + L) of ``layer``."""
        end = start + k.shape[1]
        if end > self.length:
            raise ValueError(f"StaticKV.write: slots [{start}, {end}) exceed the buffer length {self.length}")
        self.k[layer, :, :, start:end].copy_(k.transpose(1, 2))
        self.v[layer, :, :, start:end].copy_(v.transpose(1, 2))

    def slots(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable (B, L, KV, D) views of slots [start, end) of ``layer`` (k, v), for ``out=`` writers."""
        if not self.slot_views:
            raise TypeError(f"{type(self).__name__} has no slot views; store with write()")
        if end > self.length:
            raise ValueError(f"StaticKV.slots: [{start}, {end}) exceed the buffer length {self.length}")
        return self.k[layer, :, :, start:end].transpose(1, 2), self.v[layer, :, :, start:end].transpose(1, 2)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of slots [0, end) of ``layer``: (B, KV, end, D) each."""
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class RowKV(StaticKV):
    """One row of a static K/V (N, B, KV, T, D), chosen by a device tensor ``row`` (1,) int64: the
    prefill of one request into its slot of a slot-batched cache (`flashrt.runtime.slots`), while the
    other rows keep their keys. ``write`` stores (1, L, KV, D) into that row; ``read`` returns that
    row's slots [0, end) as (1, KV, end, D) copies. Owns nothing; the row is read at each call. No
    slot views (the row is a device value): writers go through `write`."""

    slot_views = False

    def __init__(self, k: torch.Tensor, v: torch.Tensor, row: torch.Tensor) -> None:
        super().__init__(k, v)
        self.row = row
        self._written: tuple[int, int, torch.Tensor, torch.Tensor] | None = None

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[1]
        if end > self.length:
            raise ValueError(f"RowKV.write: slots [{start}, {end}) exceed the buffer length {self.length}")
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        self.k[layer, :, :, start:end].index_copy_(0, self.row, kt)
        self.v[layer, :, :, start:end].index_copy_(0, self.row, vt)
        self._written = (layer, end, kt, vt) if start == 0 else None

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's slots [0, end): what the last write of this layer stored, when it covered exactly
        that (a prefill from slot 0: the same values, no gather), else gathered from the cache."""
        if self._written is not None and self._written[:2] == (layer, end):
            return self._written[2], self._written[3]
        return (self.k[layer, :, :, :end].index_select(0, self.row),
                self.v[layer, :, :, :end].index_select(0, self.row))
