"""Pi0-FAST network (`Pi0FastNet`) and its AR decode model (`Pi0FastDecodeModel`) over a static K/V cache.

Shapes: B batch (1), C cameras, R image side, I = C * Nt image tokens, L prompt bucket (prompt ids +
the trailing bos), S text slots (largest bucket + max_decoding_steps), T = I + S cache slots, W width,
V vocabulary, N depth, KV kv heads, D head_dim.

`Pi0FastDecodeModel` answers `flashrt.runtime.decode.DecodeModel`: the decode runner
(`flashrt.runtime.decode.Decoder`) owns the prompt, length, token, position and logits buffers
(`DecodeIO`), appends the greedy pick and captures

    prefill(L, io)   images (`vision_images`, `vision_masks`) + prompt ids io.prompt[:, :L] (valid up to
                     io.length) -> K/V slots [0, I + L); io.logits = logits of the last valid id (bos)
    decode(io)       the token io.token at text slot io.position -> its K/V at cache slot I + position;
                     io.logits of the next token

Cache layout (owner: this model's `Buffers`, ``prefix_k``/``prefix_v`` (N, B, KV, T, D) plus
``prefix_image_bias`` (B, I) and ``prefix_image_count`` (B, 1) written by each prefill; lifetime: one
request, the next prefill overwrites them; reuse hazard: one request at a time, which the runner
enforces): slots [0, I) hold the image tokens, slots I + j the j-th text slot. Text slots past the
current position hold stale keys that the bias masks until the position reaches (and overwrites) them.

Numerics follow lerobot 0.6.1 ``PI0FastPytorch.sample_actions_fast_kv_cache``, re-arranged exactly:

* the prefix [images, prompt, bos] is bidirectional among its valid tokens (key-padding bias only; a
  padded query row's output is never read), positions are ``cumsum(valid) - 1``;
* lerobot pads the prompt to ``tokenizer_max_length`` and appends bos after the padding; here the
  prompt is unpadded, bos follows its last id and the bucket's padding comes after: the same
  positions, the same attended keys, so the same logits;
* token embeddings are scaled by ``sqrt(W)`` (transformers' ``GemmaTextScaledWordEmbedding``), image
  features are not; they go through ``/ 2048**0.5 * 2048**0.5`` as lerobot computes them;
* the lm_head is its own matrix when the checkpoint stores one (lerobot's tiny builds), else the tied
  embedding.

"Exactly" up to float32 rounding: the decode step (the Gemma's token form, `flashrt.nn.gemma.TokenLayer`)
is written for the CPU's per-op dispatch (one fused RMSNorm, attention of the single query row as
``baddbmm`` + ``bmm``, ATen GeGLU, plain-tensor weights), so sums run in another order than lerobot's;
the parity tests hold greedy ids identical over whole decodes and actions equal (measured 0.0 after
detokenization).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from flashrt import ops
from flashrt.frontends.pi0_fast.config import IMAGE_FEATURE_NORM, Pi0FastConfig
from flashrt.nn.attention import StaticKV, key_padding_bias, mask_value
from flashrt.nn.gemma import DECODE_TOKENS, Gemma, TokenLayer
from flashrt.nn.rope import rope_cos_sin, rope_inv_freq
from flashrt.nn.siglip import Siglip
from flashrt.ops.decoder import decoder_prefer
from flashrt.runtime.buffers import Buffers, BufferSpec

__all__ = ["Pi0FastNet", "Pi0FastDecodeModel"]


class Pi0FastNet(nn.Module):
    """SigLIP + projector + Gemma (with embedding) + lm_head. Load with `weights.load_pi0_fast`.

    ``kernels`` (`flashrt.ops.decoder.decoder_prefer`): the form of the "decoder" ops, prefill and decode
    step alike; "auto" the fused csrc kernels on a CUDA device where they load, the references
    elsewhere. Chosen by the one `flashrt.ops.select` pass of `reset_derived` (``op_choices``)."""

    def __init__(self, config: Pi0FastConfig, kernels: str = "auto") -> None:
        super().__init__()
        c = self.config = config
        self.op_prefer = decoder_prefer(kernels)
        self.op_choices: ops.Choices = {}
        self.decode_tokens = ops.OpSlot(DECODE_TOKENS)  # the decode step (the Gemma's token form)
        v, g = c.vision, c.vlm
        self.vision = Siglip(v.width, v.depth, v.mlp_dim, v.num_heads, v.patch, v.image_size, v.eps)
        self.projector = nn.Linear(v.width, g.width)
        self.vlm = Gemma(g.width, g.depth, g.mlp_dim, g.num_heads, g.num_kv_heads, g.head_dim,
                         vocab_size=g.vocab_size, eps=g.eps)
        self.lm_head = nn.Linear(g.width, g.vocab_size, bias=False)

    def reset_derived(self) -> None:
        """The decode step's plain-tensor view of the weights (`TokenLayer`s: no nn.Module attribute
        lookups per token) and the forms of the ops (the one `flashrt.ops.select` pass with ``op_prefer``,
        ``op_choices``: the "decoder" ops' fused forms on a CUDA device where csrc loads; on the CPU
        oneDNN's fused GEMM + GELU forms for the vision tower and the VLM, as Pi0's). Runs at load; call
        again after replacing weights."""
        self.decode_layers = tuple(TokenLayer.of(layer) for layer in self.vlm.layers)
        self.decode_final = (1.0 + self.vlm.norm.weight.float(), self.vlm.norm.eps)
        self.select_ops()

    def select_ops(self, device: torch.device | str | None = None) -> ops.Choices:
        """The one `flashrt.ops.select` pass for ``device`` (default: the weights') -> ``op_choices``."""
        device = self.projector.weight.device if device is None else device
        self.op_choices = ops.select(self, device, self.dtype, self.op_prefer)
        return self.op_choices

    @property
    def dtype(self) -> torch.dtype:
        return self.vlm.layers[0].qkv.weight.dtype

    def image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, 3, R, R) in [-1, 1] -> (B, C * Nt, W) in the model dtype."""
        b, n_cams = images.shape[:2]
        feats = self.projector(self.vision(images.flatten(0, 1)))
        feats = feats / IMAGE_FEATURE_NORM * IMAGE_FEATURE_NORM
        return feats.unflatten(0, (b, n_cams)).flatten(1, 2).to(self.dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, L) int64 -> (B, L, W) ``embedding * sqrt(W)`` (transformers' scaled Gemma embedding)."""
        return _as(self.vlm.embed(tokens) * self.vlm.embed_scale, self.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., W) final-normed -> (..., V) float32."""
        return _as(F.linear(h, self.lm_head.weight), torch.float32)

    def decode_hidden(self, x: torch.Tensor, rope: tuple, caches: list, slot: torch.Tensor,
                      bias: torch.Tensor) -> torch.Tensor:
        """One token x (1, 1, W) at cache slot ``slot`` (1,) int64 -> final-normed (1, 1, W); ``caches``
        per layer: (keys (KV, T, D), values (KV, T, D), keys transposed (KV, D, T)), views of batch row 0
        of the static K/V (`Pi0FastDecodeModel.layer_caches`); ``bias`` (1, 1, T). The Gemma's token form
        (`flashrt.nn.gemma.DECODE_TOKENS`) in the form `reset_derived` chose."""
        return self.decode_tokens.run(self.decode_layers, self.decode_final, x, rope, caches, slot, bias)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without the dispatch when it already is (the decode step counts its ops)."""
    return x if x.dtype == dtype else x.to(dtype)


class Pi0FastDecodeModel:
    """A loaded `Pi0FastNet` with its static buffers, answering the AR decode protocol (module docstring).

    ``text_slots`` S = the largest prompt bucket + max_decoding_steps; the runner's ``cache_len`` is S
    (it counts prompt and generated tokens; the image slots are this model's own)."""

    def __init__(self, net: Pi0FastNet, n_cams: int, text_slots: int, device: torch.device) -> None:
        c = net.config
        self.net, self.device, self.batch = net, torch.device(device), 1
        self.n_cams, self.vocab_size, self.cache_len = int(n_cams), c.vlm.vocab_size, int(text_slots)
        self.image_slots = self.n_cams * c.vision.num_tokens
        r, g = c.vision.image_size, c.vlm
        kv_shape = (g.depth, 1, g.num_kv_heads, self.image_slots + self.cache_len, g.head_dim)
        self.buffers = Buffers([
            BufferSpec("vision_images", (1, self.n_cams, 3, r, r), torch.float32, low=-1.0, high=1.0,
                       doc="camera images, pixels in [-1, 1]; a missing camera is -1"),
            BufferSpec("vision_masks", (1, self.n_cams), torch.bool, doc="False for a missing camera"),
            BufferSpec("prefix_k", kv_shape, net.dtype, "state", doc="keys per layer: images, then text"),
            BufferSpec("prefix_v", kv_shape, net.dtype, "state", doc="values per layer"),
            BufferSpec("prefix_image_bias", (1, self.image_slots), net.dtype, "state",
                       doc="additive key bias of the image slots (0 valid, mask_value missing camera)"),
            BufferSpec("prefix_image_count", (1, 1), torch.int64, "state",
                       doc="valid image tokens: the RoPE position of text slot 0"),
        ], self.device)
        self.kv = StaticKV(self.buffers["prefix_k"], self.buffers["prefix_v"])
        self.buffers["vision_masks"].fill_(True)
        # load-time constants of the decode step: RoPE rows of every position (the same float32 math as
        # `rope_cos_sin` per position, gathered by index), the text slot indices, the bias values
        self.inv_freq = rope_inv_freq(g.head_dim, g.rope_theta, self.device)  # the prefill's, once
        every = torch.arange(self.image_slots + self.cache_len, device=self.device)[None]
        self.rope_table = tuple(t[0, :, 0] for t in rope_cos_sin(every, g.head_dim, g.rope_theta, net.dtype))
        # per layer: views of batch row 0 of the K/V buffers (same storage, fixed at load)
        self.layer_caches = [(self.kv.k[i, 0], self.kv.v[i, 0], self.kv.k[i, 0].transpose(1, 2))
                             for i in range(g.depth)]
        self.text_slots = torch.arange(self.cache_len, device=self.device)
        self.image_count = self.buffers["prefix_image_count"]
        self.image_bias = self.buffers["prefix_image_bias"]
        self.embed_weight, self.embed_scale = net.vlm.embed.weight, net.vlm.embed_scale
        self.head_weight, self.dtype = net.lm_head.weight, net.dtype
        self.bias_values = (torch.zeros((), dtype=net.dtype, device=self.device),
                            torch.full((), mask_value(net.dtype), dtype=net.dtype, device=self.device))

    # ---------------------------------------------------------------------------- graph bodies
    def prefill(self, bucket: int, io: Any) -> None:
        """Graph body of a prompt bucket (module docstring)."""
        net, bufs = self.net, self.buffers
        img = net.image_tokens(bufs["vision_images"])
        n_tok = img.shape[1] // self.n_cams
        img_valid = bufs["vision_masks"][:, :, None].expand(1, self.n_cams, n_tok).reshape(1, -1)
        text_valid = (torch.arange(bucket, device=self.device) < io.length)[None]
        valid = torch.cat([img_valid, text_valid], dim=1)  # (B, I + L)
        positions = torch.cumsum(valid, dim=1) - 1
        g = net.config.vlm
        rope = rope_cos_sin(positions, g.head_dim, g.rope_theta, net.dtype, self.inv_freq)
        bias = key_padding_bias(valid, net.dtype)
        h = net.vlm(torch.cat([img, net.embed(io.prompt[:, :bucket])], dim=1), rope, self.kv, 0, bias)
        last = h.index_select(1, self.image_slots + io.length - 1)  # (B, 1, W): the bos row
        io.logits.copy_(net.logits(last)[:, 0])
        bufs["prefix_image_bias"].copy_(bias[:, 0, 0, : self.image_slots])
        bufs["prefix_image_count"].copy_(img_valid.sum(dim=1, keepdim=True))

    def decode(self, io: Any) -> None:
        """Graph body of one decode step (module docstring). Reads only plain attributes (no module or
        buffer-table lookups): on the CPU the step is dispatch-bound."""
        position, net = io.position, self.net
        rope_position = (self.image_count + position).view(1)  # RoPE position of io.token
        rope = tuple(t.index_select(0, rope_position) for t in self.rope_table)  # (1, D) each
        text_bias = torch.where(self.text_slots <= position, *self.bias_values)[None]
        bias = torch.cat([self.image_bias, text_bias], dim=1)[None]  # (1, 1, T)
        x = _as(F.embedding(io.token, self.embed_weight) * self.embed_scale, self.dtype)
        h = net.decode_hidden(x, rope, self.layer_caches, self.image_slots + position, bias)
        io.logits.copy_(_as(F.linear(h, self.head_weight), torch.float32)[:, 0])

    def describe(self) -> dict[str, Any]:
        c = self.net.config
        return {"family": "pi0_fast", "width": c.vlm.width, "depth": c.vlm.depth, "vocab": c.vlm.vocab_size,
                "vision": {"width": c.vision.width, "depth": c.vision.depth, "image": c.vision.image_size},
                "cameras": self.n_cams, "image_slots": self.image_slots, "text_slots": self.cache_len,
                "dtype": str(self.net.dtype).removeprefix("torch."), "kernels": self.net.vlm.rms_norm.form,
                "ops": ops.choices(self.net),
                "cache_bytes": self.buffers.nbytes()}
