"""flashrt.profile.alloc: what counts as an allocation, the paused replay, the per-call tally."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashrt.profile.alloc import CallAllocationCounter, count_allocations, count_infer_allocations, paused


def test_fresh_tensors_and_host_data_count_views_and_inplace_writes_do_not():
    x, out = torch.randn(4, 4), torch.empty(4, 4)
    arr = np.zeros(3, np.float32)

    def body(counter):
        y = x + 1                          # 1
        y.mul_(2)                          # in place: 0
        out.copy_(y.view(16).view(4, 4))   # views, a copy into an existing tensor: 0
        torch.add(x, 1, out=out)           # out=: 0
        torch.from_numpy(arr)              # host data entering torch (lift_fresh): 1
        torch.tensor([1, 2])               # 1
        torch.aminmax(x)                   # two outputs: 2
        with counter.pause():
            x * 3                          # left out

    counter = count_allocations(body)
    assert counter.allocations == 5
    assert dict(counter.by_op) == {"aten.add.Tensor": 1, "aten.lift_fresh.default": 2,
                                   "aten.aminmax.default": 2}
    assert dict(counter.by_device) == {"cpu": 5}


class _Frontend:
    def replay(self, bucket):
        return torch.randn(8, 8) @ torch.randn(8, 8)  # the "step": 3 allocations, never counted


class _Policy:
    """infer: 2 allocations of its own around a replay that allocates 3."""

    def __init__(self):
        self.frontend, self.calls = _Frontend(), 0

    def infer(self, obs, scale=1.0):
        self.calls += 1
        t = torch.as_tensor(obs) * scale
        self.frontend.replay(0)
        return t


def test_infer_counts_leave_the_replay_out_and_skip_the_warmup():
    pol = _Policy()
    count = count_infer_allocations(pol, [1.0, 2.0], calls=3, warmup=2, scale=2.0)
    assert pol.calls == 5
    assert count.per_call == [2, 2, 2] and count.constant == 2
    assert dict(count.by_op) == {"aten.lift_fresh.default": 3, "aten.mul.Tensor": 3}
    assert "replay" not in vars(pol.frontend)  # the pausing wrapper is gone again


def test_paused_removes_its_wrapper_on_an_exception():
    frontend, counter = _Frontend(), CallAllocationCounter()
    with pytest.raises(RuntimeError), paused(frontend, "replay", counter):
        assert "replay" in vars(frontend)
        raise RuntimeError
    assert "replay" not in vars(frontend)


def test_constant_is_none_when_calls_differ():
    from flashrt.profile.alloc import AllocationCount

    assert AllocationCount([3, 4]).constant is None and AllocationCount([]).constant is None
