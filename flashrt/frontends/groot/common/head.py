"""GR00T's flow-matching action head, shared by every version (N1.5, N1.6, N1.7): the VL self-attention,
the AlternateVLDiT / DiT blocks and the per-embodiment category MLPs, plus the one `flashrt.ops.select`
pass of a GR00T model (`select_ops`) and the additive key bias every version's attention shares
(`key_bias`). The N1.7 model around it and the head's arrangement are described in
`flashrt.frontends.groot.n17.model`.
"""


from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from flashrt import ops
from flashrt.frontends.groot.common.config import HeadConfig
from flashrt.nn.attention import aligned_keys
from flashrt.nn.dit import DiTBlock, timestep_sinusoid

# GR00T's towers keep the reference forms of the "mlp" ops: their parity with lerobot is pinned on them
# (oneDNN's fused forms are not measured on these towers)
OP_PREFER = {"mlp": "aten"}


def select_ops(model: nn.Module, device: torch.device | str | None = None) -> ops.Choices:
    """The one `flashrt.ops.select` pass of a GR00T model for ``device`` (default: its weights')."""
    weight = next(model.parameters())
    return ops.select(model, weight.device if device is None else device, weight.dtype, OP_PREFER)


class CategoryLinear(nn.Module):
    """Per-embodiment linear: W (E, in, out), b (E, out)."""

    def __init__(self, num: int, din: int, dout: int) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.empty(num, din, dout))
        self.b = nn.Parameter(torch.empty(num, dout))

    def apply(self, x: torch.Tensor, e: int) -> torch.Tensor:  # noqa: A003 (not nn.Module.apply's role)
        return torch.addmm(self.b[e], x.reshape(-1, x.shape[-1]), self.W[e]).view(*x.shape[:-1], -1)


class CategoryMLP(nn.Module):
    def __init__(self, num: int, din: int, hidden: int, dout: int) -> None:
        super().__init__()
        self.layer1, self.layer2 = CategoryLinear(num, din, hidden), CategoryLinear(num, hidden, dout)

    def run(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return self.layer2.apply(F.relu(self.layer1.apply(x, e)), e)


class ActionHead(nn.Module):
    """vlln + VL self-attention + state/action encoders + AlternateVLDiT + action decoder."""

    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.config = c
        e = c.num_embodiments
        self.vlln = nn.LayerNorm(c.backbone_dim, eps=1e-5)
        self.vl_blocks = nn.ModuleList(
            DiTBlock(c.backbone_dim, c.vl_heads, c.vl_head_dim, None, ada=False, affine_norm3=True)
            for _ in range(c.vl_layers)
        )
        self.state_encoder = CategoryMLP(e, c.max_state_dim, c.hidden, c.inner)
        self.action_w1 = CategoryLinear(e, c.max_action_dim, c.inner)
        self.action_w2 = CategoryLinear(e, 2 * c.inner, c.inner)
        self.action_w3 = CategoryLinear(e, c.inner, c.inner)
        self.action_decoder = CategoryMLP(e, c.hidden, c.hidden, c.max_action_dim)
        self.position_embedding = nn.Embedding(c.max_seq_len, c.inner)
        if c.future_tokens:
            self.future_tokens = nn.Embedding(c.future_tokens, c.inner)
        self.time_1, self.time_2 = nn.Linear(256, c.inner), nn.Linear(c.inner, c.inner)
        self.blocks = nn.ModuleList(
            DiTBlock(
                c.inner,
                c.dit_heads,
                c.dit_head_dim,
                None if i % 2 else c.backbone_dim,
                ada=True,
                affine_norm3=False,
            )
            for i in range(c.dit_layers)
        )
        self.proj_out_1, self.proj_out_2 = nn.Linear(c.inner, 2 * c.inner), nn.Linear(c.inner, c.hidden)

    def step_tables(self, num_steps: int) -> dict[str, torch.Tensor]:
        """Everything that depends only on the step index: (N, ...) tensors, float32."""
        c = self.config
        t = torch.tensor(
            [int(s / float(num_steps) * c.timestep_buckets) for s in range(num_steps)],
            device=self.time_1.weight.device,
        )
        temb = self.time_2(F.silu(self.time_1(timestep_sinusoid(t).to(self.time_1.weight.dtype))))
        shift, scale = self.proj_out_1(F.silu(temb)).chunk(2, dim=-1)
        half = c.inner // 2
        exponent = -torch.arange(half, dtype=torch.float, device=t.device) * (
            torch.log(torch.tensor(10000.0)) / half
        )
        freqs = t.float()[:, None] * exponent.exp()
        return {
            "mods": torch.stack([b.norm1_mod(temb) for b in self.blocks], dim=1),  # (N, blocks, 2, E)
            "out_mod": torch.stack([1.0 + scale, shift], dim=1),  # (N, 2, E)
            "action_time": torch.cat([freqs.sin(), freqs.cos()], -1),
        }  # (N, E)

    def encode_actions(self, a: torch.Tensor, time: torch.Tensor, e: int) -> torch.Tensor:
        """a (B, T, A), time (E,) -> (B, T, E) with position embeddings."""
        x = self.action_w1.apply(a, e)
        x = torch.cat([x, time.to(x.dtype).expand_as(x)], dim=-1)
        x = F.silu(self.action_w2.apply(x, e))
        return self.action_w3.apply(x, e) + self.position_embedding.weight[: a.shape[1]]

    def sample(
        self,
        features: torch.Tensor,
        token_mask: torch.Tensor,
        image_keys: torch.Tensor | None,
        state: torch.Tensor,
        noise: torch.Tensor,
        out: torch.Tensor,
        steps: dict[str, torch.Tensor],
        e: int,
    ) -> None:
        """features (1, L, K) backbone output; token_mask (1, L); image_keys (1, 1, 1, L) or None (plain
        DiT); state (1, 1, S); noise / out (1, T, A). Writes the normalized chunk into ``out``."""
        c, dtype = self.config, self.time_1.weight.dtype
        valid = token_mask[:, None, None, :]  # (1, 1, 1, L)
        vl = self.vlln.forward(features)
        vl_bias = key_bias(valid, vl.dtype)
        for block in self.vl_blocks:
            vl = block.forward(vl, mask=vl_bias)
        if c.alternate:  # cross block i: text keys when i % (2 * text_every) == 0, else image keys
            text, image = key_bias(valid & ~image_keys, dtype), key_bias(valid & image_keys, dtype)
            masks = [text if i % (2 * c.text_every) == 0 else image for i in range(c.dit_layers)]
        else:
            masks = [key_bias(valid, dtype)] * c.dit_layers
        kvs = {i: b.cross_kv(vl) for i, b in enumerate(self.blocks) if b.is_cross}
        prefix = [self.state_encoder.run(state.to(dtype), e)]  # (1, 1, E)
        if c.future_tokens:
            prefix.append(self.future_tokens.weight[None])
        out.copy_(noise)
        for s in range(c.num_steps):
            x = torch.cat([*prefix, self.encode_actions(out.to(dtype), steps["action_time"][s], e)], 1)
            for i, block in enumerate(self.blocks):
                x = block.forward(x, steps["mods"][s, i], kvs.get(i), masks[i] if block.is_cross else None)
            mod = steps["out_mod"][s]
            x = torch.addcmul(mod[1], F.layer_norm(x, x.shape[-1:], eps=1e-6), mod[0])
            pred = self.action_decoder.run(F.linear(x, self.proj_out_2.weight, self.proj_out_2.bias), e)
            out.add_(pred[:, -c.horizon :].to(out.dtype), alpha=1.0 / c.num_steps)


def key_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool key mask (..., S) as the additive bias scaled_dot_product_attention turns it into (0 where
    True, -inf elsewhere, in the query's dtype): built once per step and shared by every block it masks,
    instead of converted again inside each attention call (two kernels each on a GPU). Its rows are
    allocated `aligned_keys` long (the padding masked, never read), so the memory-efficient kernel
    takes it without a per-call pad whatever S is (`flashrt.nn.attention`)."""
    keys = mask.shape[-1]
    bias = torch.full((*mask.shape[:-1], aligned_keys(keys)), float("-inf"), dtype=dtype, device=mask.device)
    return bias[..., :keys].masked_fill_(mask, 0.0)
