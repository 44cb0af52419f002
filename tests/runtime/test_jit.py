"""The `jit` backend: a step traced over its buffers replays eager's results bit for bit, sees what is
written into its buffers between replays, and refuses moved buffers and a step without buffers."""

from __future__ import annotations

import pytest
import torch

from flashrt.errors import CaptureError, ConfigError
from flashrt.runtime.graphs import Graph, backend_for_device, get_backend


def test_a_block_with_a_kv_cache_replays_eager_bit_for_bit(make_block):
    model, bufs, fn, feed = make_block(seed=1)
    _, ref, ref_fn, ref_feed = make_block(seed=1)
    feed(0, torch.Generator().manual_seed(0))  # capture runs fn (the trace, the warm-ups): real inputs
    with pytest.raises(CaptureError, match="requires_grad_"):
        get_backend("jit").capture(fn, bufs)
    model.requires_grad_(False)
    graph = get_backend("jit").capture(fn, bufs)
    assert isinstance(graph, Graph) and graph.backend == "jit"
    for step in range(4):
        feed(step, torch.Generator().manual_seed(step))
        ref_feed(step, torch.Generator().manual_seed(step))
        graph.replay()
        with torch.no_grad():
            ref_fn()
        assert torch.equal(bufs["out"], ref["out"])
    assert all(torch.equal(bufs[k], ref[k]) for k in ref if k.endswith("cache"))


def test_state_written_in_place_through_views_advances_on_every_replay():
    """In-place writes through slices of a buffer (a decode step's position += 1, token picked) land
    in the buffer; a trace with its buffers as constants lost these (folded copies)."""
    bufs = {"step": torch.zeros(4, dtype=torch.int64), "out": torch.zeros(4, 6, dtype=torch.int64),
            "active": torch.tensor([True, True, False, True])}

    def step():
        rows, active = bufs["step"][:3], bufs["active"][:3]
        at = rows[:, None].clamp(max=5)
        bufs["out"][:3].scatter_(1, at, (rows[:, None] + 10) * active[:, None])
        rows.add_(active.to(torch.int64))

    graph = get_backend("jit", warmup=0).capture(step, bufs)
    assert bufs["step"].tolist() == [1, 1, 0, 0]  # the trace ran once
    for _ in range(3):
        graph.replay()
    assert bufs["step"].tolist() == [4, 4, 0, 0]
    assert bufs["out"][0].tolist() == [10, 11, 12, 13, 0, 0] and bufs["out"][2].tolist() == [0] * 6
    bufs["active"][2] = True  # a new input written between replays is read by the next one
    graph.replay()
    assert bufs["step"].tolist() == [5, 5, 1, 0]


def test_a_replay_of_several_steps_equals_as_many_replays_and_frees_the_gil():
    """`replay(times)` runs the step that many times in one interpreter call (a decode block: the GIL
    handed back once, not per step): the same state as one replay at a time, and another Python
    thread runs while it loops."""
    import threading

    def make():
        bufs = {"x": torch.zeros(3), "n": torch.zeros((), dtype=torch.int64)}

        def step():
            bufs["x"].mul_(0.5).add_(bufs["n"].to(torch.float32))
            bufs["n"].add_(1)
        return get_backend("jit", warmup=0).capture(step, bufs), bufs

    one, a = make()
    many, b = make()
    for _ in range(7):
        one.replay()
    many.replay(7)
    assert torch.equal(a["x"], b["x"]) and int(b["n"]) == 8  # the trace ran once, then 7

    ticks, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks[0] += 1

    other = threading.Thread(target=count)
    other.start()
    try:
        before = ticks[0]
        many.replay(20000)  # one call: the GIL is free while it loops
        during = ticks[0] - before
    finally:
        stop.set()
        other.join(timeout=10)
    assert int(b["n"]) == 20008 and during > 0


def test_moved_buffers_and_steps_without_buffers_are_refused():
    bufs = {"x": torch.zeros(2)}
    graph = get_backend("jit").capture(lambda: bufs["x"].add_(1), bufs)
    bufs["x"] = torch.zeros(2)
    with pytest.raises(CaptureError, match="'x'"):
        graph.replay()
    with pytest.raises(CaptureError, match="named buffers"):
        get_backend("jit").capture(lambda: None)
    with pytest.raises(CaptureError, match="callable"):
        get_backend("jit").capture(torch.zeros(1), bufs)


def test_jit_runs_on_the_cpu_only():
    assert backend_for_device("jit", torch.device("cpu")).name == "jit"
    with pytest.raises(ConfigError, match="does not run on cuda"):
        backend_for_device("jit", torch.device("cuda"))



def test_onednn_packed_weights_become_inputs_and_replay_eager_bit_for_bit():
    """A step over oneDNN-packed weights (no storage: never a graph constant) is traced with them as
    extra inputs, collected by one eager run; replays equal eager's results bit for bit."""
    from flashrt.nn.packed_linear import PackedLinear

    if PackedLinear(torch.zeros(2, 2)).packed is None:
        pytest.skip("no oneDNN packed GEMM in this torch build")
    gen = torch.Generator().manual_seed(3)
    first = PackedLinear(torch.randn(12, 8, generator=gen), torch.randn(12, generator=gen), "tanh")
    second = PackedLinear(torch.randn(8, 12, generator=gen), torch.randn(8, generator=gen))
    bufs = {"x": torch.randn(5, 8, generator=gen), "y": torch.zeros(5, 8)}

    def step():
        h = first(bufs["x"])
        bufs["y"].copy_(second(h, other=bufs["x"]))

    graph = get_backend("jit", warmup=0).capture(step, bufs)
    for _ in range(3):
        bufs["x"].copy_(torch.randn(5, 8, generator=gen))
        graph.replay()
        want = second(first(bufs["x"]), other=bufs["x"])
        assert torch.equal(bufs["y"], want)


def test_views_of_the_buffers_taken_before_capture_are_inputs_read_and_written_on_every_replay():
    """A step built with its views outside (``out = y[:2]`` at build time, ``out.copy_`` inside): the
    views become graph inputs, so replays read what is written into them and their writes land (as
    constants their writes were dropped: nothing of the graph reads them back)."""
    bufs = {"x": torch.zeros(4), "y": torch.zeros(4)}
    src, out = bufs["x"][:2], bufs["y"][:2]

    def step():
        out.copy_(src + 1)

    graph = get_backend("jit").capture(step, bufs)
    for value in (2.0, 5.0):
        bufs["x"].fill_(value)
        graph.replay()
        assert bufs["y"].tolist() == [value + 1, value + 1, 0.0, 0.0]


def test_replays_run_unoptimized_and_leave_the_threads_executor_setting_as_it_was():
    """A replay switches TorchScript's optimizing executor off for itself only (thread-local): the
    caller's setting is back after a replay, and after one that raises."""
    bufs = {"x": torch.arange(4.0), "i": torch.zeros(1, dtype=torch.int64), "y": torch.zeros(1)}

    def step():
        bufs["y"].copy_(bufs["x"].index_select(0, bufs["i"]))

    graph = get_backend("jit").capture(step, bufs)
    assert torch._C._get_graph_executor_optimize()
    bufs["i"].fill_(3)
    graph.replay()
    assert bufs["y"].item() == 3.0 and torch._C._get_graph_executor_optimize()
    bufs["i"].fill_(9)  # out of range: the replay raises
    with pytest.raises(RuntimeError):
        graph.replay()
    assert torch._C._get_graph_executor_optimize()
