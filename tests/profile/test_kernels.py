"""Kernels per replay (`flashrt.profile.kernels`): exact counts of hand-checked steps, views never
counted, the same count on meta, the CPU and under inference mode; tensor allocations."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import flashrt.ops.decoder  # noqa: F401  (registers the flashrt:: custom ops)
from flashrt.profile.kernels import (
    ATTENTION,
    BIAS_ALIGN,
    AllocationCounter,
    bias_aligned,
    count_kernels,
    sdpa_backend,
)

DEVICES = ("meta", "cpu")


def _rand(*shape, device="cpu"):
    return torch.randn(shape) if device == "cpu" else torch.empty(shape, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_hand_checked_step(device):
    """mm, add, add_, copy_: four kernels; the eleven views and metadata calls around them: none."""
    x, w, b = _rand(6, 4, device=device), _rand(4, 8, device=device), _rand(8, device=device)
    out = _rand(2, 3, 8, device=device)

    def step():
        y = (x @ w).view(2, 3, 8)                                   # mm (+ a view)
        y = y.transpose(0, 1).transpose(0, 1).unsqueeze(0).squeeze(0)  # views
        z = y + 1.0                                                 # add
        z.add_(b.expand(2, 3, 8))                                   # add_ (expand: a view)
        z = z.reshape(6, 8).reshape(2, 3, 8)[:, :, :].detach()       # views
        out.copy_(z.to(z.dtype).contiguous())                       # copy_ (no-op .to / .contiguous)

    count = count_kernels(step)
    assert count.total == 4
    assert dict(count.by_op) == {"aten.mm.default": 1, "aten.add.Tensor": 1, "aten.add_.Tensor": 1,
                                 "aten.copy_.default": 1}


@pytest.mark.parametrize("device", DEVICES)
def test_views_alone_are_no_kernels(device):
    x = _rand(2, 3, 4, device=device)

    def views():
        x.view(6, 4).t().permute(1, 0).expand(2, 6, 4).as_strided((2, 2), (1, 1))
        x.unsqueeze(1).squeeze(1).select(0, 1).narrow(0, 0, 2).split(1, dim=0)
        x.unbind(0), x.chunk(2, dim=-1), x.flatten(0, 1), x.unflatten(-1, (2, 2)), x.reshape(24)
        torch.ops.aten.alias.default(x), x.detach(), torch.empty(5, device=device), torch.empty_like(x)

    assert count_kernels(views).total == 0


@pytest.mark.parametrize("device", DEVICES)
def test_copies_that_views_cannot_express_are_kernels(device):
    x = _rand(3, 4, device=device)
    counts = [count_kernels(f).total for f in (
        lambda: x.t().contiguous(),          # clone
        lambda: x.t().reshape(12),           # reshape that must copy
        lambda: x.to(torch.bfloat16),        # a real cast
        lambda: torch.zeros(3, device=device),  # a fill
        lambda: x.float(),                   # already float32: none
    )]
    assert counts == [1, 1, 1, 1, 0]


def _block(device, dtype):
    torch.manual_seed(0)
    block = nn.ModuleDict({"norm": nn.LayerNorm(16), "fc": nn.Linear(16, 32), "out": nn.Linear(32, 16)})
    return block.to(device=device, dtype=dtype)


def _block_step(block, x):
    h = F.gelu(block["fc"](block["norm"](x)), approximate="tanh")  # layer_norm, addmm, gelu
    return x + block["out"](h)                                    # addmm, add


@pytest.mark.parametrize("device", DEVICES)
def test_module_counts_the_same_on_meta_cpu_and_in_inference_mode(device):
    block, x = _block(device, torch.float32), _rand(2, 5, 16, device=device)
    assert count_kernels(lambda: _block_step(block, x)).total == 5
    with torch.inference_mode():  # composite ops reach the counter undecomposed: same kernels
        assert count_kernels(lambda: _block_step(block, x)).total == 5


@pytest.mark.parametrize("device", DEVICES)
def test_fused_attention_is_its_kernel_whatever_it_decomposes_into(device):
    q, k = _rand(1, 2, 5, 8, device=device), _rand(1, 2, 7, 8, device=device)
    bias = torch.zeros(1, 1, 1, 8, device=device)[..., :7]  # rows 8 apart: taken as it is
    count = count_kernels(lambda: F.scaled_dot_product_attention(q, k, k, attn_mask=bias))
    assert count.total == 1 and dict(count.by_op) == {f"{ATTENTION}.efficient": 1}


def _qkv(d=64, heads=(2, 2), dtype=torch.bfloat16, n=(5, 7)):
    return (torch.empty(1, heads[0], n[0], d, dtype=dtype, device="meta"),
            *(torch.empty(1, heads[1], n[1], d, dtype=dtype, device="meta") for _ in range(2)))


def _attention(q, k, v, mask=None, sdpa=None, **kw):
    count = count_kernels(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw), sdpa)
    return dict(count.by_op)


def test_flash_takes_unmasked_half_precision_and_pads_head_dims_not_a_multiple_of_8():
    assert _attention(*_qkv(72)) == {"sdpa.flash": 1}
    assert _attention(*_qkv(36)) == {"sdpa.flash": 1, "sdpa.flash pad head dim": 6}  # q, k, v: fill + copy
    assert sdpa_backend(*_qkv(64, dtype=torch.float32)) == "efficient"  # flash has no float32
    assert sdpa_backend(*_qkv(64), priority=("efficient", "flash")) == "efficient"  # the pinned order


@pytest.mark.parametrize("keys", [611, 762, 7])
def test_efficient_pads_a_bias_whose_rows_are_not_8_apart_on_every_call(keys):
    q, k, v = _qkv(n=(5, keys))
    bias = torch.empty(1, 1, 1, keys, dtype=torch.bfloat16, device="meta")
    assert _attention(q, k, v, bias) == {"sdpa.efficient": 1, "sdpa.efficient pad bias": 2}
    row = BIAS_ALIGN * (-(-keys // BIAS_ALIGN))  # the row padded to a multiple of 8, sliced to the keys
    padded = torch.empty(1, row, dtype=torch.bfloat16, device="meta")[:, None, None, :keys]
    assert _attention(q, k, v, padded) == {"sdpa.efficient": 1} and bias_aligned(padded)
    assert not bias_aligned(torch.empty(1, 1, 8, 1, device="meta").transpose(-1, -2))  # last dim not dense


def test_a_boolean_mask_is_converted_then_padded_if_unaligned():
    q, k, v = _qkv(n=(5, 7))
    mask = torch.empty(1, 1, 1, 7, dtype=torch.bool, device="meta")
    assert _attention(q, k, v, mask) == {"sdpa.efficient": 1, "sdpa.efficient bool mask to bias": 2,
                                         "sdpa.efficient pad bias": 2}


def test_grouped_queries_with_a_mask_take_the_math_path_counted_op_by_op():
    q, k, v = _qkv(heads=(4, 2))
    bias = torch.empty(1, 1, 1, 8, dtype=torch.bfloat16, device="meta")[..., :7]
    assert _attention(q, k, v, enable_gqa=True) == {"sdpa.flash": 1}  # flash folds the groups itself
    ops = _attention(q, k, v, bias, enable_gqa=True)
    assert not any(op.startswith(ATTENTION) for op in ops) and sum(ops.values()) > 3  # matmuls, softmax...


def test_stages_count_by_the_innermost_running_module_and_fused_ops_are_counted_apart():
    outer = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)

    def step():
        y = outer[1].forward(outer(x)) * 2   # 3 addmm (outer, inner, inner called directly), mul (other)
        return torch.ops.flashrt.rms_norm(y, torch.ones(4), None, 1e-6)  # ones (other), the fused op

    count = count_kernels(step, stages={"outer": [outer], "inner": [outer[1]]})
    assert dict(count.by_stage) == {"outer": 1, "inner": 2, "other": 3} and count.total == 6
    assert count.fused == 1 and count.fused_share == 1 / 6
    assert count.report()["stages"] == {"outer": 1, "inner": 2, "other": 3} and count.report()["fused"] == 1
    assert count.to_dict() == {"total": 6, "top": dict(count.by_op.most_common(12))}  # bench results' schema
    assert "forward" not in vars(outer) and "forward" not in vars(outer[1])  # unwrapped after the count


def test_allocations_count_fresh_tensors_and_pause_leaves_out_a_region():
    x, out = torch.randn(4, 4), torch.empty(4, 4)
    with AllocationCounter() as alloc:
        y = x + 1                 # 1
        y.mul_(2)                 # in place: 0
        out.copy_(y.view(16).view(4, 4))  # views and a copy into a static tensor: 0
        torch.empty(3)            # 1 (an allocation, though no kernel)
        with alloc.pause():
            x * 3                 # left out
    assert alloc.allocations == 2
    assert dict(alloc.by_op) == {"aten.add.Tensor": 1, "aten.empty.memory_format": 1}


def test_rms_norm_is_the_one_fused_kernel_a_cuda_build_runs_unless_its_dtypes_differ():
    x, w = torch.empty(3, 64, device="meta"), torch.empty(64, device="meta")
    assert dict(count_kernels(lambda: F.rms_norm(x, (64,), w, 1e-6)).by_op) == {"aten._fused_rms_norm": 1}
    assert count_kernels(lambda: F.rms_norm(x.t().t().view(6, 32), (32,), None)).total == 1
    assert count_kernels(lambda: F.rms_norm(x[:, :32], (32,))).total == 2  # rows not dense: + a copy
    mixed = count_kernels(lambda: F.rms_norm(x.bfloat16(), (64,), w, 1e-6))  # torch's composite fallback
    assert "aten._fused_rms_norm" not in mixed.by_op and mixed.total > 3


def test_the_fused_attention_layout_makes_the_usual_head_merge_a_view():
    q = torch.empty(2, 4, 16, 64, dtype=torch.bfloat16, device="meta")
    count = count_kernels(lambda: F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(2, 16, 256))
    assert dict(count.by_op) == {"sdpa.flash": 1}


def test_a_custom_op_is_one_kernel_only_where_its_cuda_kernel_takes_the_call():
    from flashrt.ops.csrc_ops import CUDA_FORMS

    x, scale = torch.empty(4, 64, dtype=torch.bfloat16, device="meta"), torch.empty(64, device="meta")
    taken = count_kernels(lambda: torch.ops.flashrt.rms_norm(x, scale, None, 1e-6), custom=CUDA_FORMS)
    assert dict(taken.by_op) == {"flashrt.rms_norm.default": 1} and taken.fused == 1
    rows = torch.empty(4, 128, dtype=torch.bfloat16, device="meta")[:, :64]  # rows not dense: the reference
    fallback = count_kernels(lambda: torch.ops.flashrt.rms_norm(rows, scale, None, 1e-6), custom=CUDA_FORMS)
    assert fallback.fused == 0 and fallback.total == 8  # casts in and out, square, mean, +eps, rsqrt, 2 muls
    half = scale.bfloat16()  # the kernel wants a float32 scale
    mixed = count_kernels(lambda: torch.ops.flashrt.rms_norm(x, half, None, 1e-6), custom=CUDA_FORMS)
    assert mixed.fused == 0
    plain = count_kernels(lambda: torch.ops.flashrt.rms_norm(rows, scale, None, 1e-6))  # no forms given
    assert plain.total == 1
