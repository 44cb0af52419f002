"""Block-spectral conv: the same function as F.conv1d (checked against float64) in both product forms
(stacked and Gauss), the direct conv below `min_blocks`, the policy table, which convs `apply_conv_policy`
makes spectral, the fused-epilogue paths, plan rebuilds, and trace capture."""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from flashrt.nn import spectral_conv
from flashrt.nn.audio import Conv1d, ConvTranspose1d, from_rows, to_rows
from flashrt.nn.conv1d import plain_forms
from flashrt.nn.conv_policy import POLICIES, ConvPolicy, apply_conv_policy
from flashrt.nn.spectral_conv import (
    MIN_BLOCKS,
    SHORT_BELOW,
    SHORT_ROWS,
    SpectralPlan,
    SpectralPolicy,
    points,
    spectral_bytes,
)
from flashrt.runtime.graphs import get_backend

pytestmark = pytest.mark.usefixtures("one_thread")


def _conv(cin: int, cout: int, kernel: int, dilation: int = 1, bias: bool = True, seed: int = 0) -> Conv1d:
    torch.manual_seed(seed)
    conv = Conv1d(cin, cout, kernel, dilation, bias=bias).requires_grad_(False)
    nn.init.normal_(conv.weight, std=1 / math.sqrt(cin * kernel))
    if bias:
        nn.init.normal_(conv.bias, std=0.1)
    conv.reset_derived()
    return conv


def _spectral(conv: Conv1d, block: int) -> Conv1d:
    """``conv`` made spectral at every length (the plan's direct fallback off)."""
    conv.set_spectral(block)
    conv.spectral.min_blocks = 1
    return conv


def _truth(conv: Conv1d, x: torch.Tensor) -> torch.Tensor:
    bias = None if conv.bias is None else conv.bias.double()
    return F.conv1d(x.double(), conv.weight.double(), bias, padding=conv.padding, dilation=conv.dilation)


@pytest.mark.parametrize("cin,cout,kernel,dilation,steps,batch,block", [
    (16, 24, 7, 1, 100, 1, 32),     # steps not a multiple of the hop
    (16, 16, 11, 5, 333, 2, 64),    # dilated, batch 2
    (8, 8, 3, 3, 50, 1, 16),
    (32, 32, 7, 3, 7, 1, 32),       # shorter than one block
    (4, 4, 5, 2, 9, 2, 8),
    (12, 6, 11, 1, 54, 1, 64),      # exactly one hop
    (64, 64, 7, 3, 150, 2, 32),     # stacked products at a width oneDNN runs fast (2 C = 128)
    (160, 96, 7, 1, 90, 1, 32),     # Gauss's three products (C > 128)
])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_float64_conv(cin, cout, kernel, dilation, steps, batch, block, bias):
    conv = _conv(cin, cout, kernel, dilation, bias)
    x = torch.randn(batch, cin, steps)
    want = _truth(conv, x)
    direct = from_rows(conv(to_rows(x)))
    rows = _spectral(conv, block)(to_rows(x))
    assert rows.is_contiguous(memory_format=torch.channels_last)         # the layout the next conv wants
    got = from_rows(rows)
    assert got.shape == want.shape
    err, direct_err = (got.double() - want).abs().max(), (direct.double() - want).abs().max()
    assert err <= 3e-6 and err <= 3 * direct_err + 1e-7      # as exact as the direct fp32 conv


@pytest.mark.parametrize("cin,cout,kernel,dilation,steps,batch,block", [
    (64, 64, 7, 3, 150, 2, 32),     # stacked
    (160, 96, 7, 1, 90, 1, 32),     # Gauss
    (16, 24, 11, 1, 100, 1, 64),
])
def test_batched_products_equal_the_grouped_conv(monkeypatch, cin, cout, kernel, dilation, steps, batch,
                                                 block):
    """Where torch's CPU kernels are not AVX-512, the products run as one batched GEMM: the same
    function (float64 bound) as the grouped conv's, to float32 rounding."""
    conv = _conv(cin, cout, kernel, dilation)
    x = to_rows(torch.randn(batch, cin, steps))
    grouped = _spectral(conv, block)(x)
    monkeypatch.setattr(spectral_conv, "grouped_products", lambda: False)
    plan = _spectral(conv, block).spectral
    assert plan.packed is None and plan.kernel.shape == (plan.groups, *plan.kernel.shape[1:])
    batched = conv(x)
    err = (from_rows(batched).double() - _truth(conv, from_rows(x))).abs().max()
    assert err <= 3e-6 and (batched - grouped).abs().max() <= 2e-6


@pytest.mark.parametrize("into", [False, True])
def test_epilogue_slope_and_residual(into):
    conv = _spectral(_conv(8, 8, 7, 3), 32)
    x, res = torch.randn(1, 8, 61), torch.randn(1, 8, 61)
    want = _truth(conv, x)
    act = from_rows(conv(to_rows(x), slope=0.1))
    assert (act.double() - F.leaky_relu(want, 0.1)).abs().max() <= 2e-6
    residual = to_rows(res)
    out = from_rows(conv(to_rows(x), residual=residual, into=into))
    assert (out.double() - (want + res.double())).abs().max() <= 2e-6
    assert torch.equal(from_rows(residual), out if into else res)           # into: summed in place


def test_plan_follows_the_weight():
    conv = _spectral(_conv(8, 8, 7), 32)
    x = torch.randn(1, 8, 40)
    before = from_rows(conv(to_rows(x)))
    with torch.no_grad():
        conv.weight.mul_(-2.0)
    conv.reset_derived()                             # what load_module calls after assigning weights
    conv.spectral.min_blocks = 1
    after = from_rows(conv(to_rows(x)))
    assert conv.spectral_block == 32 and conv.spectral is not None
    assert (after.double() - _truth(conv, x)).abs().max() <= 2e-6
    assert (after - before).abs().max() > 0.1


def test_short_calls_run_direct():
    conv = _conv(64, 64, 11, 3)
    conv.set_spectral(64)
    assert conv.spectral.min_blocks == MIN_BLOCKS
    short, long = torch.randn(1, 64, 900), torch.randn(2, 64, 600)    # R = 3 x 7 blocks; 2 x 3 x 5
    for x, direct in ((short, True), (long, False)):
        got = from_rows(conv(to_rows(x), slope=0.2)).double()
        assert (got - F.leaky_relu(_truth(conv, x), 0.2)).abs().max() <= 3e-6
        conv.spectral.min_blocks = 10 ** 6                 # the same call forced direct
        forced = from_rows(conv(to_rows(x), slope=0.2)).double()
        conv.spectral.min_blocks = MIN_BLOCKS
        assert torch.equal(got, forced) == direct


def test_short_calls_run_the_short_plan():
    """A conv with a short-call plan (`SpectralPolicy.blocks`): calls with enough block rows at the main
    N run it, shorter ones the short plan when it engages, else the direct conv; all three the conv."""
    conv = _conv(16, 16, 11, 1)
    conv.set_spectral(32, 20, (20, 12))                       # main N 32 from 20 rows, N 20 from 12
    assert conv.spectral_short.block == 20 and conv.spectral_short.min_blocks == 12
    ran = []
    for plan in (conv.spectral, conv.spectral_short):
        plan.register_forward_hook(lambda mod, i, o: ran.append(mod.block))
    for steps, want in ((22 * 20, [32]), (22 * 19, [20]), (10 * 11, [])):   # 20 / 19 rows at N 32; 11 at N 20
        x = torch.randn(1, 16, steps)
        ran.clear()
        got = from_rows(conv(to_rows(x), slope=0.1)).double()
        assert ran == want
        assert (got - F.leaky_relu(_truth(conv, x), 0.1)).abs().max() <= 3e-6
    conv.reset_derived()                                      # a reload keeps both plans and thresholds
    assert conv.spectral_short_block == (20, 12) and conv.spectral.min_blocks == 20
    conv.set_spectral(None, MIN_BLOCKS, (20, 12))             # direct: no short plan either
    assert conv.spectral is None and conv.spectral_short is None


def test_policy_gives_256_channel_convs_a_short_plan():
    net = nn.Sequential(Conv1d(256, 256, 11, 3), Conv1d(128, 128, 11))
    for conv in net:
        conv.reset_derived()
    apply_conv_policy(net, POLICIES["auto"])
    wide, narrow = net
    assert (wide.spectral.block, wide.spectral.min_blocks) == (32, SHORT_BELOW)
    assert (wide.spectral_short.block, wide.spectral_short.min_blocks) == (20, SHORT_ROWS)
    assert narrow.spectral.block == 32 and narrow.spectral_short is None
    plans = (wide.spectral, wide.spectral_short, narrow.spectral)
    held = [b for p in plans for b in (*p.buffers(), *([p.packed] if p.packed is not None else []))]
    assert spectral_bytes(net) == sum(b.numel() * 4 for b in held)
    apply_conv_policy(net, POLICIES["direct"])
    assert wide.spectral_short is None and spectral_bytes(net) == 0


def test_product_forms():
    assert points(64) == points(128) == 2 and points(129) == points(256) == 3
    stacked = SpectralPlan(torch.randn(6, 128, 7), 1, 3, 32)
    gauss = SpectralPlan(torch.randn(6, 256, 7), 1, 3, 32)
    assert (stacked.groups, stacked.dft.shape, stacked.idft.shape) == (16, (32, 32), (26, 32))
    assert (gauss.groups, gauss.dft.shape, gauss.idft.shape) == (47, (47, 32), (26, 47))


def test_non_rows_and_other_dtypes_run_direct():
    conv = _conv(8, 8, 7)
    conv.set_spectral(32)
    x = torch.randn(1, 8, 30)
    assert (conv(x).double() - _truth(conv, x)).abs().max() <= 2e-6          # (B, C, T) layout: direct
    y = conv.bfloat16()(to_rows(x).bfloat16())                               # bf16: direct, no plan use
    assert y.dtype == torch.bfloat16


def test_policy_table():
    auto = SpectralPolicy()
    assert auto.block(3, 512, 512) is None and auto.block(5, 256, 256) is None
    assert auto.block(7, 256, 256) == 16 and auto.block(11, 256, 256, dilation=3) == 32  # least N >= 2 r - 2
    assert auto.block(7, 128, 128, dilation=3) == 32 and auto.block(11, 128, 128) == 32  # >= 32 below
    assert auto.block(7, 64, 64) == 32 and auto.block(11, 64, 64) == 32 and auto.block(11, 32, 32) is None
    assert auto.block(19, 128, 128) == 64 and auto.block(19, 256, 256) == 64             # least N >= 2 r - 2
    assert auto.block(7, 192, 256) is None and auto.block(11, 512, 512) is None      # not fast_widths
    assert auto.block(7, 128, 128, dilation=5) == 32 and auto.block(7, 128, 128, dilation=12) is None
    assert auto.min_blocks == MIN_BLOCKS and POLICIES["spectral"].spectral.min_blocks == 1
    every = POLICIES["spectral"].spectral
    assert every.block(3, 4, 4) == 16 and every.block(11, 4, 4) == 64 and every.block(1, 4, 4) is None
    assert POLICIES["direct"] == ConvPolicy() and POLICIES["invariant"].spectral is None


def test_blocks_add_a_short_plan_at_256_channels():
    """At >= 256 channels a conv holds two plans: the policy's N from `SHORT_BELOW` block rows, the least
    N (2 (r - 1)) from `SHORT_ROWS`; below 256 channels one plan from `MIN_BLOCKS` rows; none for a
    direct conv. Every N is a valid plan block (even, >= 2 r - 2)."""
    auto, every = SpectralPolicy(), POLICIES["spectral"].spectral
    assert auto.blocks(7, 256, 256) == ((16, SHORT_BELOW), (12, SHORT_ROWS))
    assert auto.blocks(11, 256, 256, 5) == ((32, SHORT_BELOW), (20, SHORT_ROWS))
    assert auto.blocks(11, 128, 128, 3) == auto.blocks(7, 64, 64) == ((32, MIN_BLOCKS),)
    assert auto.blocks(9, 256, 256) == ((16, MIN_BLOCKS),)              # 2 (r - 1) is the policy's N already
    assert auto.blocks(3, 256, 256) == auto.blocks(11, 32, 32) == auto.blocks(11, 512, 512) == ()
    assert every.blocks(11, 256, 256) == ((64, 1),)
    assert SHORT_ROWS >= MIN_BLOCKS and SHORT_BELOW > SHORT_ROWS
    for kernel in (7, 11):
        (_, below), (short, _) = auto.blocks(kernel, 256, 256)
        assert auto.blocks(kernel, 256, 256)[0][0] == auto.block(kernel, 256, 256)
        plan = SpectralPlan(torch.randn(4, 4, kernel), 1, kernel // 2, short)      # a valid block
        assert plan.hop == kernel - 1
    # V1's 50-frame stage-0 call (T 400): too few rows for r 11's N 32 plan, enough for its short one
    x = torch.zeros(1, 256, 1, 400)
    weight = torch.randn(256, 256, 11)
    (long_n, long_rows), (short_n, short_rows) = auto.blocks(11, 256, 256)
    assert not SpectralPlan(weight, 1, 5, long_n, min_blocks=long_rows).engages(x)
    assert SpectralPlan(weight, 1, 5, short_n, min_blocks=short_rows).engages(x)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wide = Conv1d(128, 128, 11, 3)
        self.narrow = Conv1d(128, 128, 3)
        self.grouped = Conv1d(128, 128, 11, groups=4)
        self.small = Conv1d(32, 32, 11)
        self.up = ConvTranspose1d(32, 16, 8, 4)


def _chosen(net: nn.Module, name: str) -> tuple[list[str], list[str], list[str]]:
    got = apply_conv_policy(net, POLICIES[name])
    return got["spectral"], got["phase_split"], got["polyphase"]


def test_policy_picks_by_table_and_eligibility():
    net = _Net()
    for conv in net.modules():
        if isinstance(conv, (Conv1d, ConvTranspose1d)):
            conv.reset_derived()
    assert _chosen(net, "auto") == (["wide"], [], [])
    plan = net.wide.spectral
    packed = 0 if plan.packed is None else plan.packed.numel() * 4
    held = sum(b.numel() * 4 for b in plan.buffers()) + packed
    assert spectral_bytes(net) == held and plan.min_blocks == MIN_BLOCKS
    assert spectral_bytes(net) >= 16 * 16 * 128 * 128              # the stacked products' weight at N 32
    assert _chosen(net, "spectral") == (["wide", "narrow", "small"], [], [])  # never grouped
    assert net.wide.spectral.min_blocks == 1
    net.wide.reset_derived()                                                  # a weight reload keeps it
    assert net.wide.spectral.min_blocks == 1 and net.wide.spectral_block == 64
    assert _chosen(net, "invariant") == ([], ["wide"], ["up"])
    assert spectral_bytes(net) == 0 and net.narrow.spectral is None          # the previous policy undone
    assert _chosen(net, "direct") == ([], [], [])
    assert not net.wide.phase_split and not net.up.polyphase
    net.bfloat16()
    assert _chosen(net, "spectral")[0] == []                                  # float32 only


def test_plan_rejects_bad_geometry():
    with pytest.raises(ValueError, match="same"):
        SpectralPlan(torch.randn(4, 4, 7), dilation=1, padding=2, block=32)
    with pytest.raises(ValueError, match="block"):
        SpectralPlan(torch.randn(4, 4, 11), dilation=1, padding=5, block=8)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_recorded_for_export_as_the_plain_conv():
    """Inside `plain_forms` (an export recording) a spectral conv runs as the conv it computes: no DFT
    GEMMs reach the program another runtime gets; eager calls stay spectral."""
    conv = _spectral(_conv(16, 16, 11, 3), 64)
    x = to_rows(torch.randn(1, 16, 300))
    with _Ops() as eager:
        y = conv(x, slope=0.1)
    with plain_forms(), _Ops() as recorded:
        z = conv(x, slope=0.1)
    assert "matmul" in eager.names or "bmm" in eager.names
    assert not {"matmul", "bmm", "mm"} & recorded.names
    assert (y - z).abs().max() <= 2e-6


def test_plain_forms_are_per_thread():
    """An export recording on one thread leaves another thread's eager calls spectral."""
    conv = _spectral(_conv(16, 16, 11, 3), 64)
    x = to_rows(torch.randn(1, 16, 300))
    seen: list[set[str]] = []

    def eager_call() -> None:
        with _Ops() as ops:
            conv(x)
        seen.append(ops.names)

    with plain_forms():
        worker = threading.Thread(target=eager_call)
        worker.start()
        worker.join()
    assert seen and ("matmul" in seen[0] or "bmm" in seen[0])


def test_trace_capture_replays_like_eager():
    conv = _spectral(_conv(16, 16, 11, 5), 64)
    x = to_rows(torch.randn(1, 16, 90))
    out = torch.empty(1, 16, 1, 90).contiguous(memory_format=torch.channels_last)

    def step() -> None:
        out.copy_(conv(x, slope=0.1))

    graph = get_backend("trace").capture(step)
    for seed in range(3):
        x.copy_(to_rows(torch.randn(1, 16, 90, generator=torch.Generator().manual_seed(seed))))
        graph.replay()
        assert torch.equal(out, conv(x, slope=0.1))


def test_plain_eager_calls_reuse_per_thread_scratch_with_the_same_result():
    """A plan's temporaries (padded sequence, dilation phases, spectra) live in per-thread buffers that
    plain eager calls reuse (no page faults per call); the outputs are the same bits as with fresh
    temporaries, calls of other lengths in between included, and never a view of those buffers; a
    recording mode gets fresh tensors; another thread has its own."""
    import threading

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    for d in (1, 3):
        plan = SpectralPlan(torch.randn(32, 32, 7) / 15, d, 3 * d, 32, torch.randn(32), 1)
        xs = [to_rows(torch.randn(1, 32, t)) for t in (600, 200, 900, 600)]
        with Ops():
            fresh = [plan(x) for x in xs]
        kept = [plan(x) for x in xs]
        assert all(torch.equal(a, b) for a, b in zip(kept, fresh))
        buffers = {b.untyped_storage().data_ptr() for b in spectral_conv._Scratch._local.buffers.values()}
        assert not any(k.untyped_storage().data_ptr() in buffers for k in kept)
    assert spectral_conv.scratch_bytes() >= 4 * (3 * 900 + 2 * 32 + 32) * 32      # the phases of d 3
    seen = {}

    def fresh_thread() -> None:
        seen["bytes"] = spectral_conv.scratch_bytes()              # its own buffers: none yet
        with torch.inference_mode():
            inside = plan(xs[0])                                   # buffers made in inference mode ...
        seen["same"] = torch.equal(plan(xs[0]), inside)            # ... are not written outside it

    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join()
    assert seen == {"bytes": 0, "same": True}


def test_native_dft_gemm_matches_torch_and_leaves_recordings_to_aten(monkeypatch):
    """The DFTs' batched GEMM in csrc/spectral_cpu.c (plain eager calls where the CPU library loads):
    the same sums as torch's batched matmul, on the windows read in place and on contiguous spectra;
    a plan's output matches its torch-GEMM form; a recording mode records ATen's matmul."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if spectral_conv._native_gemm() is None:
        pytest.skip("the CPU kernels cannot be built here (no C compiler)")

    class Ops(TorchDispatchMode):
        seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    a = torch.randn(29, 20)
    seq = torch.randn(1000, 48)
    windows = seq.as_strided((40, 20, 48), (22 * 48, 48, 1))                 # overlapping, in place
    for b in (windows, torch.randn(7, 20, 144)):
        got = spectral_conv._gemm(a, b, torch.empty(b.shape[0], 29, b.shape[2]), True)
        assert (got - torch.matmul(a, b)).abs().max() <= 1e-5
    plan = SpectralPlan(torch.randn(64, 64, 11) / 26, 3, 15, 32, torch.randn(64), 1)
    x = to_rows(torch.randn(1, 64, 777))
    calls = []
    native = spectral_conv._native_gemm
    monkeypatch.setattr(spectral_conv, "_native_gemm", lambda: calls.append(1) or native())
    got = plan(x)
    assert len(calls) == 2                                          # forward and inverse DFT
    monkeypatch.setattr(spectral_conv, "_native_gemm", lambda: None)
    assert (got - plan(x)).abs().max() <= 1e-5
    monkeypatch.setattr(spectral_conv, "_native_gemm", lambda: calls.append(1) or native())
    with Ops() as mode:
        recorded = plan(x)
    assert len(calls) == 2 and any("bmm" in op or "mm" in op for op in mode.seen)
    assert (recorded - got).abs().max() <= 1e-5


def _stale_padding_runs(conv: Conv1d, steps: int, ends: tuple[int, ...]) -> list[tuple[torch.Tensor, ...]]:
    """For each valid end: the valid outputs of a padded call whose padding holds zeros and of one whose
    padding holds what an earlier, longer call left there (large garbage)."""
    from flashrt.nn.valid import ValidLength

    gen = torch.Generator().manual_seed(steps)
    out = []
    for end in ends:
        x = torch.randn(1, conv.in_channels, steps, generator=gen)
        x[..., end:] = 0
        stale = x.clone()
        stale[..., end:] = 100 * torch.randn(1, conv.in_channels, steps - end, generator=gen)
        with torch.no_grad():
            runs = [conv(to_rows(t), ValidLength(torch.tensor([end]), steps))[..., :end] for t in (x, stale)]
        out.append(tuple(runs))
    return out


@pytest.mark.parametrize("dilation,block", [(1, 32), (3, 32), (5, 16)])
def test_padded_call_never_reads_stale_padding(dilation, block):
    """A padded call (ValidLength) zeroes every step the valid outputs' blocks read, not only the taps'
    halo: the DFT mixes the whole block, so stale padding (a previous, longer utterance's values) would
    move the valid outputs at the rounding level and a call would depend on what ran before."""
    conv = _spectral(_conv(32, 32, 7, dilation), block)
    for zeros, stale in _stale_padding_runs(conv, 400, (37, 200, 333, 399)):
        assert torch.equal(zeros, stale)


def test_scratch_left_by_a_longer_call_is_never_read():
    """Every scratch element a call reads it wrote itself: a call after a longer one, with the scratch
    poisoned in between, gives the bits of a call with fresh temporaries."""
    torch.manual_seed(1)
    for d in (1, 3):
        plan = SpectralPlan(torch.randn(32, 32, 7) / 15, d, 3 * d, 32, torch.randn(32), 1)
        short, long = to_rows(torch.randn(1, 32, 130)), to_rows(torch.randn(1, 32, 2000))
        first = plan(short)
        plan(long)
        with torch.inference_mode():  # earlier tests may have left inference-mode scratch buffers
            for buf in spectral_conv._Scratch._local.buffers.values():
                buf.fill_(float("nan"))
        assert torch.equal(plan(short), first)
