"""RMSNorm (Gemma's 1 + w), adaRMSNorm (scale | shift | gate), gated residual."""

import torch

from flashrt.nn.norms import AdaRMSNorm, RMSNorm, gated_residual, rms_normalize


def _reference_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.double())


def test_rmsnorm_matches_formula_with_one_plus_weight():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    x = torch.randn(2, 5, 16) * 3
    assert torch.allclose(norm(x).double(), _reference_rms(x, norm.weight, 1e-6), atol=1e-5)


def test_rmsnorm_zero_weight_is_pure_normalization():
    norm = RMSNorm(8)
    x = torch.randn(3, 8)
    y = norm(x)
    assert torch.allclose(y.pow(2).mean(-1), torch.ones(3), atol=1e-4)


def test_rmsnorm_bf16_keeps_dtype_and_computes_in_fp32():
    torch.manual_seed(1)
    norm = RMSNorm(32)
    with torch.no_grad():
        norm.weight.normal_(0, 0.1)
    x = (torch.randn(4, 32) * 100).bfloat16()
    y = norm.bfloat16()(x)
    assert y.dtype == torch.bfloat16
    want = _reference_rms(x.float(), norm.weight.float(), 1e-6).to(torch.bfloat16)
    assert torch.equal(y, want)


def test_rms_normalize_returns_float32():
    assert rms_normalize(torch.randn(2, 4).half(), 1e-6).dtype == torch.float32


def test_adarms_modulation_order_is_scale_shift_gate():
    d, c = 6, 4
    norm = AdaRMSNorm(d, c)
    with torch.no_grad():
        norm.dense.weight.zero_()
        norm.dense.bias.copy_(torch.tensor([0.5, 2.0, -3.0]).repeat_interleave(d))
    mod = norm.modulation(torch.randn(c))
    assert mod.shape == (3, d)
    assert torch.allclose(mod[0], torch.full((d,), 1.5))  # 1 + scale
    assert torch.allclose(mod[1], torch.full((d,), 2.0))
    assert torch.allclose(mod[2], torch.full((d,), -3.0))
    x = torch.randn(2, 3, d)
    y, gate = norm(x, mod)
    want = _reference_rms(x, torch.zeros(d), 1e-6) * 1.5 + 2.0
    assert torch.allclose(y.double(), want, atol=1e-5)
    assert torch.equal(gate, torch.full((d,), -3.0))


def test_adarms_batched_modulation_broadcasts():
    torch.manual_seed(2)
    norm = AdaRMSNorm(8, 5)
    cond = torch.randn(2, 5)
    mod = norm.modulation(cond)  # (2, 3, 8)
    x = torch.randn(2, 4, 8)
    y, _ = norm(x, mod[:, None])
    for b in range(2):
        yb, _ = norm(x[b:b + 1], mod[b])
        assert torch.allclose(y[b:b + 1], yb)


def test_gated_residual():
    x, y = torch.ones(3), torch.full((3,), 2.0)
    assert torch.equal(gated_residual(x, y, None), torch.full((3,), 3.0))
    assert torch.equal(gated_residual(x, y, torch.full((3,), 0.5)), torch.full((3,), 2.0))
