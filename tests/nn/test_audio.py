"""Shared audio blocks: padding-exact masking, receptive fields, snake, filters, weight-norm folding."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashrt import ops
from flashrt.errors import ConfigError
from flashrt.io import Checkpoint, Rule, WeightMap, load_module
from flashrt.nn.alias_free import SINES, pick_sine, sin_
from flashrt.nn.audio import (
    EXACT,
    Activation1d,
    Conv1d,
    ConvTranspose1d,
    DownSample1d,
    Reach,
    ResBlock1,
    ResBlock2,
    Snake,
    SnakeBeta,
    UpSample1d,
    ValidLength,
    conv_rules,
    from_rows,
    kaiser_sinc_filter1d,
    polyphase_weight,
    to_rows,
)
from flashrt.nn.conv_policy import POLICIES, apply_conv_policy


def _ready(module: nn.Module, seed: int = 0) -> nn.Module:
    """Random weights (biases and snake parameters too) and derived buffers, as load_module leaves them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            scale = 0.3 if p.dim() == 1 else 1 / math.sqrt(p[0].numel())
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    for sub in reversed(list(module.modules())):
        if hasattr(sub, "reset_derived"):
            sub.reset_derived()
    return module.eval()


def _padded_equals_exact(block, x: torch.Tensor, pad: int, rows: bool = False) -> float:
    """max |padded run (masked by ValidLength) - unpadded run| over the valid outputs."""
    frames = x.shape[-1]
    garbage = torch.randn(*x.shape[:-1], pad) * 5
    xp = torch.cat([x, garbage], dim=-1)
    if rows:
        x, xp = to_rows(x), to_rows(xp)
    with torch.no_grad():
        exact = block(x.clone(), EXACT)
        padded = block(xp, ValidLength(torch.tensor([frames]), frames + pad))
    rate = exact.shape[-1] // frames
    return float((padded[..., :frames * rate] - exact).abs().max())


# ------------------------------------------------------------------------------------ ValidLength

def test_valid_length_halo_fixes_in_place():
    v = ValidLength(torch.tensor([4]), frames=6)
    x = torch.arange(1.0, 7.0).reshape(1, 1, 6)
    assert v.zero(x.clone(), 3).flatten().tolist() == [1, 2, 3, 4, 0, 0]     # clamped steps stay padding
    assert v.hold(x.clone(), 1).flatten().tolist() == [1, 2, 3, 4, 4, 6]     # only the halo is touched
    y = x.clone()
    assert v.zero(y, 2) is y                                                  # in place
    full = ValidLength(torch.tensor([6]), frames=6)                           # no padding at all
    assert torch.equal(full.zero(x.clone(), 4), x) and torch.equal(full.hold(x.clone(), 4), x)
    assert torch.equal(v.zero(x.clone(), 0), x)


def test_valid_length_zero_and_hold_per_rate():
    v = ValidLength(torch.tensor([3]), frames=5)
    x = torch.arange(1.0, 11.0).reshape(1, 1, 10)          # rate 2: valid steps 0..5
    assert v.zero(x).flatten().tolist() == [1, 2, 3, 4, 5, 6, 0, 0, 0, 0]
    assert v.hold(x).flatten().tolist() == [1, 2, 3, 4, 5, 6, 6, 6, 6, 6]
    y = torch.arange(1.0, 6.0).reshape(1, 1, 5)             # rate 1: valid steps 0..2
    assert v.hold(y).flatten().tolist() == [1, 2, 3, 3, 3]
    with pytest.raises(ValueError, match="multiple"):
        v.zero(torch.zeros(1, 1, 7))


def test_exact_is_identity():
    x = torch.randn(2, 3, 4)
    assert EXACT.zero(x) is x and EXACT.hold(x) is x


BLOCKS = {
    "resblock1": lambda: ResBlock1(8, 3, (1, 3, 5)),
    "resblock2": lambda: ResBlock2(8, 5, (1, 2)),
    "activation1d": lambda: Activation1d(8, SnakeBeta(8, logscale=True)),
    "conv": lambda: Conv1d(8, 6, 7, 3),
    "conv-transpose": lambda: ConvTranspose1d(8, 4, 16, 8),
}


@pytest.mark.parametrize("rows", [False, True], ids=["ncw", "rows"])
@pytest.mark.parametrize("pad", [1, 9])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_blocks_padded_equal_unpadded(name, pad, rows):
    """Garbage padding past the valid length never reaches the valid outputs (halo fixes suffice)."""
    torch.manual_seed(0)
    block = _ready(BLOCKS[name]())
    x = torch.randn(2, 8, 23)
    assert _padded_equals_exact(block, x, pad=pad, rows=rows) <= 1e-5


@pytest.mark.parametrize("name", list(BLOCKS))
def test_rows_layout_equals_ncw(name):
    block = _ready(BLOCKS[name]())
    x = torch.randn(2, 8, 19)
    with torch.no_grad():
        assert (from_rows(block(to_rows(x))) - block(x)).abs().max() <= 1e-5


def test_fused_epilogues_match_separate_ops():
    conv = _ready(Conv1d(8, 8, 5, 2))
    x, res = torch.randn(1, 8, 30), torch.randn(1, 8, 30)
    with torch.no_grad():
        plain = conv(x)
        assert (from_rows(conv(to_rows(x), slope=0.1)) - F.leaky_relu(plain, 0.1)).abs().max() <= 1e-6
        r = to_rows(res)
        assert (from_rows(conv(to_rows(x), residual=r)) - (plain + res)).abs().max() <= 1e-6
        assert torch.equal(r, to_rows(res))                                   # residual untouched
        assert (conv(x, slope=0.2, residual=res) - (F.leaky_relu(plain, 0.2) + res)).abs().max() <= 1e-6


@pytest.mark.parametrize("layout", ["ncw", "rows", "rows-strided"])
def test_conv_into_adds_into_the_residual_in_place(layout):
    conv = _ready(Conv1d(8, 8, 5, 2))
    x, res = torch.randn(2, 8, 30), torch.randn(2, 8, 30)
    with torch.no_grad():
        want = conv(x) + res
        if layout == "ncw":
            xi, r = x, res.clone()
        elif layout == "rows":
            xi, r = to_rows(x), to_rows(res)
        else:   # a residual that is not channels-last contiguous still gets the sum, in place
            xi, r = to_rows(x), to_rows(torch.cat([res, res], dim=-1))[..., :30]
        out = conv(xi, residual=r, into=True)
    assert out is r
    got = out if layout == "ncw" else from_rows(out)
    assert (got - want).abs().max() <= 1e-6


@pytest.mark.parametrize("block", [lambda: ResBlock1(8, 5, (1, 3)), lambda: ResBlock2(8, 3, (1, 2))],
                         ids=["resblock1", "resblock2"])
def test_resblock_shared_activation_equals_its_own(block):
    """mrf computes lrelu(x) once for all blocks of a stage: same result, x and the activation untouched."""
    b = _ready(block())
    x = to_rows(torch.randn(1, 8, 40))
    act = F.leaky_relu(x, b.slope)
    x0, act0 = x.clone(), act.clone()
    with torch.no_grad():
        assert torch.equal(b(x, activated=act), b(x))
    assert torch.equal(x, x0) and torch.equal(act, act0)


def test_padded_without_mask_would_differ():
    """Negative control: the same padded run without ValidLength differs near the end."""
    block = _ready(ResBlock1(8, 3, (1, 3, 5)))
    x = torch.randn(1, 8, 23)
    xp = torch.cat([x, torch.randn(1, 8, 9) * 5], dim=-1)
    with torch.no_grad():
        diff = (block(xp)[..., :23] - block(x)).abs().max()
    assert diff > 1e-2


# ---------------------------------------------------------------------------------- receptive field

def _measured_reach(run, steps: int, at: int) -> tuple[int, int]:
    """Outputs that change when input step `at` changes: (how far left, how far right) of `at`."""
    x = torch.randn(1, 8, steps)
    x2 = x.clone()
    x2[..., at] += 3.0
    with torch.no_grad():
        d = (run(x2) - run(x)).abs().amax(dim=(0, 1))
    changed = torch.nonzero(d > 0).flatten()
    return at - int(changed.min()), int(changed.max()) - at


@pytest.mark.parametrize("kind", ["resblock1", "resblock2", "act"])
def test_declared_reach_covers_measured(kind):
    if kind == "resblock1":
        block = _ready(ResBlock1(8, 5, (1, 3)))
    elif kind == "resblock2":
        block = _ready(ResBlock2(8, 3, (2, 6)))
    else:
        block = _ready(Activation1d(8, Snake(8)))
    reach = block.reach()                             # from the block's own layers
    left, right = _measured_reach(block, 80, 40)
    # an output at t depends on inputs [t - reach.left, t + reach.right], so input t0 moves outputs
    # [t0 - reach.right, t0 + reach.left]
    assert left <= reach.right and right <= reach.left
    assert left > 0 and right > 0


def test_reach_arithmetic():
    r = Reach.conv(7) + Reach.conv_transpose(16, 8, 4, rate=1)
    assert r == Reach(Fraction(3) + Fraction(11, 8), Fraction(3) + Fraction(4, 8))
    assert r.frames() == (5, 4)
    assert Reach.widest([Reach(Fraction(1), Fraction(5)), Reach(Fraction(2), Fraction(1))]) == \
        Reach(Fraction(2), Fraction(5))


# --------------------------------------------------------------------------------------- snake

def test_snake_and_snakebeta_formulas():
    x = torch.randn(2, 4, 9)
    s = _ready(Snake(4, logscale=True))
    a = torch.exp(s.alpha).view(1, -1, 1)
    assert torch.allclose(s(x), x + torch.sin(a * x) ** 2 / (a + 1e-9), atol=1e-6)
    sb = _ready(SnakeBeta(4, logscale=False), seed=1)
    a, b = sb.alpha.view(1, -1, 1), sb.beta.view(1, -1, 1)
    assert torch.allclose(sb(x), x + torch.sin(a * x) ** 2 / (b + 1e-9), atol=1e-5)


def test_snake_derived_follow_loaded_weights():
    """reset_derived runs after the weights are assigned (load_module), on the loaded values."""
    ckpt = Checkpoint.from_tensors({"alpha": torch.full((3,), math.log(2.0)), "beta": torch.zeros(3)})
    m = load_module(lambda: SnakeBeta(3, logscale=True), ckpt, WeightMap([Rule("alpha", "alpha"),
                                                                           Rule("beta", "beta")]))
    assert torch.allclose(m.freq.flatten(), torch.full((3,), 2.0))
    assert torch.allclose(m.inv.flatten(), torch.ones(3))


@pytest.mark.parametrize("rows", [False, True])
def test_numpy_sine_is_the_sine_position_for_position(rows):
    """The host sine: within one float32 ulp of ATen's, and a value's sine does not depend on where it
    lies (offsets, lengths, masked tails): what keeps stream == one-shot exact."""
    x = torch.randn(1, 16, 1, 301) * 20 if rows else torch.randn(3, 5, 301) * 20
    x = x.contiguous(memory_format=torch.channels_last) if rows else x
    got = sin_(x.clone(), "numpy")
    assert got.stride() == x.stride()
    assert (got - torch.sin(x)).abs().max() <= 1.2e-7
    flat = x.flatten()
    whole = sin_(flat.clone(), "numpy")
    for start, n in [(0, 1), (1, 17), (5, 64), (13, 1000), (31, flat.numel() - 31)]:
        assert torch.equal(sin_(flat[start:start + n].clone(), "numpy"), whole[start:start + n])


def test_numpy_sine_leaves_recorded_and_autograd_calls_to_aten():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    snake = _ready(SnakeBeta(4))
    assert ops.select(snake, "cpu", prefer={"snake_sine": "numpy"}) == {"snake_sine": {"numpy": 1}}
    x = torch.randn(2, 4, 33)
    with torch.no_grad(), Ops() as mode:
        recorded = snake(x)
    assert "aten.sin_.default" in mode.seen                      # a recording mode sees the op
    with torch.no_grad():
        host = snake(x)
    assert (host - recorded).abs().max() <= 1e-6
    g = x.clone().requires_grad_()
    snake(g).sum().backward()                                   # autograd: ATen's, differentiable
    assert g.grad is not None
    assert pick_sine() in SINES
    with pytest.raises(ConfigError, match="no form 'fast'"):
        ops.select(snake, "cpu", prefer={"snake_sine": "fast"})


# ------------------------------------------------------------------------------- anti-aliasing

def test_kaiser_sinc_filter_matches_numpy_definition():
    f = kaiser_sinc_filter1d(0.25, 0.3, 12).double().numpy()
    half = 6
    attenuation = 2.285 * (half - 1) * math.pi * (4 * 0.3) + 7.95
    assert attenuation > 50
    beta = 0.1102 * (attenuation - 8.7)
    t = np.arange(-half, half) + 0.5
    ref = 2 * 0.25 * np.kaiser(12, beta) * np.sinc(2 * 0.25 * t)
    ref /= ref.sum()
    assert np.abs(f - ref).max() < 1e-6
    assert abs(f.sum() - 1) < 1e-6 and np.allclose(f, f[::-1])


def test_upsample_downsample_shapes_and_dc():
    up, down = _ready(UpSample1d(3)), _ready(DownSample1d(3))
    x = torch.full((1, 3, 20), 0.7)
    y = up(x)
    assert y.shape == (1, 3, 40) and torch.allclose(y, torch.full_like(y, 0.7), atol=1e-5)
    z = down(y)
    assert z.shape == (1, 3, 20) and torch.allclose(z, x, atol=1e-5)


@pytest.mark.parametrize("kind", [UpSample1d, DownSample1d])
@pytest.mark.parametrize("steps,batch", [(24, 1), (25, 2), (301, 1)])
def test_resampler_edges_in_one_op_change_no_bit(kind, steps, batch):
    """Both replicate-padding edge terms added through one view of y's two ends (`_edge_pair`) give the
    two-slice result bit for bit."""
    m = _ready(kind(16))
    x = to_rows(torch.randn(batch, 16, steps) * 3)
    one = m(x.clone())
    m.edge_pair = None
    assert torch.equal(one, m(x.clone()))


def test_upsample_is_the_transposed_conv_definition():
    """Independent check of the trim arithmetic: interleave zeros, pad, low-pass, x ratio."""
    up = _ready(UpSample1d(2))
    x = torch.randn(1, 2, 15)
    k = kaiser_sinc_filter1d(0.25, 0.3, 12)
    xp = F.pad(x, (5, 5), mode="replicate")
    stuffed = torch.zeros(1, 2, xp.shape[-1] * 2 - 1)
    stuffed[..., ::2] = xp
    full = 2 * F.conv1d(F.pad(stuffed, (11, 11)), k.flip(0).view(1, 1, -1).expand(2, 1, -1), groups=2)
    assert torch.allclose(up(x), full[..., 15:15 + 30], atol=1e-6)


# ------------------------------------------------------------------------------- weight norm

@pytest.mark.filterwarnings("ignore:.*weight_norm.*:FutureWarning")
@pytest.mark.parametrize("form", ["plain", "legacy", "parametrized"])
def test_conv_rules_fold_every_weight_norm_form(form):
    torch.manual_seed(0)
    conv = nn.Conv1d(4, 6, 3)
    if form == "legacy":
        conv = torch.nn.utils.weight_norm(conv)
    elif form == "parametrized":
        conv = torch.nn.utils.parametrizations.weight_norm(conv)
    with torch.no_grad():
        for p in conv.parameters():
            p.mul_(1.5 + torch.rand_like(p))
    sd = {f"layer.{k}": v.detach().clone() for k, v in conv.state_dict().items()}
    m = load_module(lambda: nn.Conv1d(4, 6, 3), Checkpoint.from_tensors(sd),
                    WeightMap(conv_rules("layer", "")))
    x = torch.randn(2, 4, 11)
    with torch.no_grad():
        assert (m(x) - conv(x)).abs().max() < 1e-5


def test_conv_rules_missing_weight_is_reported():
    from flashrt.errors import CheckpointError

    with pytest.raises(CheckpointError, match="weight"):
        load_module(lambda: nn.Conv1d(4, 6, 3), Checkpoint.from_tensors({"layer.bias": torch.zeros(6)}),
                    WeightMap(conv_rules("layer", "")))


# ------------------------------------------------------------------------- phase-split dilated convs

def _dilated(cin: int, cout: int, kernel: int, dilation: int, seed: int = 0) -> Conv1d:
    torch.manual_seed(seed)
    conv = Conv1d(cin, cout, kernel, dilation).requires_grad_(False)
    nn.init.normal_(conv.weight, std=1 / math.sqrt(cin * kernel))
    nn.init.normal_(conv.bias, std=0.1)
    conv.reset_derived()
    conv.phase_split = True
    return conv


@pytest.mark.parametrize("kernel,dilation,steps,batch", [(3, 5, 100, 1), (7, 3, 61, 2), (11, 5, 45, 1),
                                                         (3, 2, 7, 2)])
@pytest.mark.parametrize("epilogue", ["none", "slope", "residual", "into"])
def test_phase_split_conv_matches_float64(kernel, dilation, steps, batch, epilogue):
    conv = _dilated(12, 16 if epilogue in ("none", "slope") else 12, kernel, dilation)
    x = torch.randn(batch, 12, steps)
    res = torch.randn(batch, conv.out_channels, steps)
    want = F.conv1d(x.double(), conv.weight.double(), conv.bias.double(), padding=conv.padding,
                    dilation=dilation)
    residual = to_rows(res)
    kwargs = {"none": {}, "slope": {"slope": 0.1}, "residual": {"residual": residual},
              "into": {"residual": residual, "into": True}}[epilogue]
    rows = conv(to_rows(x), **kwargs)
    want = F.leaky_relu(want, 0.1) if epilogue == "slope" else want
    want = want + res.double() if epilogue in ("residual", "into") else want
    assert rows.is_contiguous(memory_format=torch.channels_last)
    assert (from_rows(rows).double() - want).abs().max() <= 3e-6
    assert torch.equal(from_rows(residual), from_rows(rows) if epilogue == "into" else res)


@pytest.mark.parametrize("kernel,dilation", [(3, 5), (7, 3), (11, 5)])
def test_phase_split_conv_is_position_invariant(kernel, dilation):
    """A window computes every sample bit for bit as the whole sequence does, wherever it starts."""
    conv = _dilated(64, 64, kernel, dilation)
    x = to_rows(torch.randn(1, 64, 3000))
    full = from_rows(conv(x))
    reach = dilation * (kernel - 1) // 2
    for start, stop in [(1000, 2200), (1001, 2999), (7, 1500)]:
        part = from_rows(conv(x[..., start:stop].contiguous(memory_format=torch.channels_last)))
        lo, hi = start + reach, stop - reach
        assert torch.equal(full[..., lo:hi], part[..., lo - start:hi - start])


# ------------------------------------------------------------------ the invariant policy: equal arithmetic

INVARIANT_BLOCKS = {
    "activation1d": lambda: Activation1d(64, SnakeBeta(64, logscale=True)),
    "conv-dilated": lambda: Conv1d(64, 64, 7, 3),
    "conv-transpose": lambda: ConvTranspose1d(64, 32, 16, 8),
    "resblock1": lambda: ResBlock1(64, 11, (1, 3, 5)),
}


@pytest.mark.parametrize("name", list(INVARIANT_BLOCKS))
def test_invariant_policy_padded_run_equals_unpadded_bit_for_bit(name):
    """A padded window (the stream's last one) and an unpadded run round alike at every valid output."""
    torch.manual_seed(1)
    block = _ready(INVARIANT_BLOCKS[name]())
    apply_conv_policy(block, POLICIES["invariant"])
    assert _padded_equals_exact(block, torch.randn(1, 64, 150), pad=37, rows=True) == 0.0


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN weight packing")
@pytest.mark.parametrize("policy", ["direct", "invariant"])
def test_packed_conv_weights_change_no_bit(policy):
    """Conv weights reordered once at load into oneDNN's layout (direct, phase-split, polyphase) give the
    plain weights' results bit for bit, epilogues included."""
    block = _ready(ResBlock1(32, 7, (1, 3, 5)))
    up = _ready(ConvTranspose1d(32, 16, 8, 4))
    for m in (block, up):
        apply_conv_policy(m, POLICIES[policy])
    convs = [m for m in block.modules() if isinstance(m, Conv1d)]
    assert all(c.packed is not None and c.packed.is_mkldnn for c in convs)
    assert any(c.packed_phases for c in convs) == (policy == "invariant")
    assert (up.poly_packed is not None) == (policy == "invariant")
    x = to_rows(torch.randn(2, 32, 97))
    with torch.no_grad():
        packed = block(x.clone()), up(x.clone()), convs[1](x, slope=0.1)
        for m in [*convs, up]:
            m.packed = m.poly_packed = None
        plain = block(x.clone()), up(x.clone()), convs[1](x, slope=0.1)
    for a, b in zip(packed, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cin,cout,kernel,stride",
                         [(16, 8, 16, 8), (8, 4, 4, 2), (6, 3, 11, 3), (4, 4, 6, 2)])
def test_polyphase_upsampler_matches_float64(cin, cout, kernel, stride):
    up = _ready(ConvTranspose1d(cin, cout, kernel, stride))
    x = torch.randn(2, cin, 13)
    want = F.conv_transpose1d(x.double(), up.weight.double(), up.bias.double(), stride, up.padding)
    up.set_polyphase(True)
    rows = up(to_rows(x))
    assert rows.is_contiguous(memory_format=torch.channels_last)
    assert (from_rows(rows).double() - want).abs().max() <= 1e-5
    assert polyphase_weight(up.weight, stride, up.padding[0])[0].shape[0] == stride * cout


def test_polyphase_upsampler_is_position_invariant():
    up = _ready(ConvTranspose1d(256, 128, 16, 8))
    up.set_polyphase(True)
    x = to_rows(torch.randn(1, 256, 400))
    full = from_rows(up(x))
    for start, stop in [(100, 300), (101, 399)]:
        part = from_rows(up(x[..., start:stop].contiguous(memory_format=torch.channels_last)))
        lo, hi = (start + 2) * 8, (stop - 2) * 8
        assert torch.equal(full[..., lo:hi], part[..., lo - start * 8:hi - start * 8])


# ------------------------------------------------------------------ native anti-aliased activation

def _native_or_skip():
    from flashrt.ops import csrc_cpu

    if csrc_cpu.load() is None:
        pytest.skip("the CPU kernels cannot be built here (no C compiler)")


def _definition64(act: Activation1d, x: torch.Tensor) -> torch.Tensor:
    """The anti-aliased snake in float64 from its definition: replicate pad, transposed conv, trim;
    snake; replicate pad, strided low-pass (rows in, rows out)."""
    up, down, snake = act.upsample, act.downsample, act.act
    x = from_rows(x).double()
    c = x.shape[1]
    f_up = up.filter.double()
    y = F.conv_transpose1d(F.pad(x, (up.pad, up.pad), mode="replicate"), f_up, stride=2, groups=c)
    y = y[..., up.trim_left:y.shape[-1] - up.trim_right]
    z = y + snake.inv.double() * torch.sin(snake.freq.double() * y) ** 2
    z = F.pad(z, (down.pad_left, down.pad_right), mode="replicate")
    return to_rows(F.conv1d(z, down.filter.double(), stride=2, groups=c))


def use_activation_kernel(act, form: str) -> int:
    """``act``'s anti-aliased snakes on ``form`` of the op `AA_SNAKE` (its other slots untouched)."""
    slots = [slot for _, _, slot in ops.slots(act) if slot.op.name == "aa_snake"]
    for slot in slots:
        slot.use(form)
    return len(slots)


@pytest.mark.parametrize("channels,steps,batch", [(16, 1, 1), (16, 5, 2), (48, 13, 1), (64, 64, 1),
                                                  (96, 200, 2), (128, 301, 1)])
@pytest.mark.parametrize("snake", [Snake, SnakeBeta])
def test_native_activation_matches_the_definition(channels, steps, batch, snake):
    """The C kernel against the float64 definition, as close as the torch form is (it also runs
    replicate padding at both ends, short sequences included); large snake arguments included."""
    _native_or_skip()
    act = _ready(Activation1d(channels, snake(channels)), seed=channels + steps)
    x = to_rows(torch.randn(batch, channels, steps, generator=torch.Generator().manual_seed(1)) * 3)
    ref = _definition64(act, x)
    with torch.no_grad():
        torch_form = act(x)
        assert use_activation_kernel(act, "native") == 1
        native = act(x)
    assert native.shape == x.shape and native.is_contiguous(memory_format=torch.channels_last)
    scale = ref.abs().max()
    err_torch = float((torch_form.double() - ref).abs().max() / scale)
    err_native = float((native.double() - ref).abs().max() / scale)
    assert err_native <= max(2 * err_torch, 1e-6), (err_native, err_torch)
    assert not torch.equal(native, torch_form) or steps == 1   # the kernel really ran


def test_native_activation_is_position_invariant():
    """A window computes each sample away from its ends exactly as the whole sequence does (the tiles,
    channel blocks and batch rows add in one order): what keeps a stream equal to the one-shot call."""
    _native_or_skip()
    act = _ready(Activation1d(80, SnakeBeta(80)))
    use_activation_kernel(act, "native")
    x = to_rows(torch.randn(1, 80, 700) * 2)
    with torch.no_grad():
        whole = act(x)
        for start, n in [(0, 50), (3, 64), (77, 129), (250, 300), (640, 60)]:
            part = act(x[..., start:start + n].contiguous(memory_format=torch.channels_last))
            assert torch.equal(part[..., 6:n - 6], whole[..., start + 6:start + n - 6]), (start, n)
        two = act(torch.cat([x[..., :300], x[..., 300:600]]).contiguous(memory_format=torch.channels_last))
        assert torch.equal(two[1:, ..., 6:294], whole[..., 306:594])


def test_native_activation_leaves_other_calls_to_torch():
    """Padded graphs (ValidLength), recording modes, channels not a multiple of 16 and (B, C, T) inputs
    run the torch form, bit for bit the same as with the kernel off."""
    _native_or_skip()
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def both(act, *args):
        with torch.no_grad():
            use_activation_kernel(act, "torch")
            off = act(*args)
            use_activation_kernel(act, "native")
            return off, act(*args)

    act = _ready(Activation1d(32, SnakeBeta(32)))
    x = to_rows(torch.randn(1, 32, 40))
    padded = to_rows(torch.randn(1, 32, 48))
    for args in [(padded, ValidLength(torch.tensor([40]), 48)), (from_rows(x),)]:
        off, on = both(act, *args)
        assert torch.equal(off, on)
    off, on = both(_ready(Activation1d(24, SnakeBeta(24))), to_rows(torch.randn(1, 24, 40)))
    assert torch.equal(off, on)
    use_activation_kernel(act, "native")
    with torch.no_grad(), Ops():
        recorded = act(x)
    use_activation_kernel(act, "torch")
    with torch.no_grad():
        assert torch.equal(recorded, act(x))
    with pytest.raises(ConfigError, match="no form 'fast'"):
        use_activation_kernel(act, "fast")
