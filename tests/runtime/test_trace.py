"""Trace backend: replay equals eager bit for bit, follows new inputs, refuses what a graph can't hold."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from flashrt.errors import CaptureError
from flashrt.runtime.buffers import Buffers, BufferSpec
from flashrt.runtime.trace import CaptureRefused, TraceBackend, TraceGraph


def _run_pair(make, steps: int):
    """Capture one instance with trace, run an identical one eagerly; feed both the same inputs."""
    _, traced, fn_t, feed_t = make(seed=0)
    _, eager, fn_e, feed_e = make(seed=0)
    graph = TraceBackend().capture(fn_t, traced)
    previous = None
    for step in range(steps):
        feed_t(step, torch.Generator().manual_seed(step))
        feed_e(step, torch.Generator().manual_seed(step))
        graph.replay()
        with torch.no_grad():
            fn_e()
        for name in traced:
            assert torch.equal(traced[name], eager[name]), f"step {step}: buffer {name} differs from eager"
        out = next(reversed(traced.values())).clone()
        if previous is not None:
            assert not torch.equal(out, previous), "replay did not follow the new inputs"
        previous = out
    return graph


def test_transformer_block_replay_equals_eager_bit_for_bit(make_block):
    graph = _run_pair(make_block, steps=4)
    names = graph.op_names()
    assert "aten.index_copy_.default" in names and "aten.index_put_.default" in names
    assert any("scaled_dot_product" in n for n in names)


def test_conv_stack_replay_equals_eager_bit_for_bit(make_conv):
    graph = _run_pair(make_conv, steps=3)
    names = graph.op_names()
    assert "aten.convolution.default" in names and "aten.tanh.out" in names


def test_kv_cache_accumulates_across_replays(make_block):
    _, b, fn, feed = make_block()
    graph = TraceBackend().capture(fn, b)
    b["k_cache"].zero_()
    for step in range(3):
        feed(step, torch.Generator().manual_seed(step))
        graph.replay()
    written = b["k_cache"].abs().sum(dim=(0, 1, 3)) > 0
    assert written[:12].all() and not written[12:].any()


def test_replay_does_not_reuse_capture_values():
    x, out = torch.ones(3), torch.zeros(3)
    graph = TraceBackend().capture(lambda: out.copy_(x * 2 + 1), {"x": x, "out": out})
    x.copy_(torch.tensor([5.0, -1.0, 0.5]))
    graph.replay()
    assert torch.equal(out, torch.tensor([11.0, -1.0, 2.0]))


def test_views_inplace_out_and_constants():
    x, out = torch.randn(2, 6), torch.zeros(2, 8)
    table = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])

    def fn():
        h = x * table  # constant held by reference
        h.add_(torch.tensor(0.5))  # in-place on an intermediate, literal constant
        torch.mul(h, 2.0, out=out[:, :6])  # out= into a view of a static buffer
        out[:, 6:].copy_(torch.zeros(2, 2) + x.sum(-1, keepdim=True))  # static-size allocation

    graph = TraceBackend().capture(fn, {"x": x, "out": out})
    for seed in range(3):
        x.copy_(torch.randn(2, 6, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        want = torch.cat([(x * table + 0.5) * 2.0, (torch.zeros(2, 2) + x.sum(-1, keepdim=True))], dim=1)
        assert torch.equal(out, want)


def test_weights_are_read_by_reference_and_python_values_are_frozen():
    lin = torch.nn.Linear(4, 4)
    x, out = torch.randn(1, 4), torch.zeros(1, 4)
    scale = {"value": 2.0}
    graph = TraceBackend().capture(lambda: out.copy_(lin(x) * scale["value"]), {"x": x, "out": out})
    with torch.no_grad():
        lin.weight.mul_(-1.0)  # in-place weight update: seen by the replay
    scale["value"] = 100.0  # a Python value: frozen at capture (documented)
    graph.replay()
    with torch.no_grad():
        assert torch.equal(out, lin(x) * 2.0)


def test_state_buffer_updates_repeat_on_every_replay():
    counter, out = torch.zeros(1), torch.zeros(1)

    def fn():
        counter.add_(1)
        out.copy_(counter * 10)

    graph = TraceBackend().capture(fn, {"counter": counter, "out": out})
    for _ in range(3):
        graph.replay()
    assert counter.item() == 4 and out.item() == 40  # one capture run + three replays


def test_reallocated_buffer_is_caught_on_replay():
    bufs = Buffers([BufferSpec("x", (2,), torch.float32), BufferSpec("y", (2,), torch.float32, "output")])
    graph = TraceBackend().capture(lambda: bufs["y"].copy_(bufs["x"] + 1), bufs)
    bufs.populate({"x": torch.tensor([1.0, 2.0])})
    graph.replay()
    assert torch.equal(bufs["y"], torch.tensor([2.0, 3.0]))
    bufs.tensors["x"] = torch.zeros(2)  # replaced instead of written into
    with pytest.raises(CaptureError, match="'x'"):
        graph.replay()


def test_data_of_an_intermediate_is_recorded_as_detach():
    x, out = torch.ones(2), torch.zeros(2)
    graph = TraceBackend().capture(lambda: out.copy_((x * 2).data + 1), {"x": x, "out": out})
    assert "aten.detach.default" in graph.op_names()
    x.fill_(5.0)
    graph.replay()
    assert torch.equal(out, torch.full((2,), 11.0))


def test_intermediates_are_released_after_last_use():
    x, out = torch.randn(4), torch.zeros(4)
    graph = TraceBackend().capture(lambda: out.copy_((x + 1).relu() * 3), {"x": x, "out": out})
    released = sorted(s for step in graph.steps for s in step.release)
    assert released == list(range(graph.nslots))
    assert isinstance(graph, TraceGraph) and len(graph) == 4


# ---------------------------------------------------------------------------------------------
# Refusals. Each case is one statement on the line after its `def`; the error must name the op
# and that line of this file.

T = torch.tensor([3.0, 1.0, 2.0])
OUT = torch.zeros(3)


def item():
    return T.sum().item()


def cpu():
    return T.cpu()


def tolist():
    return T.tolist()


def numpy():
    return T.numpy()


def branch():
    return OUT.copy_(T if T.sum() > 0 else -T)


def to_int():
    return int(T[0])


def to_float():
    return float(T[0])


def as_index():
    return [1, 2, 3, 4][T.long()[1]]


def printing():
    return print(T)


def nonzero():
    return T.nonzero()


def bool_mask_read():
    return T[T > 1.5]


def bool_mask_write():
    OUT[T > 1.5] = 0.0


def masked_select():
    return torch.masked_select(T, T > 1.5)


def unique():
    return torch.unique(T)


def arange_of_max():
    return torch.arange(T.max())


def zeros_of_int():
    return torch.zeros(int(T[2]))


def randn():
    return OUT.copy_(torch.randn(3))


def dropout():
    return F.dropout(T, 0.5, training=True)


def equal():
    return torch.equal(T, OUT)


def repeat_interleave():
    return torch.repeat_interleave(T, T.long())


def resize_buffer():
    OUT.resize_(6)


REFUSALS = [  # (fn, the refused op exactly as CaptureRefused.op names it)
    (item, ".item()"),
    (cpu, ".cpu()"),
    (tolist, ".tolist()"),
    (numpy, ".numpy()"),
    (branch, "bool(tensor)"),
    (to_int, "int(tensor)"),
    (to_float, "float(tensor)"),
    (as_index, "tensor used as a Python index (__index__)"),
    (printing, "repr(tensor)"),
    (nonzero, "aten.nonzero"),
    (bool_mask_read, "boolean-mask indexing (aten.index with a bool index)"),
    (bool_mask_write, "boolean-mask indexing (aten.index_put_ with a bool index)"),
    (masked_select, "aten.masked_select"),
    (unique, "aten._unique2"),
    (arange_of_max, "torch.arange with a tensor-valued size"),
    (zeros_of_int, "int(tensor)"),
    (randn, "aten.randn (random)"),
    (dropout, "aten.bernoulli_ (random)"),
    (equal, "aten.equal"),
    (repeat_interleave, "aten.repeat_interleave without output_size"),
    (resize_buffer, "aten.resize_ on buffer 'OUT'"),
]


@pytest.mark.parametrize(("fn", "op"), REFUSALS, ids=[fn.__name__ for fn, _ in REFUSALS])
def test_refusal_names_op_and_source_line(fn, op):
    with pytest.raises(CaptureError) as info:
        TraceBackend().capture(fn, {"T": T, "OUT": OUT})
    message = str(info.value)
    assert isinstance(info.value, CaptureRefused)
    assert info.value.op == op  # the attribute: the echoed source line alone would satisfy `op in message`
    assert message.startswith(f"cannot capture {op} at "), message
    assert f"{__file__}:{fn.__code__.co_firstlineno + 1}" in message, message
    assert "Fix:" in message


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_out_of_wrong_shape_into_a_static_buffer_is_refused():
    small = torch.zeros(2)
    with pytest.raises(CaptureRefused, match=r"aten.add on buffer 'small'") as info:
        TraceBackend().capture(lambda: torch.add(T, 1, out=small), {"small": small})
    assert "resized or re-pointed" in str(info.value)


def test_refusal_inside_a_module_names_the_module_line():
    class Net(torch.nn.Module):
        def forward(self, x):
            return x.mean().item()

    with pytest.raises(CaptureRefused) as info:
        TraceBackend().capture(lambda: Net()(T))
    assert info.value.location == f"{__file__}:{Net.forward.__code__.co_firstlineno + 1}"


def test_modes_are_removed_after_a_refusal():
    with pytest.raises(CaptureRefused):
        TraceBackend().capture(item)
    assert T.sum().item() == 6.0  # no recorder left active: host reads work again
    assert bool(T[0] > 0)


def test_capture_needs_a_callable():
    with pytest.raises(CaptureError, match="callable"):
        TraceBackend().capture(OUT)
