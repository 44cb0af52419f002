"""PackedLinear (flashrt/nn/packed_linear.py): the packed oneDNN GEMM and its fused epilogues against
F.linear and the unfused ops."""

import copy

import pytest
import torch

from flashrt.nn.packed_linear import PackedLinear


def test_packed_linear_fuses_activation_and_residual():
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 40, generator=gen), torch.randn(24, generator=gen)
    x, other = torch.randn(53, 40, generator=gen), torch.randn(53, 24, generator=gen)
    ref = torch.nn.functional.linear(x, w, b)
    for act, fn in (("none", lambda y: y), ("tanh", torch.tanh), ("sigmoid", torch.sigmoid)):
        assert (PackedLinear(w, b, act)(x) - fn(ref)).abs().max() <= 1e-5
    assert (PackedLinear(w, b)(x, other=other) - (ref + other)).abs().max() <= 1e-5
    b2 = torch.randn(24, generator=gen)
    assert (PackedLinear(w, b)(x, bias=b2) - torch.nn.functional.linear(x, w, b2)).abs().max() <= 1e-5
    with pytest.raises(ValueError):
        PackedLinear(w, b, "tanh")(x, other=other)


def test_packed_linear_deep_copies():
    w, b = torch.randn(8, 5), torch.randn(8)
    x = torch.randn(3, 5)
    lin = PackedLinear(w, b, "tanh")
    assert torch.equal(copy.deepcopy(lin)(x), lin(x))


def test_other_dtypes_run_the_unfused_math():
    w, b = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    lin = PackedLinear(w, b, "sigmoid")
    assert lin.packed is None
    x = torch.randn(3, 5, dtype=torch.float64)
    assert torch.equal(lin(x), torch.sigmoid(torch.nn.functional.linear(x, w, b)))


def test_a_trace_records_the_packed_call_with_the_same_values():
    """Under `torch.jit.trace` the packed call runs through TorchScript functions the tracer records
    (it cannot record the op's empty scalar list itself); the traced graph computes the same values."""
    w, b = torch.randn(6, 4), torch.randn(6)
    lin, add = PackedLinear(w, b, "sigmoid"), PackedLinear(w, b)
    if lin.packed is None:
        pytest.skip("no oneDNN packed GEMM in this torch build")
    x, other = torch.randn(3, 4), torch.randn(3, 6)

    def fn(inputs):
        return lin(inputs[0]) + add(inputs[0], other=inputs[1])

    traced = torch.jit.trace(fn, ([x, other, lin.packed, add.packed],), check_trace=False)
    assert "prim::CallFunction" in str(traced.graph)
    x2 = torch.randn(3, 4)
    assert torch.equal(traced([x2, other, lin.packed, add.packed]), fn([x2, other]))
