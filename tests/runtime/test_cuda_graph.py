"""The cuda backend on a real GPU: replay matches eager, 1,000 replays allocate nothing, errors explain.

Every test here is skipped without CUDA. The capture-failure test comes last in the file.
"""

from __future__ import annotations

import pytest
import torch

from flashrt.errors import CaptureError
from flashrt.runtime.buckets import GraphSet
from flashrt.runtime.cuda_graph import CudaBackend, GraphPool
from flashrt.runtime.graphs import get_backend
from flashrt.runtime.trace import CaptureRefused, TraceBackend

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"


def _allocations() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["allocation.all.allocated"]


def _check_against_eager(make, backend, steps=3, replays=1000):
    _, bufs, fn, feed = make(seed=0, device=DEVICE)
    _, ref, ref_fn, ref_feed = make(seed=0, device=DEVICE)
    graph = backend.capture(fn, bufs)
    for step in range(steps):
        feed(step, torch.Generator().manual_seed(step))
        ref_feed(step, torch.Generator().manual_seed(step))
        graph.replay()
        with torch.no_grad():
            ref_fn()
        for name in bufs:
            torch.testing.assert_close(bufs[name], ref[name])
    before = _allocations()
    for _ in range(replays):
        graph.replay()
    assert _allocations() == before, "replays allocated device memory"
    return graph, bufs, ref


@pytest.mark.parametrize("model", ["block", "conv"])
def test_replay_matches_eager_and_allocates_nothing(model, request):
    make = request.getfixturevalue(f"make_{model}")
    graph, _, _ = _check_against_eager(make, get_backend("cuda"))
    assert graph.backend == "cuda"


def test_priority_stream_replay_matches_eager_and_allocates_nothing(make_conv):
    backend = CudaBackend(priority=-1, warmup=2)
    graph, _, _ = _check_against_eager(make_conv, backend, steps=2, replays=200)
    assert graph.pool.priority == -1


def test_priority_replay_creates_no_cuda_event_per_call(make_conv, monkeypatch):
    """Issue #17: no per-call CUDA event unless timing is asked for (Stream.wait_stream makes one)."""
    import torch.cuda.streams as streams
    _, bufs, fn, _ = make_conv(seed=0, device=DEVICE)
    graph = CudaBackend(priority=-1, warmup=2).capture(fn, bufs)
    made = []
    real = streams.Event

    def counting(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(streams, "Event", counting)
    monkeypatch.setattr(torch.cuda, "Event", counting)
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    assert not made


def test_graphs_of_one_backend_share_one_pool(make_conv):
    backend = get_backend("cuda")
    _, a, fa, feed_a = make_conv(seed=0, device=DEVICE)
    _, b, fb, feed_b = make_conv(seed=1, device=DEVICE)
    ga, gb = backend.capture(fa, a), backend.capture(fb, b)
    assert ga.pool is gb.pool is backend.pool
    _, ra, rfa, _ = make_conv(seed=0, device=DEVICE)
    _, rb, rfb, _ = make_conv(seed=1, device=DEVICE)
    for step in range(3):
        for bufs, feed, ref in ((a, feed_a, ra), (b, feed_b, rb)):
            feed(step, torch.Generator().manual_seed(step))
            ref["mel"].copy_(bufs["mel"])
        ga.replay()
        gb.replay()
        with torch.no_grad():
            rfa()
            rfb()
        torch.testing.assert_close(a["audio"], ra["audio"])
        torch.testing.assert_close(b["audio"], rb["audio"])


def test_explicit_pool_is_shared_across_backends():
    pool = GraphPool(DEVICE)
    assert CudaBackend(pool=pool).pool is pool


def test_cpu_buffer_is_refused_before_capture(make_conv):
    _, bufs, fn, _ = make_conv(device=DEVICE)
    bufs["mel"] = bufs["mel"].cpu()
    with pytest.raises(CaptureError, match=r"\['mel'\] are not on cuda"):
        get_backend("cuda").capture(fn, bufs)


def test_reallocated_buffer_is_caught_on_replay(make_conv):
    _, bufs, fn, _ = make_conv(device=DEVICE)
    graph = get_backend("cuda").capture(fn, bufs)
    graph.replay()
    bufs["audio"] = torch.zeros_like(bufs["audio"])
    with pytest.raises(CaptureError, match="'audio'"):
        graph.replay()


def test_graph_set_on_cuda():
    outs = {}

    def build(bucket):
        x = torch.arange(bucket, dtype=torch.float32, device=DEVICE)
        outs[bucket] = torch.zeros(1, device=DEVICE)
        return lambda: outs[bucket].copy_(x.sum(0, keepdim=True))

    gs = GraphSet(get_backend("cuda"), build, [4, 8]).capture_all()
    bucket = gs.bucket_for(5)
    gs.replay(bucket)
    assert bucket == 8 and outs[8].item() == 28.0


def test_trace_backend_on_cuda_tensors(make_block):
    _, bufs, fn, feed = make_block(device=DEVICE)
    _, ref, ref_fn, ref_feed = make_block(device=DEVICE)
    graph = TraceBackend().capture(fn, bufs)
    for step in range(2):  # step 0 overwrites the cache rows the capture run wrote (the eager twin has none)
        feed(step, torch.Generator().manual_seed(step))
        ref_feed(step, torch.Generator().manual_seed(step))
        graph.replay()
        with torch.no_grad():
            ref_fn()
        torch.testing.assert_close(bufs["out"], ref["out"], rtol=0, atol=0)
    x = bufs["x"]
    with pytest.raises(CaptureRefused, match="across devices"):
        TraceBackend().capture(lambda: x.to("cpu"))


def test_failed_capture_lists_likely_causes():
    x = torch.ones(4, device=DEVICE)
    out = torch.zeros(1, device=DEVICE)

    def fn():
        out.fill_(x.sum().item())  # a host sync: not allowed while capturing

    caller = torch.cuda.current_stream()
    with pytest.raises(CaptureError) as info:
        CudaBackend(warmup=1).capture(fn, {"x": x, "out": out})
    assert torch.cuda.current_stream() == caller   # not the failed capture's stream (restore_stream)
    message = str(info.value)
    assert "CUDA graph capture failed" in message and "Likely causes" in message
    assert "  1. host sync" in message and "get_backend('trace')" in message
    torch.cuda.synchronize()  # the device is still usable afterwards
    assert torch.ones(2, device=DEVICE).sum().item() == 2.0
