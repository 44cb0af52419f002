"""`CausalLM`: a loaded Llama / Qwen decoder with its static K/V cache, answering the AR decode protocol.

    lm = load_lm("path/to/transformers_dir", device="cpu", precision="fp32", cache_len=1024)

The AR decode runner (`flashrt.runtime.decode.Decoder`) owns the call pattern, the sampler and its own
step buffers (prompt, length, token, position, logits: a `flashrt.runtime.decode.DecodeIO`); this
frontend owns the module, the cache and the two graph bodies the runner captures:

    lm.prefill(bucket, io)   prompt tokens io.prompt[:, :bucket] (valid up to io.length) -> K/V slots
                             [0, bucket) filled, io.logits (B, V) = logits of the last valid position
    lm.decode(io)            the token io.token (B, 1) at slot io.position (1,) -> K/V of that slot,
                             io.logits of the next token

Both read sizes only from Python ints fixed at capture; positions and lengths are device tensors.

Slot-batched decode (`flashrt.runtime.slots.SlotDecoder`, ``batch`` = the number of slots): each cache
row is one request at its own position.

    lm.prefill_row(bucket, io)   the prompt io.prompt (1, bucket) into row io.row (1,) only (the
                                 other rows keep their keys), io.join_logits (1, V)
    lm.decode_rows(rows, io)     rows [0, rows): token io.token[:rows] at slot io.position[:rows] of
                                 each row -> io.logits[:rows]
    lm.move_row(src, dst)        copy row src's keys/values into row dst (between replays, when the
                                 runner packs its live rows to the front)

Buffers (state, allocated once): ``lm_k``, ``lm_v`` (N, B, KV, T, D) in the compute dtype, T =
``cache_len``. Owner: this frontend. Lifetime: slots [0, length) are written by a prefill and stay
valid for the decode steps of that request; the next prefill overwrites them. Reuse hazard: one
request at a time (the runner serializes); slots past the current position hold stale keys that the
decode bias masks until the position reaches (and overwrites) them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from flashrt import ops
from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.lm.config import LMConfig
from flashrt.frontends.lm.weights import weight_map
from flashrt.io import load_module, open_checkpoint
from flashrt.nn.attention import RowKV, StaticKV
from flashrt.nn.llama import Llama, RowPositions, causal_bias, decode_bias, gather_rope, rope_table
from flashrt.ops.decoder import decoder_prefer
from flashrt.quant.precision import compute_dtype
from flashrt.runtime.buffers import Buffers, BufferSpec

__all__ = ["CausalLM", "load_lm", "read_config"]


class CausalLM:
    """One loaded causal LM (module docstring). Built by `load_lm`; the constructor allocates the cache."""

    def __init__(self, cfg: LMConfig, module: Llama, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, cache_len: int = 1024, batch: int = 1,
                 kernels: str = "auto") -> None:
        if not 0 < cache_len <= cfg.max_positions:
            raise ConfigError(f"lm: cache_len {cache_len} must lie in 1..{cfg.max_positions} "
                              "(the checkpoint's max_position_embeddings)")
        self.cfg, self.module = cfg, module
        self.device, self.dtype = torch.device(device), dtype
        # the one pass of `flashrt.ops`: the "decoder" ops' form (`flashrt.ops.decoder.decoder_prefer`)
        self.op_choices = ops.select(module, self.device, dtype, decoder_prefer(kernels))
        self.cache_len, self.batch, self.vocab_size = int(cache_len), int(batch), cfg.vocab_size
        shape = (cfg.depth, self.batch, cfg.kv_heads, self.cache_len, cfg.head_dim)
        self.buffers = Buffers([BufferSpec("lm_k", shape, dtype, "state", doc="keys per layer, RoPE'd"),
                                BufferSpec("lm_v", shape, dtype, "state", doc="values per layer")],
                               self.device)
        self.kv = StaticKV(self.buffers["lm_k"], self.buffers["lm_v"])
        self.rope = rope_table(cfg.head_dim, cfg.rope_theta, self.cache_len, cfg.rope, self.device)

    def prefill(self, bucket: int, io: Any) -> None:
        """Graph body of a prompt bucket (module docstring)."""
        tokens = io.prompt[:, :bucket]
        positions = torch.arange(bucket, device=self.device)[None].expand(self.batch, bucket)
        rope = gather_rope(self.rope, positions, self.dtype)
        h = self.module.hidden(tokens, rope, self.kv, 0, causal_bias(bucket, self.dtype, self.device))
        last = h.index_select(1, io.length - 1)  # (B, 1, W): the last valid prompt position
        io.logits.copy_(self.module.logits(last)[:, 0])

    def decode(self, io: Any) -> None:
        """Graph body of one decode step (module docstring)."""
        rope = gather_rope(self.rope, io.position[None].expand(self.batch, 1), self.dtype)
        bias = decode_bias(io.position, self.cache_len, self.dtype)
        h = self.module.hidden(io.token, rope, self.kv, io.position, bias)
        io.logits.copy_(self.module.logits(h)[:, 0])

    def prefill_row(self, bucket: int, io: Any) -> None:
        """Graph body: one request's prompt bucket into cache row ``io.row`` (module docstring)."""
        tokens = io.prompt[:, :bucket]
        rope = gather_rope(self.rope, torch.arange(bucket, device=self.device)[None], self.dtype)
        kv = RowKV(self.buffers["lm_k"], self.buffers["lm_v"], io.row)
        h = self.module.hidden(tokens, rope, kv, 0, causal_bias(bucket, self.dtype, self.device))
        io.join_logits.copy_(self.module.logits(h.index_select(1, io.length - 1))[:, 0])

    def decode_rows(self, rows: int, io: Any, keys: int | None = None) -> None:
        """Graph body: one decode step of rows [0, rows), each at its own position (module docstring),
        attending to the first ``keys`` cache slots only (None: all; every position must be below it):
        the slots past every row's position are masked, so fewer keys give the same values bit for
        bit at a fraction of the attention's cost."""
        keys = self.cache_len if keys is None else int(keys)
        position = io.position[:rows]
        rope = gather_rope(self.rope, position[:, None], self.dtype)
        kv = StaticKV(self.buffers["lm_k"][:, :rows, :, :keys], self.buffers["lm_v"][:, :rows, :, :keys])
        h = self.module.hidden(io.token[:rows], rope, kv, RowPositions(position), None)
        io.logits[:rows].copy_(self.module.logits(h)[:, 0])

    def move_row(self, src: int, dst: int) -> None:
        """Copy cache row ``src`` into row ``dst`` (host-side, between replays)."""
        for name in ("lm_k", "lm_v"):
            self.buffers[name][:, dst].copy_(self.buffers[name][:, src])

    def describe(self) -> dict[str, Any]:
        c = self.cfg
        return {"family": c.model_type, "width": c.width, "depth": c.depth, "heads": (c.heads, c.kv_heads),
                "vocab": c.vocab_size, "tied_head": c.tied, "rope": c.rope.rope_type,
                "dtype": str(self.dtype), "kernels": self.module.rms_norm.form,
                "ops": ops.choices(self.module),
                "cache_len": self.cache_len, "cache_bytes": self.buffers.nbytes()}

    def flops_per_token(self) -> int:
        """Matmul FLOPs of one decode token (2 x parameters touched, attention over a full cache)."""
        c = self.cfg
        per_layer = c.width * (c.heads + 2 * c.kv_heads) * c.head_dim + c.heads * c.head_dim * c.width
        per_layer += 3 * c.width * c.mlp + 2 * c.heads * c.head_dim * self.cache_len
        return 2 * (c.depth * per_layer + c.width * c.vocab_size)


def read_config(folder: str | Path) -> LMConfig:
    """The `LMConfig` of a transformers folder's config.json (CheckpointError naming the file)."""
    path = Path(folder) / "config.json"
    if not os.path.lexists(path):  # there but not a regular file: read_json says what it is
        raise CheckpointError(f"{folder}: no config.json (expected a transformers save_pretrained folder)")
    from flashrt.io.files import read_json

    return LMConfig.from_dict(read_json(path, "LM config"), where=str(path))


def load_lm(folder: str | Path, device: str | torch.device = "cpu", precision: str | torch.dtype = "fp32",
            cache_len: int = 1024, batch: int = 1, config: LMConfig | None = None,
            kernels: str = "auto") -> CausalLM:
    """Build on meta, map the safetensors strictly, allocate the cache (no capture: the runner does).

    ``kernels``: the form of the "decoder" ops (`flashrt.ops.decoder.decoder_prefer`) the norms, RoPE and
    SwiGLU run; "auto" (default) is "fused" on a CUDA device where the csrc library loads, else "aten":
    the one `flashrt.ops.select` pass at load (``describe()["ops"]``)."""
    cfg = config or read_config(folder)
    dtype = compute_dtype(precision)
    ckpt = open_checkpoint(folder)
    module = load_module(lambda: Llama(cfg.layer, cfg.depth, cfg.vocab_size, cfg.tied), ckpt,
                         weight_map(cfg), device=device, dtype=dtype)
    return CausalLM(cfg, module, device=device, dtype=dtype, cache_len=min(cache_len, cfg.max_positions),
                    batch=batch, kernels=kernels)
