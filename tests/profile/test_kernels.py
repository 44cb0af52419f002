"""Kernels per replay (`flashrt.profile.kernels`): exact counts of hand-checked steps, views never
counted, the same count on meta, the CPU and under inference mode; tensor allocations."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from flashrt.profile.kernels import ATTENTION, AllocationCounter, count_kernels

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
def test_attention_is_one_kernel_whatever_it_decomposes_into(device):
    q, k = _rand(1, 2, 5, 8, device=device), _rand(1, 2, 7, 8, device=device)
    bias = torch.zeros(1, 1, 1, 7, device=device)
    count = count_kernels(lambda: F.scaled_dot_product_attention(q, k, k, attn_mask=bias))
    assert count.total == 1 and dict(count.by_op) == {ATTENTION: 1}


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
