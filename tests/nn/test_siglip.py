"""SigLIP tower vs an independent build from torch's nn.MultiheadAttention (same fused in_proj layout)."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from flashrt.nn.gemma import onednn_available
from flashrt.nn.siglip import FC1_GELU, Siglip

W, DEPTH, MLP, HEADS, PATCH, IMG = 24, 2, 48, 3, 7, 21


def _random_tower(seed=0):
    tower = Siglip(W, DEPTH, MLP, HEADS, PATCH, IMG)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            gain = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + gain)
    return tower


def _reference(tower, pixels):
    """Patchify by unfold, torch MHA per layer, post LayerNorm."""
    i = pixels.shape[0]
    patches = F.unfold(pixels, PATCH, stride=PATCH).transpose(1, 2)  # (I, N, 3*P*P)
    x = patches @ tower.patch.weight.flatten(1).T + tower.patch.bias + tower.pos
    for layer in tower.layers:
        mha = nn.MultiheadAttention(W, HEADS, batch_first=True)
        with torch.no_grad():
            mha.in_proj_weight.copy_(layer.qkv.weight)
            mha.in_proj_bias.copy_(layer.qkv.bias)
            mha.out_proj.weight.copy_(layer.o.weight)
            mha.out_proj.bias.copy_(layer.o.bias)
        h = F.layer_norm(x, (W,), layer.norm1.weight, layer.norm1.bias, 1e-6)
        x = x + mha(h, h, h, need_weights=False)[0]
        h = F.layer_norm(x, (W,), layer.norm2.weight, layer.norm2.bias, 1e-6)
        x = x + layer.fc2(F.gelu(layer.fc1(h), approximate="tanh"))
    assert x.shape == (i, (IMG // PATCH) ** 2, W)
    return F.layer_norm(x, (W,), tower.post_norm.weight, tower.post_norm.bias, 1e-6)


def test_siglip_matches_reference_build():
    tower = _random_tower()
    pixels = torch.rand(3, 3, IMG, IMG) * 2 - 1
    with torch.no_grad():
        assert torch.allclose(tower(pixels), _reference(tower, pixels), atol=1e-5)


def test_images_are_independent_and_token_order_follows_patches():
    tower = _random_tower(seed=1)
    pixels = torch.rand(2, 3, IMG, IMG) * 2 - 1
    with torch.no_grad():
        both = tower(pixels)
        assert torch.allclose(both[1:], tower(pixels[1:]), atol=1e-6)
        shifted = pixels.clone()
        shifted[0, :, :PATCH, :PATCH] = 0.5  # touch only the first patch
        changed = (tower(shifted)[0] - both[0]).abs().amax(-1)
    assert changed.argmax() == 0 and changed[0] > 1e-3


def test_bf16_tower_runs_and_accepts_float32_pixels():
    tower = _random_tower().bfloat16()
    with torch.no_grad():
        out = tower(torch.rand(1, 3, IMG, IMG))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN's fused linear op")
def test_onednn_fc1_gelu_kernel_matches_aten():
    tower = _random_tower(seed=2)
    pixels = torch.rand(2, 3, IMG, IMG) * 2 - 1
    calls = []
    fused = FC1_GELU.forms["onednn"].fn
    with torch.no_grad():
        want = tower(pixels)
        for layer in tower.layers:
            layer.fc1_gelu.use("onednn")
            layer.fc1_gelu.run = lambda x, fc1: calls.append(1) or fused(x, fc1)
        got = tower(pixels)
    assert len(calls) == DEPTH and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
