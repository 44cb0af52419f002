"""Backend registry and the capture/replay contract shared by every backend."""

from __future__ import annotations

import pytest
import torch

from flashrt.errors import CaptureError, ConfigError, DeviceError
from flashrt.runtime import graphs
from flashrt.runtime.buffers import Buffers, BufferSpec
from flashrt.runtime.graphs import (
    BufferGuard,
    EagerBackend,
    Graph,
    GraphBackend,
    backend_names,
    backends_for,
    get_backend,
    named_tensors,
    register_backend,
)

CPU_BACKENDS = ["eager", "trace"]


def test_builtin_backends_are_registered():
    assert set(backend_names()) >= {"eager", "trace", "cuda"}
    assert backends_for("cpu") == ["eager", "trace", "onnxrt", "jit"]
    assert backends_for("cuda") == ["cuda", "tensorrt", "eager", "trace", "onnxrt"]


def test_unknown_backend_and_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="unknown graph backend 'nope'"):
        get_backend("nope")
    with pytest.raises(ConfigError, match="bad options"):
        get_backend("eager", warmup=3)


def test_register_backend_refuses_duplicates_unless_replaced(monkeypatch):
    monkeypatch.setattr(graphs, "_REGISTRY", dict(graphs._REGISTRY))
    register_backend("mine", EagerBackend, devices=("cpu",))
    assert isinstance(get_backend("mine"), EagerBackend)
    with pytest.raises(ConfigError, match="already registered"):
        register_backend("mine", EagerBackend)
    register_backend("mine", "flashrt.runtime.trace:TraceBackend", replace=True)
    assert get_backend("mine").name == "trace"
    assert backends_for("cpu")[-1] == "mine"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cuda_backend_without_a_gpu_is_a_device_error():
    with pytest.raises(DeviceError, match="CUDA is not available"):
        get_backend("cuda")


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_same_frontend_code_on_every_cpu_backend(name, make_block):
    """A frontend's fn runs unchanged on each backend; results match a plain eager call."""
    _, bufs, fn, feed = make_block(seed=1)
    _, ref, ref_fn, ref_feed = make_block(seed=1)
    backend = get_backend(name)
    assert isinstance(backend, GraphBackend)
    graph = backend.capture(fn, bufs)
    assert isinstance(graph, Graph) and graph.backend == name
    for step in range(2):
        feed(step, torch.Generator().manual_seed(step))
        ref_feed(step, torch.Generator().manual_seed(step))
        assert graph.replay() is None
        with torch.no_grad():
            ref_fn()
        assert torch.equal(bufs["out"], ref["out"])


def test_eager_capture_does_not_run_fn():
    calls = []
    graph = get_backend("eager").capture(lambda: calls.append(1))
    assert calls == []
    graph.replay()
    graph.replay()
    assert calls == [1, 1]


def test_trace_capture_runs_fn_once():
    calls = []
    x = torch.zeros(1)
    graph = get_backend("trace").capture(lambda: (calls.append(1), x.add_(1)))
    assert calls == [1] and x.item() == 1
    graph.replay()
    assert calls == [1] and x.item() == 2  # Python side effects are not replayed


def test_replay_runs_without_grad():
    lin = torch.nn.Linear(3, 3)
    x, out = torch.randn(1, 3), torch.zeros(1, 3)
    for name in CPU_BACKENDS:
        get_backend(name).capture(lambda: out.copy_(lin(x))).replay()
        assert not out.requires_grad


def test_named_tensors_accepts_buffers_mappings_and_none():
    bufs = Buffers([BufferSpec("a", (2,), torch.float32), BufferSpec("b", (1,), torch.int64, "output")])
    assert sorted(named_tensors(bufs)) == ["a", "b"]
    assert named_tensors({"x": torch.zeros(1), "n": 3}).keys() == {"x"}
    assert named_tensors(None) == {}
    with pytest.raises(TypeError):
        named_tensors([torch.zeros(1)])


def test_buffer_guard_names_reallocated_and_reshaped_buffers():
    bufs = {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(4)}
    guard = BufferGuard(bufs)
    guard.check()
    bufs["a"].copy_(torch.ones(4))  # writing into a buffer is the normal way: fine
    guard.check()
    bufs["b"] = torch.zeros(4)
    bufs["c"].resize_(2)
    assert guard.moved() == ["b", "c"]
    with pytest.raises(CaptureError, match=r"\['b', 'c'\]"):
        guard.check()


def test_eager_backend_can_check_buffers_too():
    bufs = {"x": torch.zeros(2)}
    graph = EagerBackend(check_buffers=True).capture(lambda: bufs["x"].add_(1), bufs)
    graph.replay()
    bufs["x"] = torch.zeros(2)
    with pytest.raises(CaptureError, match="'x'"):
        graph.replay()


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_capture_needs_a_callable(name):
    with pytest.raises(CaptureError, match="callable"):
        get_backend(name).capture(torch.zeros(1))


@pytest.mark.parametrize("name", ["eager", "trace"])
def test_replay_times_runs_the_step_that_many_times(name):
    """Every backend takes `replay(times)` (the slot decoder replays a frame's block of tokens with one
    call): the same state as that many single replays."""
    def make():
        bufs = {"x": torch.ones(3), "n": torch.zeros((), dtype=torch.int64)}

        def step():
            bufs["x"].mul_(0.5).add_(bufs["n"].to(torch.float32))
            bufs["n"].add_(1)
        return get_backend(name).capture(step, bufs), bufs

    one, a = make()
    many, b = make()
    start = int(a["n"])  # a capture may run the step (warm-up / recording)
    for _ in range(5):
        one.replay()
    many.replay(5)
    assert torch.equal(a["x"], b["x"]) and int(a["n"]) == int(b["n"]) == start + 5
