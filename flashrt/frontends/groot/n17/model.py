"""GR00T N1.7 as one module: Qwen3-VL backbone → VL self-attention → AlternateVLDiT flow-matching head.

Shape legend: B batch (1), I images (cameras), R x Q image size, n merged tokens per image, L prompt
bucket (tokens), W text width, K backbone_embedding_dim (= W), E DiT width (input_embedding_dim),
Hd hidden_size, T action horizon, A max_action_dim, S max_state_dim, N flow-matching steps.

What the reference (lerobot 0.6.1 ``GR00TN17.get_action``) computes, and how it is arranged here:

* Backbone feature = the output of the last kept Qwen3 layer (``select_layer`` layers), taken BEFORE
  the final norm and before that layer's deepstack addition (lerobot captures it with a forward hook
  on the layer). Deepstack features are added to the image tokens after layers 0 .. len(deepstack)-1.
* The token layout (chat header, one run of image tokens per camera, then the prompt) is fixed per
  camera set and image size, so the image-token slots, the M-RoPE positions and the image / text key
  masks are constants of a `Plan` (built once per bucket at capture). Prompts are right-padded; the
  Qwen3 attention is causal, so padding never reaches a real token. The VL self-attention masks the
  padding keys (the reference runs it unmasked over an unpadded batch of one: the same values).
* The flow-matching time of step s is ``int(s / N * buckets)``: every timestep-dependent tensor (DiT
  AdaLayerNorm modulations, output modulation, the action encoder's sinusoid) is evaluated once in
  `step_tables`. Cross-attention K/V of the VL tokens are computed once per observation, and so are
  the key masks, as the additive biases attention would convert them to (`key_bias`).
* The embodiment is fixed at load: its slice of every category-specific weight is a view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashrt.frontends.groot.common.config import GrootN17Config
from flashrt.frontends.groot.common.head import ActionHead, select_ops
from flashrt.nn.qwen3vl import VisionTower, mrope_cos_sin, qwen3_layer


@dataclass
class Plan:
    """Constants of one (camera set, image size, bucket) layout; see the module docstring."""

    image_slots: torch.Tensor  # (I*n,) token indices of the image tokens
    image_keys: torch.Tensor  # (1, 1, 1, L) bool, True at image tokens
    cos: torch.Tensor  # (1, L, 1, D) M-RoPE
    sin: torch.Tensor
    vision: dict[str, torch.Tensor]
    steps: dict[str, torch.Tensor]
    embodiment: int
    frames: int = 1  # each image's tokens repeated this many times, timestep-major


class GrootN17Model(nn.Module):
    """Backbone + head; `sample_actions` is the whole captured step."""

    def __init__(self, config: GrootN17Config) -> None:
        super().__init__()
        self.config = config
        v, t = config.vision, config.text
        self.vision = VisionTower(
            v.width,
            v.depth,
            v.mlp_dim,
            v.heads,
            v.patch,
            v.temporal,
            v.merge,
            v.num_pos,
            v.out_width,
            v.deepstack,
        )
        self.embed = nn.Embedding(t.vocab, t.width)
        self.layers = nn.ModuleList(
            qwen3_layer(t.width, t.mlp_dim, t.heads, t.kv_heads, t.head_dim, t.eps) for _ in range(t.layers)
        )
        self.head = ActionHead(config.head)

    def reset_derived(self) -> None:
        """After the submodules' derived tables (`flashrt.io.reset_derived`, at load): the forms of the
        ops, in the one `flashrt.ops.select` pass (`select_ops`)."""
        self.op_choices = select_ops(self)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def tokens_per_image(self, size: tuple[int, int]) -> int:
        v = self.config.vision
        return (size[0] // v.patch) * (size[1] // v.patch) // (v.merge * v.merge)

    def plan(
        self,
        positions: torch.Tensor,
        image_slots: torch.Tensor,
        size: tuple[int, int],
        bucket: int,
        embodiment: int,
        frames: int = 1,
    ) -> Plan:
        """positions (3, >= bucket) M-RoPE ids of the layout; image_slots the image-token indices."""
        t, v, dev = self.config.text, self.config.vision, self.embed.weight.device
        cos, sin = mrope_cos_sin(positions[:, :bucket], t.head_dim, t.theta, t.mrope_section, self.dtype)
        keys = torch.zeros(1, 1, 1, bucket, dtype=torch.bool)
        keys[..., image_slots] = True
        with torch.no_grad():
            vision = self.vision.tables(size[0] // v.patch, size[1] // v.patch)
            steps = self.head.step_tables(self.config.head.num_steps)
        return Plan(
            image_slots.to(dev),
            keys.to(dev),
            cos.to(dev),
            sin.to(dev),
            vision,
            steps,
            int(embodiment),
            int(frames),
        )

    def backbone(self, pixels: torch.Tensor, tokens: torch.Tensor, plan: Plan) -> torch.Tensor:
        """pixels (I, 3, R, Q), tokens (1, L) -> pre-norm features of the last kept layer (1, L, W)."""
        merged, deep = self.vision.forward(pixels, plan.vision)

        def slots(x: torch.Tensor) -> torch.Tensor:  # (I, n, W) -> (1, frames * I * n, W), timestep-major
            return x.unsqueeze(0).expand(plan.frames, *x.shape).reshape(1, -1, x.shape[-1])

        h = self.embed.weight[tokens].index_copy_(1, plan.image_slots, slots(merged))
        last = len(self.layers) - 1
        for j, layer in enumerate(self.layers):
            h = layer.forward(h, (plan.cos, plan.sin))
            if j < last and j < len(deep):
                h.index_add_(1, plan.image_slots, slots(deep[j]))
        return h

    def sample_actions(
        self,
        pixels: torch.Tensor,
        tokens: torch.Tensor,
        token_mask: torch.Tensor,
        state: torch.Tensor,
        noise: torch.Tensor,
        out: torch.Tensor,
        plan: Plan,
    ) -> None:
        """Writes the N-step flow-matching chunk (1, T, A) (normalized actions) into ``out``."""
        features = self.backbone(pixels, tokens, plan)
        self.head.sample(
            features, token_mask, plan.image_keys, state, noise, out, plan.steps, plan.embodiment
        )
