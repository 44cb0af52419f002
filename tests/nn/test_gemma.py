"""Gemma stack over static K/V: incremental prefix/suffix passes equal one joint pass of a naive decoder."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from flashrt.io.loading import reset_derived
from flashrt.nn.attention import StaticKV, key_padding_bias
from flashrt.nn.gemma import GEGLU, Gemma, onednn_available
from flashrt.nn.rope import rope_cos_sin

W, DEPTH, MLP, H, KV, D = 24, 2, 40, 4, 1, 8


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    reset_derived(module, "cpu")  # every submodule's derived tables (the norms' 1 + w)
    return module


def _rope(x, pos):
    x1, x2 = x.chunk(2, -1)
    f = 1.0 / (10_000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = pos.double()[..., None, None] * f  # (B, L, 1, D/2)
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)


def _naive_norm(norm, x, cond):
    x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    if cond is None:
        return x * (1 + norm.weight.double()), None
    scale, shift, gate = (cond.double() @ norm.dense.weight.double().T + norm.dense.bias.double()).chunk(3)
    return x * (1 + scale) + shift, gate


def _naive_stack(model, x, pos, allowed, cond=None):
    """float64 decoder, unfused weights, explicit (B, L, L) allowed-attention matrix, adaRMS from cond."""
    x = x.double()
    for layer in model.layers:
        h, gate = _naive_norm(layer.input_norm, x, cond)
        q, k, v = (h @ layer.qkv.weight.double().T).split((H * D, KV * D, KV * D), -1)
        q = _rope(q.unflatten(-1, (H, D)), pos)
        k = _rope(k.unflatten(-1, (KV, D)), pos).repeat_interleave(H // KV, -2)
        v = v.unflatten(-1, (KV, D)).repeat_interleave(H // KV, -2)
        s = torch.einsum("blhd,bshd->bhls", q, k) / D**0.5
        s = s.masked_fill(~allowed[:, None], float("-inf"))
        a = torch.einsum("bhls,bshd->blhd", s.softmax(-1), v).flatten(2)
        y = a @ layer.o.weight.double().T
        x = x + (y if gate is None else y * gate)
        h, gate = _naive_norm(layer.post_norm, x, cond)
        g_, u_ = (h @ layer.gate_up.weight.double().T).chunk(2, -1)
        y = (F.gelu(g_, approximate="tanh") * u_) @ layer.down.weight.double().T
        x = x + (y if gate is None else y * gate)
    return _naive_norm(model.norm, x, cond)[0]


def _prefix_suffix_case(seed=0):
    torch.manual_seed(seed)
    b, p, s = 2, 7, 3
    valid = torch.ones(b, p, dtype=torch.bool)
    valid[1, 2] = valid[1, 5:] = False
    return b, p, s, valid, torch.randn(b, p, W), torch.randn(b, s, W)


def _allowed(valid, s):
    """Prefix queries: valid prefix keys; suffix queries: valid prefix + every suffix key."""
    b, p = valid.shape
    keys = torch.cat([valid, torch.ones(b, s, dtype=torch.bool)], 1)
    allowed = keys[:, None, :].expand(b, p + s, p + s).clone()
    allowed[:, :p, p:] = False
    return allowed


@pytest.mark.parametrize("adaptive", [False, True])
def test_incremental_passes_equal_joint_naive_pass(adaptive):
    model = _randomize(Gemma(W, DEPTH, MLP, H, KV, D, cond_dim=W if adaptive else None), seed=1)
    b, p, s, valid, x_p, x_s = _prefix_suffix_case()
    cond = torch.randn(W) if adaptive else None
    mods = model.modulation(cond) if adaptive else None
    kv = StaticKV(torch.zeros(DEPTH, b, KV, p + s, D), torch.zeros(DEPTH, b, KV, p + s, D))
    bias = key_padding_bias(torch.cat([valid, torch.ones(b, s, dtype=torch.bool)], 1), torch.float32)
    pos_p = valid.cumsum(1) - 1
    pos_s = valid.sum(1, keepdim=True) + torch.arange(s)
    out_p = model(x_p, rope_cos_sin(pos_p, D), kv, 0, bias, mods=mods)
    out_s = model(x_s, rope_cos_sin(pos_s, D), kv, p, bias, mods=mods)

    pos = torch.cat([pos_p, pos_s], 1)
    want = _naive_stack(model, torch.cat([x_p, x_s], 1), pos, _allowed(valid, s), cond)
    assert torch.allclose(out_s.double(), want[:, p:], atol=1e-5)
    assert torch.allclose(out_p.double()[valid], want[:, :p][valid], atol=1e-5)  # padded rows: don't care


def test_kv_only_last_fills_the_same_cache():
    model = _randomize(Gemma(W, DEPTH, MLP, H, KV, D), seed=2)
    b, p, _, valid, x_p, _ = _prefix_suffix_case(seed=3)
    rope = rope_cos_sin(valid.cumsum(1) - 1, D)
    bias = key_padding_bias(valid, torch.float32)
    full = StaticKV(torch.zeros(DEPTH, b, KV, p, D), torch.zeros(DEPTH, b, KV, p, D))
    lean = StaticKV(torch.zeros(DEPTH, b, KV, p, D), torch.zeros(DEPTH, b, KV, p, D))
    assert model(x_p, rope, full, 0, bias) is not None
    assert model(x_p, rope, lean, 0, bias, kv_only_last=True) is None
    assert torch.equal(full.k, lean.k) and torch.equal(full.v, lean.v)
    assert full.k.abs().sum() > 0


def test_embedding_is_scaled_by_sqrt_width_in_weight_dtype():
    model = _randomize(Gemma(W, 1, MLP, H, KV, D, vocab_size=11), seed=4)
    ids = torch.tensor([[3, 0, 10]])
    assert torch.allclose(model.embed_tokens(ids), model.embed.weight[ids] * W**0.5)
    model = model.bfloat16()
    reset_derived(model, "cpu")
    assert model.embed_scale.dtype == torch.bfloat16
    want = model.embed.weight[ids] * torch.tensor(W**0.5).bfloat16()
    assert torch.equal(model.embed_tokens(ids), want)


def test_modulation_table_layout():
    model = _randomize(Gemma(W, DEPTH, MLP, H, KV, D, cond_dim=5), seed=5)
    cond = torch.randn(3, 5)
    mods = model.modulation(cond)
    assert mods.shape == (3, 2 * DEPTH + 1, 3, W)
    assert torch.allclose(mods[:, 3], model.layers[1].post_norm.modulation(cond))
    assert torch.allclose(mods[:, -1], model.norm.modulation(cond))


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN's fused linear op")
def test_onednn_mlp_kernel_matches_aten():
    """The fused oneDNN GeGLU (GELU in the gate GEMM, product in the up GEMM) equals the ATen one
    within float32 rounding, for the prefix's many rows and the expert's few."""
    layer = _randomize(Gemma(W, 1, MLP, H, KV, D), seed=6).layers[0]
    assert layer.geglu.form == "aten"
    for rows in (3, 40):
        h = torch.randn(2, rows, W)
        with torch.no_grad():
            want = layer.mlp(h)
            layer.geglu.use("onednn")
            got = layer.mlp(h)
            layer.geglu.use("aten")
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert GEGLU.form_names == ("aten", "onednn")
