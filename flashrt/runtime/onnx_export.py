"""Export a captured step (a no-argument fn over static buffers) to ONNX, its buffers as named inputs/outputs.

How a step that reads and writes static buffers becomes a function of its inputs:

1. `record(fn, buffers)` runs fn once under the `trace` backend's recorder (same refusals: host syncs,
   data-dependent shapes, RNG), giving the aten program and every static tensor it touched. Quantized
   GEMMs (`flashrt.quant.linear.QuantWeight`) run their portable form meanwhile (`portable`): int8 is
   recorded as quantize -> dequantize around a float GEMM and written as QuantizeLinear /
   DequantizeLinear nodes carrying flashrt's calibrated scales (part of the program digest). Convs run
   their plain form (`flashrt.nn.conv1d.plain_forms`): the `invariant` conv policy's phase-split and
   polyphase rewrites are oneDNN workarounds and record as one dilated Conv / one ConvTranspose.
2. `plan(...)` sorts those statics: a named buffer, or a view inside one (found by address range, so the
   frontend's slices `bufs["audio"][:, :n]` map to the buffer `audio`), is a graph input; a buffer the
   program writes into is also a graph output; anything else is a constant (weights, tables) that goes
   into the file as an initializer. A written tensor that is not a named buffer is carried as a state
   input/output `state.<i>` so its update is not lost; tensors sharing one storage (a cache written
   through one view and read through another) are one state, each a view of it.
3. `StepModule.forward(*inputs)` replays the program with each static replaced by its input (a clone
   for written buffers, so the update is functional: new value = f(old values)) and returns the written
   buffers; `torch.onnx.export` (torch.export based) turns it into ONNX with static shapes, checked by
   `onnx.checker`.

Names: a read-only buffer is the input `<name>`; a written buffer is the output `<name>` and the input
`<name>.in` (its current contents: a partial write keeps the rest). `ExportPlan.key_fields()` is the
content of the export: digests of the constants (weights) and of the program (ops and their scalar
arguments: the model config and every frozen Python value), the buffer shapes and dtypes, the exporter
versions and the opset. Files are limited to protobuf's 2 GB (no external data).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from flashrt.errors import CaptureError
from flashrt.io.digest import tensor_digest
from flashrt.runtime.graphs import named_tensors
from flashrt.runtime.trace import Recorder, Step, _bound, _DispatchRecorder, _FunctionChecker

OPSET = 19  # the first with float8 QuantizeLinear / DequantizeLinear (flashrt's fp8 GEMMs)
SCHEME_VERSION = 5  # bump when what an exported file means changes (naming, plan rules, lowerings)

# --------------------------------------------------------------------------------------- recording


@dataclass(frozen=True)
class Recording:
    """The aten program of one fn, the static tensors it touched (in order of first use) and the
    [start, end) address ranges its in-place ops wrote (through statics or views of them)."""

    steps: list[Step]
    nslots: int
    statics: list[torch.Tensor]
    written: list[tuple[int, int]]

    def writes(self, t: torch.Tensor) -> bool:
        lo, hi = _extent(t)
        return any(a < hi and lo < b for a, b in self.written)


class _WriteRecorder(_DispatchRecorder):
    """The trace recorder, also noting the memory each op writes (schema arguments marked written)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__(recorder)
        self.written: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func._schema.is_mutable:
            bound = _bound(func, args, kwargs or {})
            for arg in func._schema.arguments:
                if arg.alias_info is not None and arg.alias_info.is_write:
                    self.written += [_extent(t) for t in tree_leaves(bound.get(arg.name))
                                     if isinstance(t, torch.Tensor)]
        return out


def record(fn: Callable[[], Any], buffers: Any = None, math_attention: bool = False) -> Recording:
    """Run fn once under the trace recorder (it writes its outputs, as a trace capture does).
    `math_attention`: scaled_dot_product_attention takes torch's math path (plain matmul/softmax ops),
    so a CUDA step records no fused attention kernel the exporter cannot write (TensorRT fuses its own)."""
    if not callable(fn):
        raise CaptureError(f"capture needs a no-argument callable, got {type(fn).__name__}")
    from flashrt.nn.conv1d import plain_forms  # convs record their plain form (no invariant rewrites)
    from flashrt.quant.linear import portable  # quantized GEMMs record their Q/DQ form
    names = {id(t): f"buffer {n!r}" for n, t in named_tensors(buffers).items()}
    recorder = Recorder(names)
    mode = _WriteRecorder(recorder)
    attention = contextlib.nullcontext()
    if math_attention:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        attention = sdpa_kernel([SDPBackend.MATH])
    with torch.no_grad(), portable(), plain_forms(), _FunctionChecker(), attention, mode:
        fn()
    return Recording(recorder.program(), recorder.nslots, list(recorder.statics.values()), mode.written)


# --------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Port:
    """One graph input (and output, if written): a named buffer or a carried state tensor."""

    name: str
    tensor: torch.Tensor
    written: bool

    @property
    def input_name(self) -> str:
        return f"{self.name}.in" if self.written else self.name


@dataclass(frozen=True)
class Source:
    """Where one static comes from inside the graph: port `port` (whole, or a view), or constant `const`."""

    port: int | None = None
    view: tuple | None = None  # how to rebuild the view inside the port's tensor (`_view`)
    const: int | None = None


@dataclass
class ExportPlan:
    recording: Recording
    ports: list[Port]
    sources: list[Source]
    constants: list[torch.Tensor]
    _weights_digest: str | None = field(default=None, repr=False)

    @property
    def inputs(self) -> list[Port]:
        return self.ports

    @property
    def outputs(self) -> list[Port]:
        return [p for p in self.ports if p.written]

    def input_names(self) -> list[str]:
        return [p.input_name for p in self.ports]

    def output_names(self) -> list[str]:
        return [p.name for p in self.outputs]

    def weights_digest(self) -> str:
        if self._weights_digest is None:
            self._weights_digest = tensor_digest({f"c{i}": t.detach() for i, t in enumerate(self.constants)})
        return self._weights_digest

    def program_digest(self) -> str:
        return _program_digest(self.recording)

    def shapes(self) -> dict[str, Any]:
        return {p.name: {"shape": list(p.tensor.shape), "dtype": str(p.tensor.dtype), "written": p.written}
                for p in self.ports}

    def key_fields(self) -> dict[str, Any]:
        """What the exported file depends on (the device arch and runtime version are added by the cache)."""
        dtypes = sorted({str(t.dtype) for t in self.constants} | {str(p.tensor.dtype) for p in self.ports})
        return {"weights": self.weights_digest(), "program": self.program_digest(),
                "shapes": json.dumps(self.shapes(), sort_keys=True), "precision": ",".join(dtypes),
                "exporter": exporter_versions(), "scheme": SCHEME_VERSION}


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) byte addresses a tensor can touch."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _locate(t: torch.Tensor, buffers: list[tuple[str, torch.Tensor]]) -> tuple[int, tuple | None] | None:
    """(index of the named buffer holding t, None if t is it / its view geometry), or None if outside all."""
    if t.is_mkldnn:  # oneDNN-packed weights have no storage: constants, never buffers
        return None
    lo, hi = _extent(t)
    for i, (name, buf) in enumerate(buffers):
        if t is buf:
            return i, None
        blo, bhi = _extent(buf)
        if hi <= blo or lo >= bhi:
            continue
        if lo < blo or hi > bhi or t.dtype != buf.dtype or not buf.is_contiguous():
            raise CaptureError(f"the step touches a tensor overlapping buffer {name!r} that is not a view of "
                               "it in its own dtype; onnxrt needs contiguous buffers and plain views")
        return i, _view(buf, t, (lo - blo) // t.element_size())
    return None


def _view(buf: torch.Tensor, t: torch.Tensor, offset: int) -> tuple:
    """How to rebuild view t of contiguous buf inside the graph: ("slice", starts, sizes) when it is a
    box of buf (the exporter handles writes through slices), ("flat", offset, shape) when contiguous,
    else ("strided", size, stride, offset) (read-only use: the exporter cannot write through it)."""
    size, stride = tuple(t.shape), tuple(t.stride())
    if t.dim() == buf.dim() and all(st == bst or n == 1 for n, st, bst in zip(size, stride, buf.stride())):
        starts = tuple((offset // bst) % bn for bst, bn in zip(buf.stride(), buf.shape))
        if sum(a * bst for a, bst in zip(starts, buf.stride())) == offset and \
                all(a + n <= bn for a, n, bn in zip(starts, size, buf.shape)):
            return ("slice", starts, size)
    if t.is_contiguous():
        return ("flat", offset, size)
    return ("strided", size, stride, offset)


def _state_bases(carried: list[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per storage among the written statics that are no named buffer: the tensor itself when
    it is the only one, else a 1-D tensor over the union of their extents (a K/V cache written through
    `k[i]` and read through `k[i].transpose(1, 2)` must be ONE graph input, or the read misses the write)."""
    groups: dict[int, list[torch.Tensor]] = {}
    for t in carried:
        group = groups.setdefault(t.untyped_storage().data_ptr(), [])
        if all(u is not t for u in group):
            group.append(t)
    bases = []
    for group in groups.values():
        if len(group) == 1:
            bases.append(group[0])
            continue
        if len({t.dtype for t in group}) != 1:
            raise CaptureError("the step writes a tensor that it also reads as another dtype (a "
                               "reinterpreting view); onnxrt cannot carry that state")
        first = group[0]
        lo = min(_extent(t)[0] for t in group)
        hi = max(_extent(t)[1] for t in group)
        size = first.element_size()
        start = (lo - first.untyped_storage().data_ptr()) // size
        bases.append(first.new_empty(0).set_(first.untyped_storage(), start, ((hi - lo) // size,), (1,)))
    return bases


def plan(recording: Recording, buffers: Any) -> ExportPlan:
    """Sort the statics into ports (buffers, states) and constants; see the module docstring."""
    named = list(named_tensors(buffers).items())
    located = [_locate(t, named) for t in recording.statics]
    used = sorted({loc[0] for loc in located if loc is not None})
    written_bufs = {i for i in used if recording.writes(named[i][1])}
    ports = [Port(named[i][0], named[i][1], i in written_bufs) for i in used]
    port_of = {i: k for k, i in enumerate(used)}
    carried = [t for t, loc in zip(recording.statics, located)
               if loc is None and not t.is_mkldnn and recording.writes(t)]
    states = [(f"state.{len(ports) + k}", base) for k, base in enumerate(_state_bases(carried))]
    ports += [Port(name, base, True) for name, base in states]
    sources, constants = [], []
    for t, loc in zip(recording.statics, located):
        if loc is not None:
            sources.append(Source(port=port_of[loc[0]], view=loc[1]))
        elif not t.is_mkldnn and recording.writes(t):
            k, view = _locate(t, states)
            sources.append(Source(port=len(used) + k, view=view))
        else:
            sources.append(Source(const=len(constants)))
            constants.append(_dense(t) if t.is_mkldnn else t)
    return ExportPlan(recording, ports, sources, constants)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A oneDNN-packed weight as a plain constant; a 4-D (conv) one channels-last, the layout flashrt keeps
    its plain conv weights in (`flashrt.nn.conv1d`), so the aten conv that stands in for the fused one
    returns the fused op's channels-last output."""
    dense = t.to_dense()
    return dense.contiguous(memory_format=torch.channels_last) if dense.dim() == 4 else dense


def _encode_leaf(leaf: Any, static_index: dict[int, int]) -> Any:
    if isinstance(leaf, torch.Tensor):
        return ["static", static_index[id(leaf)]]
    if isinstance(leaf, float):
        return ["float", leaf.hex()]
    return [type(leaf).__name__, repr(leaf)]


def _program_digest(recording: Recording) -> str:
    """Deterministic across processes: statics by order of first use, intermediates by slot."""
    static_index = {id(t): i for i, t in enumerate(recording.statics)}
    h = hashlib.sha256(b"flashrt.onnx_export.program.v1\0")
    for step in recording.steps:
        reads = dict(step.reads)
        leaves = [["slot", reads[i]] if i in reads else _encode_leaf(leaf, static_index)
                  for i, leaf in enumerate(step.leaves)]
        h.update(json.dumps([str(step.func), str(step.spec), leaves, list(step.writes)]).encode())
    return h.hexdigest()


# --------------------------------------------------------------------------------------- the module


def _unary(y: torch.Tensor, attr: str | None, scalars: Sequence[Any], algorithm: str | None) -> torch.Tensor:
    fn = {"none": lambda: y, "": lambda: y, None: lambda: y, "relu": lambda: torch.relu(y),
          "leaky_relu": lambda: torch.nn.functional.leaky_relu(y, float(scalars[0])),
          "gelu": lambda: torch.nn.functional.gelu(y, approximate=algorithm or "none"),
          "swish": lambda: torch.nn.functional.silu(y), "silu": lambda: torch.nn.functional.silu(y),
          "sigmoid": lambda: torch.sigmoid(y), "tanh": lambda: torch.tanh(y),
          "hardtanh": lambda: torch.clamp(y, float(scalars[0]), float(scalars[1]))}.get(attr)
    if fn is None:
        raise CaptureError(f"onnx export: oneDNN fused unary {attr!r} has no portable form here")
    return fn()


def _binary(y: torch.Tensor, other: torch.Tensor, attr: str, alpha: Any = None) -> torch.Tensor:
    if attr in ("add", "sum"):
        return y + (other if alpha is None else other * alpha)
    if attr == "sub":
        return y - (other if alpha is None else other * alpha)
    if attr == "mul":
        return y * other
    raise CaptureError(f"onnx export: oneDNN fused binary {attr!r} has no portable form here")


def _conv(x, w, b, padding, stride, dilation, groups) -> torch.Tensor:
    return torch.ops.aten.convolution.default(x, w, b, stride, padding, dilation, False, [0] * len(padding),
                                              groups)


def _convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups) -> torch.Tensor:
    """aten.convolution; a depthwise transposed conv strided along the last axis only (one input and one
    output channel per group: BigVGAN's 2x anti-alias upsamplers) as its phases (`_depthwise_phases`)."""
    if transposed and groups > 1 and x.shape[1] == groups == w.shape[0] and w.shape[1] == 1 and \
            not any(output_padding) and all(d == 1 for d in dilation) and all(k == 1 for k in w.shape[2:-1]) \
            and all(st == 1 for st in stride[:-1]) and not any(padding[:-1]):
        return _depthwise_phases(x, w, b, stride[-1], padding[-1])
    return torch.ops.aten.convolution.default(x, w, b, stride, padding, dilation, transposed, output_padding,
                                              groups)


def _depthwise_phases(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, s: int,
                      pad: int) -> torch.Tensor:
    """A depthwise transposed conv (weight (C, 1, ..., K), stride s and padding pad on the last axis) as s
    depthwise stride-1 convs over x, one per output phase, interleaved. Output n = t s + p takes
    x[i] w[k] for k = n + pad - i s: with (q, r) = divmod(p + pad, s), x[t + q - j] w[j s + r] for every
    j with j s + r < K, a correlation of x with the phase's taps reversed. onnxruntime runs a depthwise
    ConvTranspose as one tiny GEMM per channel (BigVGAN: 24 % of its time, 2x this form's); its depthwise
    Conv has a vectorized kernel. The same products, summed in the conv kernel's order."""
    steps, taps, conv = x.shape[-1], w.shape[-1], F.conv2d if x.dim() == 4 else F.conv1d
    length = (steps - 1) * s - 2 * pad + taps
    frames = -(-length // s)
    phases = []
    for p in range(s):
        q, r = divmod(p + pad, s)
        n = len(range(r, taps, s))                          # this phase's taps: offsets q - n + 1 .. q
        if n == 0:
            zero = x.new_zeros(*x.shape[:-1], frames)
            phases.append(zero if b is None else zero + b.view(-1, *[1] * (x.dim() - 2)))
            continue
        xp = _shift(x, n - 1 - q, frames + q - steps)         # output t reads x[t + q - n + 1 ...]
        phases.append(conv(xp, w[..., r::s].flip(-1), b, groups=x.shape[1]))
    return torch.stack(phases, -1).flatten(-2)[..., :length]


def _shift(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """x with ``left`` / ``right`` zeros added on the last axis (a negative count cuts that many steps)."""
    x = x[..., max(0, -left):x.shape[-1] - max(0, -right)]
    return F.pad(x, (max(0, left), max(0, right))) if left > 0 or right > 0 else x


def _conv_pointwise(x, w, b, padding, stride, dilation, groups, attr, scalars, algorithm):
    return _unary(_conv(x, w, b, padding, stride, dilation, groups), attr, scalars, algorithm)


def _conv_pointwise_binary(x, other, w, b, padding, stride, dilation, groups, battr, alpha, uattr, uscalars,
                           ualgorithm):
    y = _binary(_conv(x, w, b, padding, stride, dilation, groups), other, battr, alpha)
    return _unary(y, uattr, uscalars, ualgorithm)


def _conv_pointwise_into(other, x, *rest):
    return other.copy_(_conv_pointwise_binary(x, other, *rest))


def _linear_pointwise(x, w, b, attr, scalars, algorithm):
    return _unary(torch.nn.functional.linear(x, w, b), attr, scalars, algorithm)


def _linear_pointwise_binary(x, other, w, b, attr):
    return _binary(torch.nn.functional.linear(x, w, b), other, attr)


def _along(index: torch.Tensor, dim: int, source: torch.Tensor) -> torch.Tensor:
    """The 1-D ``index`` of an index_copy / index_add along ``dim`` as the element-wise index of a scatter:
    broadcast over every other axis of ``source``."""
    shape = [1] * source.dim()
    shape[dim] = index.numel()
    return index.reshape(shape).expand(source.shape)


def _index_copy_(x: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """index_copy_ as scatter_ along ``dim`` (ONNX ScatterElements on that axis). torch's decomposition of
    index_copy_ fails on channels-last strides, and an index_put_ on an inner axis is written as a
    Transpose of the whole tensor to put the axis first, a ScatterND, and a Transpose back: two full
    copies for a write of a few steps (BigVGAN's padding fix-ups on the time axis: 16 % of its
    onnxruntime time). Same values: a copy."""
    dim = dim % x.dim()
    return x.scatter_(dim, _along(index, dim, source), source)


def _index_copy(x: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    return _index_copy_(x.clone(), dim, index, source)


def _index_add_(x: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *,
                alpha: Any = 1) -> torch.Tensor:
    """index_add_ as scatter_add_ along ``dim`` (ScatterElements, reduction add): no transposes, the same
    single add per element (alpha folded into the source as index_add does)."""
    dim = dim % x.dim()
    return x.scatter_add_(dim, _along(index, dim, source), source if alpha == 1 else source * alpha)


def _index_add(x: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *,
               alpha: Any = 1) -> torch.Tensor:
    return _index_add_(x.clone(), dim, index, source, alpha=alpha)


def _pow_(x: torch.Tensor, exponent: Any) -> torch.Tensor:
    """x ** 2 as x * x (ATen's own CPU kernel for exponent 2, so the same rounding); onnxruntime's Pow
    runs the generic power per element, 45 % of BigVGAN's onnxruntime time (its snakes' sin(ax)^2)."""
    return x.mul_(x) if exponent == 2 else torch.ops.aten.pow_.Scalar(x, exponent)


def _pow(x: torch.Tensor, exponent: Any) -> torch.Tensor:
    return x * x if exponent == 2 else torch.ops.aten.pow.Tensor_Scalar(x, exponent)


def _unbind(x: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, ...]:
    """unbind as selects (Gather): the exporter writes unbind as SplitToSequence / SequenceAt, which
    TensorRT's ONNX parser does not take and ONNX does not define for bfloat16."""
    return tuple(x.select(dim, i) for i in range(x.shape[dim]))


def _pieces(x: torch.Tensor, sizes: Sequence[int], dim: int) -> tuple[torch.Tensor, ...]:
    """Consecutive narrows (Slice) of the given sizes along dim (split / chunk without sequences)."""
    out, start = [], 0
    for n in sizes:
        out.append(x.narrow(dim, start, n))
        start += n
    return tuple(out)


def _split(x: torch.Tensor, size: int, dim: int = 0) -> tuple[torch.Tensor, ...]:
    total = x.shape[dim]
    return _pieces(x, [min(size, total - a) for a in range(0, total, size)] or [0], dim)


def _split_with_sizes(x: torch.Tensor, sizes: Sequence[int], dim: int = 0) -> tuple[torch.Tensor, ...]:
    return _pieces(x, sizes, dim)


def _chunk(x: torch.Tensor, chunks: int, dim: int = 0) -> tuple[torch.Tensor, ...]:
    total = x.shape[dim]
    return _split(x, -(-total // chunks) if total else 1, dim)


def _sdpa_flash_cpu(q, k, v, dropout_p: float = 0.0, is_causal: bool = False, *, attn_mask=None, scale=None):
    """CPU flash attention in plain ops: (output, logsumexp). Grouped-query key/value heads are repeated
    for their query heads, as the kernel does (the exporter's own form assumes equal head counts)."""
    if dropout_p:
        raise CaptureError("onnx export: attention with dropout has no static graph")
    rep = q.shape[-3] // k.shape[-3]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    s = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(s.shape[-1] - s.shape[-2])
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    out, lse = torch.matmul(torch.softmax(s, dim=-1), v), torch.logsumexp(s, dim=-1)
    # laid out as the kernel lays them out (the output like the query, heads inside positions in the
    # logsumexp): a later view of them that works in eager must work here too
    return torch.empty_like(q).copy_(out), lse.transpose(-2, -1).contiguous().transpose(-2, -1)


def _portable_ops() -> dict[Any, Callable[..., Any]]:
    """Ops the exporter cannot take or writes slowly, and their aten compositions: CPU-only fused ops
    (oneDNN, as flashrt.nn picks them on CPU; same math unfused, equal within float32 rounding),
    index_copy / index_add as scatters along their axis (no whole-tensor transposes), x ** 2 as x * x,
    unbind / split / chunk as selects and slices (no ONNX sequence ops: TensorRT cannot parse them and
    ONNX has none for bfloat16), the CPU flash attention with grouped-query heads and flashrt's own
    ``flashrt::`` custom ops (their references: the CUDA kernel table picks them on a GPU)."""
    mk = getattr(torch.ops, "mkldnn", None)
    pairs = [("_convolution_pointwise", "default", _conv_pointwise),
             ("_convolution_pointwise", "binary", _conv_pointwise_binary),
             ("_convolution_pointwise_", "binary", _conv_pointwise_into),
             ("_linear_pointwise", "default", _linear_pointwise),
             ("_linear_pointwise", "binary", _linear_pointwise_binary)]
    table: dict[Any, Callable[..., Any]] = {
        torch.ops.aten.index_copy_.default: _index_copy_, torch.ops.aten.index_copy.default: _index_copy,
        torch.ops.aten.index_add_.default: _index_add_, torch.ops.aten.index_add.default: _index_add,
        torch.ops.aten.pow_.Scalar: _pow_, torch.ops.aten.pow.Tensor_Scalar: _pow,
        torch.ops.aten.convolution.default: _convolution,
        torch.ops.aten.unbind.int: _unbind, torch.ops.aten.chunk.default: _chunk,
        torch.ops.aten.split.Tensor: _split, torch.ops.aten.split_with_sizes.default: _split_with_sizes,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa_flash_cpu}
    for packet, overload, fn in pairs:
        op = getattr(getattr(mk, packet, None), overload, None) if mk is not None else None
        if op is not None:
            table[op] = fn
    from flashrt.nn import fused
    for name, ref in (("rms_norm", fused.rms_norm_ref), ("add_rms_norm", fused.add_rms_norm_ref),
                      ("rope_qkv", fused.rope_qkv_ref), ("gelu_mul", fused.gelu_mul_ref),
                      ("silu_mul", fused.silu_mul_ref)):
        table[getattr(torch.ops.flashrt, name).default] = ref
    return table


PORTABLE = _portable_ops()



class StepModule(torch.nn.Module):
    """forward(*port inputs) -> written ports: the recorded program with statics replaced (see docstring)."""

    def __init__(self, p: ExportPlan) -> None:
        super().__init__()
        self.steps, self.nslots = p.recording.steps, p.recording.nslots
        self.sources, self.written = p.sources, [port.written for port in p.ports]
        for i, t in enumerate(p.constants):
            self.register_buffer(f"c{i}", t.detach())
        index = {id(t): i for i, t in enumerate(p.recording.statics)}
        self.static_pos = [[(pos, index[id(leaf)]) for pos, leaf in enumerate(step.leaves)
                            if isinstance(leaf, torch.Tensor)] for step in self.steps]

    def _static(self, src: Source, ports: list[torch.Tensor]) -> torch.Tensor:
        if src.const is not None:
            return getattr(self, f"c{src.const}")
        base = ports[src.port]
        if src.view is None:
            return base
        kind, *geometry = src.view
        if kind == "slice":
            starts, size = geometry
            return base[tuple(slice(a, a + n) for a, n in zip(starts, size))]
        if kind == "flat":
            offset, size = geometry
            n = 1
            for d in size:
                n *= d
            return base.reshape(-1)[offset:offset + n].view(size)
        return base.as_strided(*geometry)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ports = [x.clone() if w else x for x, w in zip(inputs, self.written)]
        statics = [self._static(src, ports) for src in self.sources]
        env: list[Any] = [None] * self.nslots
        for step, static_pos in zip(self.steps, self.static_pos):
            leaves = list(step.leaves)
            for pos, i in static_pos:
                leaves[pos] = statics[i]
            for pos, slot in step.reads:
                leaves[pos] = env[slot]
            args, kwargs = tree_unflatten(leaves, step.spec)
            out = PORTABLE.get(step.func, step.func)(*args, **kwargs)
            if step.writes:
                outs, _ = tree_flatten(out)
                for pos, slot in step.writes:
                    env[slot] = outs[pos]
        return tuple(x for x, w in zip(ports, self.written) if w)


def exporter_versions() -> str:
    import onnx
    import onnxscript
    return f"torch {torch.__version__}; onnxscript {onnxscript.__version__}; onnx {onnx.__version__}; " \
           f"opset {OPSET}"


def export_onnx(p: ExportPlan) -> bytes:
    """The serialized ONNX model of the plan, checked by onnx.checker, its names those of the ports."""
    import onnx
    if not p.outputs:
        raise CaptureError("the step writes no buffer: nothing to export")
    module = StepModule(p).eval()
    args = tuple(port.tensor for port in p.ports)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, dynamo=True, input_names=p.input_names(),
                                    output_names=p.output_names(), opset_version=OPSET, verbose=False,
                                    external_data=False, optimize=False,
                                    custom_translation_table=_translations())
    model = castlike_to_cast(program.model_proto)
    buf = io.BytesIO()
    onnx.save_model(model, buf)
    data = buf.getvalue()
    check_model(data, p.input_names(), p.output_names())
    return data


def _translations() -> dict[Any, Callable[..., Any]]:
    """ONNX forms the exporter is given: the fp8 Q/DQ of a quantized GEMM's portable form
    (`flashrt.quant.linear.fp8_qdq`, `fp8_dequant`) as float8e4m3fn QuantizeLinear / DequantizeLinear with
    the calibrated scale (zero point 0, saturating); and a write into a slice (aten slice_scatter, what an
    in-place op on ``y[..., a:b]`` becomes) as a ScatterElements along that axis where the block is at
    most half the axis (onnxruntime writes it in place when nothing else reads the old tensor), else as a
    Concat of the kept parts around the new block. torch's own form transposes the axis to the front and
    back around a ScatterND, two copies of the whole tensor for a write of a few steps (BigVGAN's
    resampler edges: 44 % of its onnxruntime time; a Concat still cost 12 %). Same values: copies."""
    import onnx
    from onnxscript import opset19 as op

    from flashrt.quant import linear

    zero = onnx.helper.make_tensor("zero", onnx.TensorProto.FLOAT8E4M3FN, [], [0.0])

    def qdq(x, scale: float):
        s = op.Constant(value_float=scale)
        return op.DequantizeLinear(op.QuantizeLinear(x, s, op.Constant(value=zero)), s)

    def dequant(w, scale: float, r0: int, r1: int, c0: int, c1: int):
        full = op.DequantizeLinear(w, op.Constant(value_float=scale))
        return op.Slice(full, op.Constant(value_ints=[r0, c0]), op.Constant(value_ints=[r1, c1]),
                        op.Constant(value_ints=[0, 1]))

    def slice_scatter(x, src, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1):
        rank, axis = len(x.shape), op.Constant(value_ints=[dim % len(x.shape)])
        dim, size = dim % rank, x.shape[dim % rank]
        lo, hi = (max(0, min(size, v + size if v < 0 else v))
                  for v in (start or 0, size if end is None else end))
        ints = lambda *v: op.Constant(value_ints=list(v))      # noqa: E731
        if not len(range(lo, hi, step)):
            return op.Identity(x)
        if step != 1 or 2 * len(range(lo, hi, step)) <= size:
            shape = [1] * rank
            shape[dim] = len(range(lo, hi, step))
            index = op.Reshape(ints(*range(lo, hi, step)), ints(*shape))
            return op.ScatterElements(x, op.Expand(index, op.Shape(src)), src, axis=dim)
        parts = [op.Slice(x, ints(0), ints(lo), axis)] if lo > 0 else []
        parts.append(src)
        if hi < size:
            parts.append(op.Slice(x, ints(hi), ints(size), axis))
        return op.Concat(*parts, axis=dim) if len(parts) > 1 else op.Identity(src)

    return {linear.fp8_qdq._opoverload: qdq, linear.fp8_dequant._opoverload: dequant,
            torch.ops.aten.slice_scatter.default: slice_scatter}


def castlike_to_cast(model: Any) -> Any:
    """Every CastLike(x, like) whose ``like`` has a known element type becomes Cast(x, to=that type), in
    place (returned). CastLike is an ONNX function op that not every runtime imports (TensorRT's parser
    lists no importer for it); the exporter writes ~200 of them in a Pi0 step."""
    import onnx

    castlikes = [n for n in model.graph.node if n.op_type == "CastLike"]
    if not castlikes:
        return model
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in (*inferred.graph.value_info, *inferred.graph.input,
                                                             *inferred.graph.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    for node in model.graph.node:
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        if node.op_type == "Constant" and value is not None:
            types[node.output[0]] = value.data_type
    for node in castlikes:
        to = types.get(node.input[1], 0)
        if to:
            cast = onnx.helper.make_node("Cast", [node.input[0]], list(node.output), name=node.name, to=to)
            node.CopyFrom(cast)
    return model


def check_model(data: bytes, inputs: Sequence[str], outputs: Sequence[str]) -> None:
    """onnx.checker (full) and the graph's input/output names against the ports'; CaptureError otherwise."""
    import onnx
    model = onnx.load_model_from_string(data)
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.checker.ValidationError as err:
        raise CaptureError(f"exported ONNX model fails onnx.checker: {err}") from None
    got_in = [i.name for i in model.graph.input]
    got_out = [o.name for o in model.graph.output]
    if got_in != list(inputs) or got_out != list(outputs):
        raise CaptureError(f"exported ONNX names {got_in} -> {got_out}, expected {list(inputs)} -> "
                           f"{list(outputs)}")


def consumed_inputs(data: bytes) -> set[str]:
    """Graph inputs some node reads (an input of a fully overwritten buffer is not)."""
    import onnx
    model = onnx.load_model_from_string(data)
    names = {i.name for i in model.graph.input}
    used: set[str] = set()
    for node in model.graph.node:
        used.update(n for n in node.input if n in names)
    used.update(o.name for o in model.graph.output if o.name in names)
    return used
