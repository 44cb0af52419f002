"""Rotary embeddings: frequencies, the rotate-half convention, relative-position property."""

import math

import torch

from flashrt.nn.rope import apply_rope, rope_cos_sin, rope_inv_freq


def test_inv_freq_values():
    f = rope_inv_freq(8, theta=10_000.0)
    want = torch.tensor([10_000.0 ** (-i / 8) for i in (0, 2, 4, 6)])
    assert torch.allclose(f, want)


def test_tables_shape_and_position_zero():
    cos, sin = rope_cos_sin(torch.tensor([[0, 1, 2]]), 16)
    assert cos.shape == sin.shape == (1, 3, 1, 16)  # full width: [c | c], [-s | s]
    assert torch.equal(cos[0, 0], torch.ones(1, 16)) and torch.equal(sin[0, 0].abs(), torch.zeros(1, 16))


def test_tables_repeat_cos_and_sign_sin():
    cos, sin = rope_cos_sin(torch.tensor([[3, 7]]), 8)
    ang = torch.tensor([3.0, 7.0])[:, None] * rope_inv_freq(8)
    assert torch.allclose(cos[0, :, 0], torch.cat([ang.cos(), ang.cos()], -1))
    assert torch.allclose(sin[0, :, 0], torch.cat([-ang.sin(), ang.sin()], -1))


def test_matches_pairwise_rotation_of_half_split_pairs():
    """Dimension i pairs with i + D/2 and rotates by angle pos * inv_freq[i]."""
    torch.manual_seed(0)
    d, pos = 8, 5
    x = torch.randn(1, 1, 1, d)
    cos, sin = rope_cos_sin(torch.tensor([[pos]]), d)
    y = apply_rope(x, cos, sin)[0, 0, 0]
    f = rope_inv_freq(d)
    for i in range(d // 2):
        a, b = x[0, 0, 0, i].item(), x[0, 0, 0, i + d // 2].item()
        ang = pos * f[i].item()
        assert math.isclose(y[i].item(), a * math.cos(ang) - b * math.sin(ang), abs_tol=1e-5)
        assert math.isclose(y[i + d // 2].item(), b * math.cos(ang) + a * math.sin(ang), abs_tol=1e-5)


def test_scores_depend_only_on_relative_position():
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)

    def score(m, n):
        cq, sq = rope_cos_sin(torch.tensor([[m]]), 32)
        ck, sk = rope_cos_sin(torch.tensor([[n]]), 32)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    assert torch.allclose(score(7, 3), score(14, 10), atol=1e-4)
    assert not torch.allclose(score(7, 3), score(7, 4), atol=1e-3)


def test_matches_the_rotate_half_formulation_in_bf16():
    torch.manual_seed(2)
    x = torch.randn(2, 5, 3, 16).bfloat16()
    pos = torch.arange(10).view(2, 5) * 3
    cos, sin = rope_cos_sin(pos, 16, dtype=torch.bfloat16)
    ang = pos.float()[..., None, None] * rope_inv_freq(16)  # the reference's full tables repeat the halves
    full_cos = torch.cat([ang.cos(), ang.cos()], -1).bfloat16()
    full_sin = torch.cat([ang.sin(), ang.sin()], -1).bfloat16()
    x1, x2 = x.chunk(2, -1)
    want = x * full_cos + torch.cat([-x2, x1], -1) * full_sin
    got = apply_rope(x, cos, sin)
    assert got.dtype == torch.bfloat16 and got.is_contiguous()
    assert torch.allclose(got.float(), want.float(), atol=2e-2)


def test_negative_and_per_row_positions():
    pos = torch.tensor([[-1, 0, 1], [4, 5, 6]])
    cos, sin = rope_cos_sin(pos, 4, dtype=torch.bfloat16)
    assert cos.dtype == torch.bfloat16
    c32, _ = rope_cos_sin(pos, 4)
    assert torch.allclose(c32[0, 0], c32[0, 2])  # cos is even in the position
    assert not torch.allclose(c32[0], c32[1])


def test_differentiable_path_matches_inference_path():
    x = torch.randn(1, 4, 2, 8, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(4)[None], 8)
    y = apply_rope(x, cos, sin)
    y.sum().backward()
    assert x.grad is not None
    with torch.no_grad():
        assert torch.allclose(apply_rope(x, cos, sin), y, atol=1e-6)


def test_out_writes_into_a_strided_destination():
    torch.manual_seed(3)
    x = torch.randn(2, 5, 1, 8)
    cos, sin = rope_cos_sin(torch.arange(10).view(2, 5), 8)
    cache = torch.zeros(2, 1, 9, 8)  # (B, KV, T, D): slots [2, 7) seen as (B, L, KV, D)
    with torch.no_grad():
        got = apply_rope(x, cos, sin, out=cache[:, :, 2:7].transpose(1, 2))
    assert torch.equal(cache[:, :, 2:7].transpose(1, 2), apply_rope(x, cos, sin))
    assert got.data_ptr() == cache[:, :, 2:7].data_ptr()
    assert torch.count_nonzero(cache[:, :, :2]) == 0 and torch.count_nonzero(cache[:, :, 7:]) == 0


def test_a_precomputed_inverse_frequency_table_gives_the_same_tables_bit_for_bit():
    positions = torch.tensor([[0, 1, 5, 17, 300]])
    for dtype in (torch.float32, torch.bfloat16):
        own = rope_cos_sin(positions, 32, 10_000.0, dtype)
        given = rope_cos_sin(positions, 32, 10_000.0, dtype, rope_inv_freq(32, 10_000.0))
        assert all(torch.equal(a, b) for a, b in zip(own, given))
