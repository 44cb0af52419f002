"""QuantWeight: int8 / fp8 GEMMs against a float64 reference of the same quantized arithmetic."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from flashrt.quant import linear as L


def _kernels(w, x):
    return {n: k for n, k in L.KERNELS[w.kind].items() if k.applies(w, x)}


def _integer_case(qa, m=40, k=128, n=64, seed=0):
    """Integer activations in [-qa, qa] whose every row and the whole tensor reach qa (scale 1), integer
    weights whose every row reaches 127 (scale 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-qa, qa + 1, (m, k), generator=g).float()
    x[:, 0] = qa
    w = torch.randint(-127, 128, (n, k), generator=g).float()
    w[:, 1] = -127
    return x, w


@pytest.mark.parametrize("mode", L.MODES)
def test_int8_accumulation_is_bit_exact(mode):
    qa = L.activation_qmax("cpu")
    x, w = _integer_case(qa)
    qw = L.quantize_weight(w, "int8", torch.tensor(float(qa)), mode=mode)
    assert float(qw.w_scale.max()) == 1.0 == float(qw.w_scale.min())
    exact = (x.double() @ w.double().T)  # |acc| < 2**24: exact in float32 too
    kernels = _kernels(qw, x)
    assert "float" in kernels and (not L.onednn_int8_available() or "onednn" in kernels)
    for name, kernel in kernels.items():
        y = kernel.run(qw, x, None)
        assert torch.equal(y.double(), exact), name


def _reference_int8(x, w, bias, x_amax, qa, mode):
    x64, w64 = x.double(), w.double()
    sw = w64.abs().amax(1).float().double() / 127  # scales are float32 in the scheme
    wq = torch.round(w64 / sw[:, None]).clamp(-127, 127)
    if mode == "static":
        sx = torch.tensor(float(x_amax) / qa, dtype=torch.float32).double()
    else:
        sx = (x64.abs().amax(1, keepdim=True) / qa).float().double()
    xq = torch.round(x64 / sx).clamp(-qa, qa)
    return (xq @ wq.T) * (sx * sw) + bias.double()


@pytest.mark.parametrize("mode", L.MODES)
def test_int8_linear_matches_float64_reference(mode):
    torch.manual_seed(1)
    lin = nn.Linear(96, 80)
    x = torch.randn(50, 96) * 3
    amax = x.abs().amax() * 0.8  # some inputs clip
    qa = L.activation_qmax("cpu")
    qw = L.quantize_weight(lin.weight, "int8", amax, mode=mode)
    ref = _reference_int8(x, lin.weight.detach(), lin.bias.detach(), amax, qa, mode)
    for name, kernel in _kernels(qw, x).items():
        y = kernel.run(qw, x, lin.bias.detach().float())
        err = (y.double() - ref).abs().max() / ref.abs().max()
        assert err < 2e-6, (name, float(err))


@pytest.mark.parametrize("mode", L.MODES)
def test_portable_qdq_form_matches_float64_reference_and_is_never_measured(mode):
    """The form an ONNX export records (`portable`): the same integers (inputs beyond the calibrated
    range clip to +-qa, not to int8's -128), the sum in float."""
    torch.manual_seed(3)
    lin = nn.Linear(96, 80)
    x = torch.randn(50, 96) * 3
    x[0, :4] = torch.tensor([-1e3, 1e3, -50.0, 50.0])  # far outside the calibrated range
    amax = x[1:].abs().amax() * 0.8
    qa = L.activation_qmax("cpu")
    qw = L.quantize_weight(lin.weight, "int8", amax, mode=mode)
    ref = _reference_int8(x, lin.weight.detach(), lin.bias.detach(), amax, qa, mode)
    assert "qdq" not in _kernels(qw, x)  # never chosen by measurement
    table = L.KernelTable()
    with L.portable(table):
        assert table.choose(qw, x) == "qdq"
        y = L.INT8_KERNELS["qdq"].run(qw, x, lin.bias.detach().float())
    assert not table.portable and table.choose(qw, x) != "qdq"
    err = (y.double() - ref).abs().max() / ref.abs().max()
    assert err < 2e-6, float(err)
    if mode == "static":
        assert qw.x_scale_value == pytest.approx(float(amax) / qa)
        assert qw[:8].x_scale_value == qw.x_scale_value


def test_modes_are_per_thread():
    """An export recording (`portable`) or a load measuring (`tuning`) on one thread leaves another
    thread's GEMMs on the same table as they were."""
    import threading

    torch.manual_seed(5)
    lin = nn.Linear(64, 48)
    x = torch.randn(20, 64)
    qw = L.quantize_weight(lin.weight, "int8", x.abs().amax())
    table, entered, leave, seen = L.KernelTable(), threading.Event(), threading.Event(), {}

    def export() -> None:
        with L.portable(table), L.tuning(table):
            seen["inside"] = (table.portable, table.tuning, table.choose(qw, x))
            entered.set()
            leave.wait(10)

    worker = threading.Thread(target=export)
    worker.start()
    assert entered.wait(10)
    seen["other"] = (table.portable, table.tuning, table.choose(qw, x))
    leave.set()
    worker.join()
    assert seen["inside"] == (True, True, "qdq")
    assert seen["other"][:2] == (False, False) and seen["other"][2] != "qdq"
    assert not table.portable and not table.tuning


def test_portable_fp8_form_equals_the_emulation():
    """fp8's portable form (two ops the export writes as float8 Q/DQ) against the exact emulation."""
    torch.manual_seed(4)
    lin = nn.Linear(64, 48)
    x = torch.randn(30, 64) * 2
    qw = L.quantize_weight(lin.weight, "fp8", x.abs().amax() * 0.7)  # some activations saturate
    assert qw.w_scale_value == pytest.approx(float(qw.w_scale)) and qw[:8].w_scale_value == qw.w_scale_value
    with L.portable(L.KernelTable()) as table:
        assert table.choose(qw, x) == "qdq"
        y = L.FP8_KERNELS["qdq"].run(qw, x, lin.bias.detach())
    ref = L.FP8_KERNELS["emulate"].run(qw, x, lin.bias.detach())
    assert float((y - ref).abs().max() / ref.abs().max()) < 2e-6


@pytest.mark.parametrize("column_major", [False, True])
def test_window_of_a_sliced_weight_is_derived_from_the_view(column_major):
    """The block of the stored weight a slice views (what fp8's ONNX form dequantizes then slices)."""
    w = torch.randn(12, 8)
    qw = L.quantize_weight(w.t().contiguous().t() if column_major else w, "fp8", torch.tensor(1.0))
    base, *block = L._window(qw[2:7, 3:].q)
    assert base.data_ptr() == qw.q.data_ptr() and block == [2, 7, 3, 8]
    assert torch.equal(base[2:7, 3:].float(), qw[2:7, 3:].q.float())
    assert L._window(qw.q)[1:] == (0, 12, 0, 8)


def test_fp8_emulation_matches_float64_reference():
    torch.manual_seed(2)
    lin = nn.Linear(64, 48)
    x = torch.randn(30, 64)
    amax = x.abs().amax()
    qw = L.quantize_weight(lin.weight, "fp8", amax)
    w64 = lin.weight.detach().double()
    sw = (w64.abs().amax().float() / 448).double()
    sx = (amax.float() / 448).double()
    w8 = (w64 / sw).clamp(-448, 448).float().to(torch.float8_e4m3fn).double()
    x8 = (x.double() / sx).clamp(-448, 448).float().to(torch.float8_e4m3fn).double()
    ref = (x8 @ w8.T) * (sx * sw) + lin.bias.detach().double()
    y = L.FP8_KERNELS["emulate"].run(qw, x, lin.bias.detach().float())
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 2e-6
    assert qw.q.dtype == torch.float8_e4m3fn and qw.w_scale.dim() == 0


def test_installed_weight_serves_module_code_slices_and_counts_fallbacks():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 48, bias=False))
    x = torch.randn(20, 32)
    qw = L.quantize_weight(model[0].weight, "int8", x.abs().amax())
    old = L.install(model, {"0": qw})
    assert model[0].weight is qw and qw.dtype == torch.float32 and qw.shape == (48, 32)
    L.FALLBACKS.clear()
    full = model(x)
    rows = F.linear(x, model[0].weight[16:])  # a slice of a fused projection stays quantized
    assert torch.equal(rows, full[:, 16:]) and not L.FALLBACKS
    deq = model[0].weight + 0  # anything else sees the dequantized weight, counted
    assert torch.equal(deq, qw.dequantize()) and sum(L.FALLBACKS.values()) == 1
    L.install(model, old)
    assert isinstance(model[0].weight, nn.Parameter)


def test_kernel_table_measures_inside_tuning_and_reuses_nearest_rows():
    table = L.KernelTable(reps=1)
    w = L.quantize_weight(torch.randn(32, 64), "int8", torch.tensor(3.0))
    with L.tuning(table):
        chosen = table.choose(w, torch.randn(24, 64))
    assert chosen in L.INT8_KERNELS and len(table.measured) == 1
    assert table.choose(w, torch.randn(30, 64)) == chosen and table.late == 0  # nearest measured M
    other = L.quantize_weight(torch.randn(16, 64), "int8", torch.tensor(3.0))
    table.choose(other, torch.randn(24, 64))
    assert table.late == 1  # never measured: measured now, counted


def test_observed_weight_records_inputs_of_slices_too():
    seen = {}
    w = L.ObservedWeight(torch.randn(8, 4), "site", lambda s, x: seen.setdefault(s, []).append(x.abs().max()))
    F.linear(torch.full((2, 4), 3.0), w)
    F.linear(torch.full((2, 4), 5.0), w[2:])
    assert [float(v) for v in seen["site"]] == [3.0, 5.0]


def test_static_activation_needs_an_amax():
    with pytest.raises(ValueError, match="calibrated amax"):
        L.quantize_weight(torch.randn(4, 4), "int8", None)


def test_onednn_fused_mlp_ops_run_quantized_with_the_post_op():
    torch.manual_seed(4)
    x, other = torch.randn(40, 64), torch.randn(40, 32)
    qw = L.quantize_weight(torch.randn(32, 64), "int8", x.abs().amax())
    L.FALLBACKS.clear()
    gelu = torch.ops.mkldnn._linear_pointwise(x, qw, None, "gelu", [], "tanh")
    prod = torch.ops.mkldnn._linear_pointwise.binary(x, other, qw, None, "mul")
    plain = F.linear(x, qw)
    assert not L.FALLBACKS
    assert torch.allclose(gelu, F.gelu(plain, approximate="tanh"), atol=1e-5)
    assert torch.allclose(prod, plain * other, atol=1e-5)
    for name, kernel in _kernels(qw, x).items():  # every kernel applies the same post-op
        y = kernel.run(qw, x, None, "gelu_tanh")
        assert torch.allclose(y, F.gelu(plain, approximate="tanh"), atol=1e-5), name
