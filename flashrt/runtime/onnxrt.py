"""The `onnxrt` graph backend: the captured step exported to ONNX and run by onnxruntime on the buffers.

`capture(fn, buffers)` records fn (the `trace` recorder: one real run, the same refusals), plans its
buffers as named graph inputs/outputs (`flashrt.runtime.onnx_export`), looks the model up in the export
cache (`flashrt.runtime.export_cache`; a miss exports with torch's exporter, checks it with
onnx.checker and stores it), opens an onnxruntime session with the options chosen here (threads,
graph optimization level, execution provider of the device) and binds every input and output to the
frontend's own static buffers (IO binding: no copies). Two exceptions cost one copy each, made on
replay: a written buffer whose old contents the graph also reads (a partial write) gets its output
bound to a scratch tensor copied back after the run (onnxruntime may write an output before the last
read of an aliased input), and a non-contiguous buffer is staged through a contiguous scratch.

Replay = `run_with_iobinding`; the buffers are checked for moved storage first (`BufferGuard`).
Exports counted in `STATS.exports` (a hit on a second load exports nothing).

Ownership and lifetime: an OnnxGraph holds its session, its binding and the buffers' addresses; it
is valid while the buffers keep their storage (as every graph, see `flashrt.runtime.graphs`). Weights
are baked into the exported model: changing a weight after capture is not seen (capture again).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashrt.errors import CaptureError, ConfigError
from flashrt.runtime import onnx_export as ox
from flashrt.runtime.export_cache import ExportCache, ExportKey
from flashrt.runtime.graphs import BufferGuard

log = logging.getLogger(__name__)

OPT_LEVELS = ("disable", "basic", "extended", "all")
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
          torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
          torch.uint8: np.uint8, torch.bool: np.bool_}


@dataclass
class Stats:
    exports: int = 0
    cache_hits: int = 0


STATS = Stats()


def runtime_version() -> str:
    import onnxruntime as ort
    return f"onnxruntime {ort.__version__}"


def _session_options(threads: int, opt_level: str):
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[opt_level]
    opts.log_severity_level = 3
    return opts


def _providers(device: torch.device) -> list[str]:
    import onnxruntime as ort
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise ConfigError(f"onnxrt on {device}: this onnxruntime has no CUDAExecutionProvider "
                          f"(available: {available}); install onnxruntime-gpu")
    return [("CUDAExecutionProvider", {"device_id": device.index or 0})]


class _Binder:
    """Binds each port to its buffer (or a scratch tensor) and knows the copies a replay needs."""

    def __init__(self, session, device: torch.device) -> None:
        self.binding = session.io_binding()
        self.device_type, self.device_id = device.type, device.index or 0
        self.before: list[tuple[torch.Tensor, torch.Tensor]] = []  # (scratch, buffer): copy in
        self.after: list[tuple[torch.Tensor, torch.Tensor]] = []   # (buffer, scratch): copy out
        self.keep: list[torch.Tensor] = []

    def _address(self, t: torch.Tensor, stage_in: bool) -> torch.Tensor:
        if t.is_contiguous():
            return t
        scratch = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        if stage_in:
            self.before.append((scratch, t))
        return scratch

    def _bind(self, method, name: str, t: torch.Tensor) -> None:
        if t.dtype not in _NUMPY:
            raise CaptureError(f"onnxrt cannot bind buffer {name!r} of dtype {t.dtype}")
        self.keep.append(t)
        method(name, self.device_type, self.device_id, _NUMPY[t.dtype], list(t.shape), t.data_ptr())

    def bind_input(self, name: str, t: torch.Tensor) -> None:
        self._bind(self.binding.bind_input, name, self._address(t, stage_in=True))

    def bind_output(self, name: str, t: torch.Tensor, alias_read: bool) -> None:
        target = t
        if alias_read or not t.is_contiguous():
            target = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            self.after.append((t, target))
        self._bind(self.binding.bind_output, name, target)


class OnnxGraph:
    """One exported step, run by onnxruntime on the buffers it was captured against."""

    backend = "onnxrt"

    def __init__(self, session, binder: _Binder, guard: BufferGuard | None, model: bytes, hit: bool) -> None:
        self.session, self._binder, self._guard = session, binder, guard
        self.model_bytes, self.cache_hit = model, hit

    def replay(self) -> None:
        if self._guard is not None:
            self._guard.check()
        for scratch, buf in self._binder.before:
            scratch.copy_(buf)
        self.session.run_with_iobinding(self._binder.binding)
        for buf, scratch in self._binder.after:
            buf.copy_(scratch)

    def check(self) -> None:
        if self._guard is not None:
            self._guard.check()

    def summary(self) -> str:
        return (f"onnxrt graph: {len(self.model_bytes)} bytes of ONNX, "
                f"{'cache hit' if self.cache_hit else 'exported'}, {len(self._binder.after)} copies out")


class OnnxRuntimeBackend:
    """Export at capture (cached), run with onnxruntime. Options: `threads` (None: torch's intra-op
    thread count at capture), `opt_level` (disable|basic|extended|all), `cache_dir` (None: the user
    cache) or `cache=False`, `device` (set by `backend_for_device`)."""

    name = "onnxrt"

    def __init__(self, threads: int | None = None, opt_level: str = "all", cache_dir: str | os.PathLike |
                 None = None, cache: bool = True, device: str | torch.device = "cpu",
                 check_buffers: bool = True, model: str = "graph") -> None:
        if opt_level not in OPT_LEVELS:
            raise ConfigError(f"onnxrt opt_level {opt_level!r}; choose one of {list(OPT_LEVELS)}")
        if threads is not None and threads < 1:
            raise ConfigError(f"onnxrt threads must be >= 1, got {threads}")
        self.threads, self.opt_level, self.device = threads, opt_level, torch.device(device)
        self.cache = ExportCache(cache_dir) if cache else None
        self.check_buffers, self.model = check_buffers, model
        _providers(self.device)  # refuse an unusable device now, before any capture

    def key(self, p: ox.ExportPlan) -> ExportKey:
        from flashrt.runtime.device import device_arch
        f = p.key_fields()
        return ExportKey(weights=f["weights"], program=f["program"], shapes=f["shapes"],
                         precision=f["precision"], exporter=f["exporter"], runtime=runtime_version(),
                         arch=device_arch(self.device), scheme=f["scheme"], model=self.model)

    def export(self, fn: Callable[[], Any], buffers: Any = None) -> tuple[ox.ExportPlan, bytes, bool]:
        """(plan, ONNX bytes, cache hit) of fn over buffers: recorded, then loaded or exported."""
        p = ox.plan(ox.record(fn, buffers), buffers)

        def fresh() -> bytes:
            STATS.exports += 1
            return ox.export_onnx(p)
        if self.cache is None:
            return p, fresh(), False
        data, hit = self.cache.get_or_export(self.key(p), fresh)
        if hit:
            STATS.cache_hits += 1
        return p, data, hit

    def capture(self, fn: Callable[[], Any], buffers: Any = None) -> OnnxGraph:
        import onnxruntime as ort
        p, data, hit = self.export(fn, buffers)
        threads = self.threads or torch.get_num_threads()
        session = ort.InferenceSession(data, sess_options=_session_options(threads, self.opt_level),
                                       providers=_providers(self.device))
        names = [i.name for i in session.get_inputs()]
        if names != p.input_names():
            raise CaptureError(f"onnxruntime session inputs {names}, expected {p.input_names()}")
        read = ox.consumed_inputs(data)
        binder = _Binder(session, self.device)
        for port in p.ports:
            binder.bind_input(port.input_name, port.tensor)
        for port in p.outputs:
            binder.bind_output(port.name, port.tensor, alias_read=port.input_name in read)
        guard = BufferGuard(buffers) if self.check_buffers and buffers is not None else None
        return OnnxGraph(session, binder, guard, data, hit)
