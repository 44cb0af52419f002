"""The `tensorrt` graph backend: the captured step exported to ONNX, built into a TensorRT engine, run on
the frontend's own buffers on the current CUDA stream.

`capture(fn, buffers)` records fn (the `trace` recorder, attention on torch's math path so no fused CUDA
attention kernel reaches the exporter), plans its buffers as named graph inputs/outputs and exports the
step to ONNX exactly as the `onnxrt` backend does (`flashrt.runtime.onnx_export`), then builds one
engine from that ONNX model with TensorRT's ONNX parser and builder. Both the ONNX model and the
serialized engine live in the export cache (`flashrt.runtime.export_cache`): the engine's key adds the
ONNX model's digest, the build options, the TensorRT version, the compute capability ("sm90") and the
GPU's name to the step's own fields, so an engine built by another TensorRT or for another GPU is never
loaded, and a tampered or truncated entry is rebuilt. An entry that passes every check but that
TensorRT refuses to deserialize is rebuilt too (and replaced), never half used.

Execution: every engine input and output is bound to the address of its buffer
(`set_tensor_address`); replay is one `execute_async_v3` on the caller's current stream of the device,
so a replay inside `torch.cuda.graph` is captured like any kernel (the `cuda` backend's warm-up runs it
once before capture, which TensorRT needs for its deferred set-up). Two exceptions cost one copy each,
both on the same stream: a written buffer whose old contents the engine also reads (a partial write)
gets its output bound to a scratch tensor copied back after the run, and a non-contiguous buffer is
staged through a contiguous scratch.

Precision (`precision=`): "auto" builds a strongly typed network (every tensor in the type the step was
exported in: a bf16 frontend gives a bf16 engine); "fp32" the same, refusing a step not exported in fp32;
"fp16" / "bf16" build a weakly typed one from an fp32 export, TensorRT free to run layers in fp16 / bf16
(TensorRT 10 only: 11 removed weak typing, there load the frontend in that precision and use "auto").
TF32 is off in every mode where the flag exists (parity with torch's default matmuls). INT8 comes from
the frontend, never from TensorRT's calibrator (with its separate cache that goes stale silently): load
it with ``precision="int8"`` and build with "auto"; its quantized GEMMs export as QuantizeLinear /
DequantizeLinear nodes carrying flashrt's calibrated scales (`flashrt.quant.linear.portable`), which a
strongly typed network runs as an explicitly quantized one. A step whose int8 weights reach anything but
a DequantizeLinear is refused. FP8 likewise (Hopper / Ada): an fp8 frontend exports float8e4m3fn Q/DQ
at its calibrated scales. ``precision="int8"|"fp8"`` as a build option is refused (load the frontend in
that precision and build with "auto").

Availability: registered for CUDA devices only; the constructor refuses with DeviceError ("needs CUDA +
tensorrt") where CUDA or the tensorrt package is missing. Nothing here imports tensorrt before a build
or a load.

Ownership and lifetime: a TensorRTGraph holds its runtime, engine, execution context and the buffers'
addresses; it is valid while the buffers keep their storage (checked on replay, as every graph, see
`flashrt.runtime.graphs`). Weights are baked into the engine: changing a weight after capture is not
seen (capture again). Counters in `STATS` (exports, builds, cache hits) let tests prove a second load
builds nothing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from flashrt.errors import CaptureError, ConfigError, DeviceError
from flashrt.runtime import onnx_export as ox
from flashrt.runtime.export_cache import EngineKey, ExportCache, ExportKey
from flashrt.runtime.graphs import BufferGuard

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "fp16", "bf16")
REFUSED_PRECISIONS = {
    "int8": "INT8 engines take flashrt's calibration scales from the ONNX export's Q/DQ nodes: load the "
            "frontend with precision='int8' and build with precision='auto'; TensorRT's own calibrator (a "
            "separate cache that goes stale silently) is never used.",
    "fp8": "FP8 engines take flashrt's calibration scales from the ONNX export's Q/DQ nodes: load the "
           "frontend with precision='fp8' and build with precision='auto'; TensorRT's own calibrator is "
           "never used.",
}
ENGINE_SCHEME = 1  # bump when what a cached engine means changes (binding rules, build recipe)
NEEDS = "graph backend 'tensorrt' needs CUDA + tensorrt"


@dataclass
class Stats:
    exports: int = 0
    builds: int = 0
    onnx_hits: int = 0
    engine_hits: int = 0


STATS = Stats()


@dataclass(frozen=True)
class BuildOptions:
    """How an engine is built (part of its cache key). `workspace_mb` 0: TensorRT's default."""

    precision: str = "auto"
    opt_level: int = 3
    workspace_mb: int = 0

    def check(self) -> None:
        if self.precision in REFUSED_PRECISIONS:
            raise ConfigError(f"tensorrt precision {self.precision!r} refused: "
                              f"{REFUSED_PRECISIONS[self.precision]}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"tensorrt precision {self.precision!r}; choose one of {list(PRECISIONS)}")
        if not isinstance(self.opt_level, int) or not 0 <= self.opt_level <= 5:
            raise ConfigError(f"tensorrt opt_level must be an integer 0..5, got {self.opt_level!r}")
        if not isinstance(self.workspace_mb, int) or self.workspace_mb < 0:
            raise ConfigError(f"tensorrt workspace_mb must be an integer >= 0, got {self.workspace_mb!r}")

    def key(self) -> str:
        return json.dumps({**asdict(self), "tf32": False, "scheme": ENGINE_SCHEME}, sort_keys=True)


def unavailable(device: torch.device) -> str | None:
    """Why the backend cannot run on `device` here (None: it can). Imports nothing heavy."""
    if device.type != "cuda":
        return f"device {device} is not a CUDA device"
    if not torch.cuda.is_available():
        return f"CUDA is not available here (torch {torch.__version__}, built with CUDA {torch.version.cuda})"
    if importlib.util.find_spec("tensorrt") is None:
        return "the tensorrt Python package is not installed (pip install tensorrt)"
    return None


def runtime_version() -> str:
    import tensorrt as trt
    return f"tensorrt {trt.__version__}"


def _float_dtypes(p: ox.ExportPlan) -> set[torch.dtype]:
    tensors = [*p.constants, *(port.tensor for port in p.ports)]
    return {t.dtype for t in tensors if t.is_floating_point()}


def check_plan(p: ox.ExportPlan, options: BuildOptions) -> None:
    """Refuse what no engine built here may run: quantized weights, float64, a reduced-precision build
    of a step that is not exported in fp32."""
    outside = quantized_outside_qdq(p)
    if outside:
        raise ConfigError(f"the step's quantized weights reach {outside}, not only DequantizeLinear: "
                          "TensorRT would need its own calibrator, which flashrt never uses (an int8 / fp8 "
                          "frontend exports its GEMMs as Q/DQ with its calibrated scales; see "
                          "flashrt.quant.linear.portable)")
    floats = _float_dtypes(p)
    if torch.float64 in floats:
        raise CaptureError("the step uses float64 tensors; TensorRT has no float64")
    if options.precision != "auto" and floats - {torch.float32}:
        found = sorted(str(d) for d in floats)
        raise ConfigError(f"tensorrt precision {options.precision!r} builds from an fp32 export; this step "
                          f"is exported in {found} (precision='auto' builds it in its own types)")


QDQ_READERS = {torch.int8: ("quantized_decomposed.",), torch.float8_e4m3fn: ("flashrt.fp8_dequant.",)}


def quantized_outside_qdq(p: ox.ExportPlan) -> list[str]:
    """"dtype: op" for each op that reads an int8 / float8 constant other than its dequantize (empty: an
    explicitly quantized step, or none)."""
    bad = set()
    for step in p.recording.steps:
        for leaf in step.leaves:
            readers = QDQ_READERS.get(leaf.dtype) if isinstance(leaf, torch.Tensor) else None
            if readers is not None and not str(step.func).startswith(readers):
                bad.add(f"{str(leaf.dtype).removeprefix('torch.')}: {step.func}")
    return sorted(bad)


def engine_key(onnx_key: ExportKey, onnx: bytes, options: BuildOptions, *, runtime: str, arch: str,
               device_name: str, scales: str = "", model: str = "trt") -> EngineKey:
    """The cache key of the engine built from `onnx` (whose own key is `onnx_key`) with `options`."""
    return EngineKey(weights=onnx_key.weights, program=onnx_key.program, shapes=onnx_key.shapes,
                     precision=f"{options.precision}; exported {onnx_key.precision}",
                     exporter=onnx_key.exporter, onnx=hashlib.sha256(onnx).hexdigest(), builder=options.key(),
                     scales=scales, runtime=runtime, arch=arch, device=device_name, scheme=ENGINE_SCHEME,
                     model=model)


def load_engine(cache: ExportCache | None, key: EngineKey, build: Callable[[], bytes],
                deserialize: Callable[[bytes], Any]) -> tuple[Any, bytes, bool]:
    """(engine, its bytes, cache hit): the cached engine of `key`, or a fresh build, stored once it
    deserializes. A cached entry that passes the cache's checks but that `deserialize` refuses (None) is
    rebuilt and replaced, never used; an engine that never deserializes is a CaptureError, not stored."""
    payload = cache.load(key) if cache is not None else None
    if payload is not None:
        engine = deserialize(payload)
        if engine is not None:
            STATS.engine_hits += 1
            return engine, payload, True
        log.warning("TensorRT refused the cached engine %s; rebuilding it", key.filename())
    elif cache is not None:
        log.info("building engine (%s): %s", cache.last_miss_reason, key.filename())
    STATS.builds += 1
    data = build()
    engine = deserialize(data)
    if engine is None:
        raise CaptureError("TensorRT could not deserialize the engine it has just built (its log says why)")
    if cache is not None:
        try:
            cache.store(key, data)
        except OSError as err:  # a read-only or full cache folder must not stop the model from running
            log.warning("could not store engine in %s: %s", cache.root, err)
    return engine, data, False


# ------------------------------------------------------------------------------- TensorRT calls (GPU)


def _logger():
    import tensorrt as trt
    global _LOGGER
    if _LOGGER is None:
        _LOGGER = trt.Logger(trt.Logger.WARNING)
    return _LOGGER


_LOGGER = None


def build_engine(onnx: bytes, options: BuildOptions, device: torch.device) -> bytes:
    """The serialized engine of `onnx` built for `device` with `options` (CaptureError with the parser's
    or builder's reason when TensorRT refuses). "auto" / "fp32" build a strongly typed network (TensorRT
    11 builds nothing else); "fp16" / "bf16" set TensorRT 10's weak-typing flags, which 11 removed (then a
    ConfigError: load the frontend in that precision and build with "auto")."""
    import tensorrt as trt
    builder = trt.Builder(_logger())
    weak = options.precision in ("fp16", "bf16")
    flag = getattr(trt.BuilderFlag, options.precision.upper(), None) if weak else None
    if weak and flag is None:
        raise ConfigError(f"tensorrt precision {options.precision!r}: TensorRT {trt.__version__} has no "
                          "weak typing; load the frontend in that precision and use precision='auto'")
    flags = 0 if weak else 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, _logger())
    if not parser.parse(onnx):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise CaptureError(f"TensorRT's ONNX parser refused the export: {'; '.join(errors[:5])}")
    config = builder.create_builder_config()
    config.builder_optimization_level = options.opt_level
    if options.workspace_mb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mb << 20)
    if getattr(trt.BuilderFlag, "TF32", None) is not None:
        config.clear_flag(trt.BuilderFlag.TF32)
    if flag is not None:
        config.set_flag(flag)
    with torch.cuda.device(device):
        data = builder.build_serialized_network(network, config)
    if data is None:
        raise CaptureError("TensorRT failed to build the engine (its log above says why)")
    return bytes(data)


class _Runtime:
    """A TensorRT runtime on one device; `deserialize` gives the engine or None."""

    def __init__(self, device: torch.device) -> None:
        import tensorrt as trt
        self.device = device
        self.runtime = trt.Runtime(_logger())

    def deserialize(self, data: bytes) -> Any:
        with torch.cuda.device(self.device):
            return self.runtime.deserialize_cuda_engine(data)


_DTYPES = (("FLOAT", torch.float32), ("HALF", torch.float16), ("BF16", torch.bfloat16),
           ("INT8", torch.int8), ("INT32", torch.int32), ("INT64", torch.int64), ("BOOL", torch.bool),
           ("UINT8", torch.uint8), ("FP8", torch.float8_e4m3fn))


def _torch_dtype(trt_dtype: Any) -> torch.dtype | None:
    """The torch dtype of a `tensorrt.DataType` (None for one torch has no tensor of)."""
    import tensorrt as trt
    for name, dtype in _DTYPES:
        if getattr(trt.DataType, name, None) == trt_dtype:
            return dtype
    return None


class _Binding:
    """Binds each engine tensor to its buffer (or a scratch) and knows the copies a replay needs."""

    def __init__(self) -> None:
        self.before: list[tuple[torch.Tensor, torch.Tensor]] = []  # (scratch, buffer): copy in
        self.after: list[tuple[torch.Tensor, torch.Tensor]] = []   # (buffer, scratch): copy out
        self.addresses: dict[str, int] = {}
        self.keep: list[torch.Tensor] = []

    def target(self, name: str, t: torch.Tensor, is_input: bool, alias_read: bool) -> torch.Tensor:
        target = t
        if not t.is_contiguous() or (not is_input and alias_read):
            target = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            if is_input:
                self.before.append((target, t))
            else:
                self.after.append((t, target))
        self.keep.append(target)
        self.addresses[name] = target.data_ptr()
        return target


def bind(engine: Any, context: Any, p: ox.ExportPlan, read: set[str]) -> _Binding:
    """Every engine input/output bound to its port's buffer; CaptureError on a name, shape or dtype that
    does not match the plan."""
    import tensorrt as trt
    inputs = {port.input_name: port.tensor for port in p.ports}
    outputs = {port.name: (port.tensor, port.input_name in read) for port in p.outputs}
    binding = _Binding()
    seen = set()
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        if is_input and name in inputs:
            tensor, alias = inputs[name], False
        elif not is_input and name in outputs:
            tensor, alias = outputs[name]
        else:
            raise CaptureError(f"TensorRT engine {'input' if is_input else 'output'} {name!r} is no port of "
                               "the step")
        shape, dtype = tuple(engine.get_tensor_shape(name)), _torch_dtype(engine.get_tensor_dtype(name))
        if shape != tuple(tensor.shape) or dtype != tensor.dtype:
            raise CaptureError(f"TensorRT engine tensor {name!r} is {shape} {dtype}, its buffer "
                               f"{tuple(tensor.shape)} {tensor.dtype}")
        target = binding.target(name, tensor, is_input, alias)
        if not context.set_tensor_address(name, target.data_ptr()):
            raise CaptureError(f"TensorRT refused the address of buffer {name!r}")
        seen.add(name)
    missing = sorted(set(outputs) - seen)
    if missing:
        raise CaptureError(f"the TensorRT engine lacks the outputs {missing}")
    return binding


class TensorRTGraph:
    """One engine, run on the buffers it was captured against, on the caller's current stream."""

    backend = "tensorrt"

    def __init__(self, runtime: _Runtime, engine: Any, context: Any, binding: _Binding,
                 guard: BufferGuard | None, onnx: bytes, engine_bytes: bytes, hit: bool) -> None:
        self._runtime, self.engine, self.context, self._binding = runtime, engine, context, binding
        self._guard, self.device = guard, runtime.device
        self.model_bytes, self.engine_bytes, self.cache_hit = onnx, engine_bytes, hit

    def replay(self, times: int = 1) -> None:
        for _ in range(times):
            self._replay_once()

    def _replay_once(self) -> None:
        if self._guard is not None:
            self._guard.check()
        stream = torch.cuda.current_stream(self.device)
        for scratch, buf in self._binding.before:
            scratch.copy_(buf)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise CaptureError("TensorRT execute_async_v3 failed (its log says why)")
        for buf, scratch in self._binding.after:
            buf.copy_(scratch)

    def check(self) -> None:
        if self._guard is not None:
            self._guard.check()

    def summary(self) -> str:
        origin = "cache hit" if self.cache_hit else "built"
        return (f"tensorrt graph: {len(self.engine_bytes)} bytes of engine from {len(self.model_bytes)} "
                f"bytes of ONNX, {origin}, {len(self._binding.after)} copies out")


class TensorRTBackend:
    """Export (cached), build (cached), run with TensorRT. Options: `precision` (auto|fp32|fp16|bf16;
    int8/fp8 come from the frontend's precision, see module docstring), `opt_level` (builder
    optimization level 0..5),
    `workspace_mb` (0: TensorRT's default), `cache_dir` (None: the user cache) or `cache=False`,
    `device` (set by `backend_for_device`)."""

    name = "tensorrt"

    def __init__(self, device: str | torch.device = "cuda", precision: str = "auto", opt_level: int = 3,
                 workspace_mb: int = 0, cache_dir: str | os.PathLike | None = None, cache: bool = True,
                 check_buffers: bool = True, model: str = "graph") -> None:
        self.options = BuildOptions(precision, opt_level, workspace_mb)
        self.options.check()  # option errors first: they are the same on every machine
        device = torch.device(device)
        why = unavailable(device)
        if why is not None:
            raise DeviceError(f"{NEEDS}: {why}")
        self.device = torch.device("cuda", device.index if device.index is not None else 0)
        self.cache = ExportCache(cache_dir) if cache else None
        self.check_buffers, self.model = check_buffers, model

    def onnx_key(self, p: ox.ExportPlan) -> ExportKey:
        from flashrt.runtime.device import device_arch
        f = p.key_fields()
        return ExportKey(weights=f["weights"], program=f["program"], shapes=f["shapes"],
                         precision=f["precision"], exporter=f["exporter"], runtime=runtime_version(),
                         arch=device_arch(self.device), scheme=f["scheme"], model=self.model)

    def engine_key(self, onnx_key: ExportKey, onnx: bytes) -> EngineKey:
        return engine_key(onnx_key, onnx, self.options, runtime=runtime_version(), arch=onnx_key.arch,
                          device_name=torch.cuda.get_device_name(self.device), model=f"{self.model}-trt")

    def export(self, fn: Callable[[], Any], buffers: Any = None) -> tuple[ox.ExportPlan, ExportKey, bytes]:
        """(plan, its key, ONNX bytes) of fn over buffers: recorded, checked, then loaded or exported."""
        p = ox.plan(ox.record(fn, buffers, math_attention=True), buffers)
        check_plan(p, self.options)

        def fresh() -> bytes:
            STATS.exports += 1
            return ox.export_onnx(p)
        key = self.onnx_key(p)
        if self.cache is None:
            return p, key, fresh()
        data, hit = self.cache.get_or_export(key, fresh)
        STATS.onnx_hits += hit
        return p, key, data

    def capture(self, fn: Callable[[], Any], buffers: Any = None) -> TensorRTGraph:
        p, key, onnx = self.export(fn, buffers)
        runtime = _Runtime(self.device)
        engine, data, hit = load_engine(self.cache, self.engine_key(key, onnx),
                                        lambda: build_engine(onnx, self.options, self.device),
                                        runtime.deserialize)
        with torch.cuda.device(self.device):
            context = engine.create_execution_context()
        if context is None:
            raise CaptureError("TensorRT could not create an execution context (out of device memory?)")
        binding = bind(engine, context, p, ox.consumed_inputs(onnx))
        guard = BufferGuard(buffers) if self.check_buffers and buffers is not None else None
        return TensorRTGraph(runtime, engine, context, binding, guard, onnx, data, hit)
