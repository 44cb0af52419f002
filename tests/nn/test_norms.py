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
    norm.reset_derived()
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
    norm = norm.bfloat16()
    norm.reset_derived()  # 1 + w of the bf16 weight, in float32
    y = norm(x)
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


def test_rmsnorm_one_plus_weight_is_a_load_time_table():
    """forward reads the float32 ``scale`` table (what reset_derived computed from the weight), it never
    recomputes 1 + w: a weight changed without reset_derived does not change the output."""
    from flashrt.profile.kernels import count_kernels

    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.fill_(0.5)
    norm.reset_derived()
    assert norm.scale.dtype == torch.float32 and torch.equal(norm.scale, torch.full((8,), 1.5))
    x = torch.randn(3, 8)
    y = norm(x)
    with torch.no_grad():
        norm.weight.fill_(2.0)
    assert torch.equal(norm(x), y)
    assert count_kernels(lambda: norm(x)).by_op["aten.add.Tensor"] == 0  # no 1 + w per call
    norm.reset_derived()
    assert torch.allclose(norm(x), y / 1.5 * 3.0, atol=1e-6)


def test_loaded_rmsnorm_tables_are_derived_strictly():
    """load_module derives the tables (they are not checkpoint keys, and none is left on meta)."""
    from flashrt.io import Rule, WeightMap, load_module

    norm = load_module(lambda: RMSNorm(4), {"w": torch.full((4,), -0.25)}, WeightMap([Rule("w", "weight")]))
    assert "scale" not in norm.state_dict() and torch.equal(norm.scale, torch.full((4,), 0.75))


def test_one_rmsnorm_has_the_gemma_llama_and_qwen3vl_forms():
    """offset: Gemma's 1 + w (zero at init) or a plain w (ones); cast_first: transformers' Llama
    ``w * normalize(x).to(dtype)``, else the float32 product rounded once (Gemma, Qwen3-VL in GR00T)."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 5, 32, generator=g) * 7).bfloat16()
    w = (1 + 0.3 * torch.randn(32, generator=g)).bfloat16()
    llama, qwen3vl = RMSNorm(32, 1e-5, offset=False, cast_first=True), RMSNorm(32, 1e-5, offset=False)
    assert torch.equal(llama.weight, torch.ones(32)) and torch.equal(RMSNorm(32).weight, torch.zeros(32))
    for norm in (llama, qwen3vl):
        norm.to(torch.bfloat16).weight.data.copy_(w)
        norm.reset_derived()
    assert torch.equal(llama(x), w * rms_normalize(x, 1e-5).to(torch.bfloat16))
    assert torch.equal(qwen3vl(x), rms_normalize(x, 1e-5, w).to(torch.bfloat16))
    assert not torch.equal(llama(x), qwen3vl(x))  # the two roundings differ in a half dtype
    assert "cast_first" in repr(llama) and "offset" not in repr(llama) and "offset" in repr(RMSNorm(4))
