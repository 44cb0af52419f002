"""The onnxrt graph backend on toy steps: buffers as named ONNX inputs/outputs, views and partial writes,
state tensors, oneDNN fused ops lowered, parity with eager (onnxruntime is the independent runtime);
the export cache: hit without export, miss on every key field, corrupt/truncated/tampered/copied entries
rebuilt and never used."""

from __future__ import annotations

import functools
import shutil

import onnx
import pytest
import torch

from flashrt.errors import CaptureError, ConfigError
from flashrt.runtime import graphs, onnx_export, onnxrt
from flashrt.runtime.export_cache import ExportCache
from flashrt.runtime.graphs import get_backend

TOL = 1e-5


@pytest.fixture
def backend(tmp_path):
    return functools.partial(onnxrt.OnnxRuntimeBackend, cache_dir=tmp_path / "onnx", threads=1)


class Toy:
    """A step that reads `x`, writes all of `y`, part of `z` (the rest must survive) and an unnamed state."""

    def __init__(self, seed: int = 0, scale: float = 0.5, width: int = 4) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lin = torch.nn.Linear(width, 6)
        self.conv = torch.nn.Conv1d(3, 3, 3, padding=1)
        for p in (*self.lin.parameters(), *self.conv.parameters()):
            p.data = torch.randn(p.shape, generator=g)
        self.scale = scale
        self.buffers = {"x": torch.randn(2, width, generator=g), "y": torch.zeros(2, 6),
                        "z": torch.full((1, 3, 5), 7.0), "unused": torch.zeros(3)}
        self.count = torch.zeros(1)  # not a declared buffer, written by the step: carried as a state

    def step(self) -> None:
        b = self.buffers
        h = torch.nn.functional.layer_norm(torch.relu(self.lin(b["x"])), (6,)) * self.scale
        b["y"].copy_(h)
        b["z"][..., 1:3].copy_(self.conv(h[:, :3].t().unsqueeze(0))[..., :2])
        self.count.add_(1)


def _run(graph_or_fn, toy: Toy) -> dict[str, torch.Tensor]:
    toy.buffers["z"].fill_(7.0)
    toy.count.zero_()
    graph_or_fn()
    return {**{k: v.clone() for k, v in toy.buffers.items()}, "count": toy.count.clone()}


def test_toy_step_equals_eager_and_names_follow_buffers(backend):
    toy = Toy()
    graph = backend().capture(toy.step, toy.buffers)
    model = onnx.load_model_from_string(graph.model_bytes)
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["x", "y.in", "z.in", "state.3.in"]
    assert [o.name for o in model.graph.output] == ["y", "z", "state.3"]
    for seed in range(3):
        toy.buffers["x"].copy_(torch.randn(2, 4, generator=torch.Generator().manual_seed(seed + 10)))
        got = _run(graph.replay, toy)
        want = _run(toy.step, toy)
        for name in want:
            assert (got[name] - want[name]).abs().max() <= TOL, name
        assert torch.equal(got["z"][..., [0, 3, 4]], torch.full((1, 3, 3), 7.0))  # the rest is kept
        assert got["count"].item() == 1.0


def test_outputs_land_in_the_frontends_own_buffers(backend):
    toy = Toy()
    y, z = toy.buffers["y"], toy.buffers["z"]
    ptrs = (y.data_ptr(), z.data_ptr())
    graph = backend().capture(toy.step, toy.buffers)
    y.zero_()
    graph.replay()
    assert (y.data_ptr(), z.data_ptr()) == ptrs and y.abs().sum() > 0


def test_onednn_fused_ops_are_lowered(backend):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(8, 6, generator=g), torch.randn(8, generator=g)
    cw = torch.randn(4, 4, 1, 3, generator=g)
    bufs = {"x": torch.randn(3, 6, generator=g), "r": torch.randn(1, 4, 1, 9, generator=g),
            "y": torch.zeros(3, 8), "c": torch.zeros(1, 4, 1, 9)}
    mk = torch.ops.mkldnn

    def step():
        h = mk._linear_pointwise(bufs["x"], w, b, "gelu", [], "tanh")
        bufs["y"].copy_(mk._linear_pointwise.binary(bufs["x"], h, w, None, "mul"))
        c = mk._convolution_pointwise(bufs["r"], cw, None, [0, 1], [1, 1], [1, 1], 1, "leaky_relu", [0.1], "")
        bufs["c"].copy_(mk._convolution_pointwise.binary(c, bufs["r"], cw, None, [0, 1], [1, 1], [1, 1], 1,
                                                         "add", None, None, [], None))
    graph = backend().capture(step, bufs)
    step()
    want = {k: v.clone() for k, v in bufs.items()}
    bufs["y"].zero_()
    bufs["c"].zero_()
    graph.replay()
    for name in ("y", "c"):
        assert (bufs[name] - want[name]).abs().max() <= TOL


def test_refusals_and_options(backend):
    bufs = {"x": torch.zeros(3), "y": torch.zeros(3)}
    with pytest.raises(CaptureError, match="random"):
        backend().capture(lambda: bufs["y"].copy_(torch.rand(3)), bufs)
    with pytest.raises(CaptureError, match="writes no buffer"):
        backend().capture(lambda: bufs["x"] + 1, bufs)
    with pytest.raises(ConfigError, match="opt_level"):
        get_backend("onnxrt", opt_level="turbo")
    with pytest.raises(ConfigError, match="threads"):
        get_backend("onnxrt", threads=0)
    assert "onnxrt" in graphs.backends_for("cpu")


def test_moved_buffer_is_refused(backend):
    toy = Toy()
    graph = backend().capture(toy.step, toy.buffers)
    toy.buffers["y"] = torch.zeros(2, 6)
    with pytest.raises(CaptureError, match="'y'"):
        graph.replay()


# ---------------------------------------------------------------------------------------------- cache


def _capture(backend, toy: Toy):
    before = onnxrt.STATS.exports
    graph = backend().capture(toy.step, toy.buffers)
    return graph, onnxrt.STATS.exports - before


def test_second_load_does_not_export(backend):
    toy = Toy()
    first, n1 = _capture(backend, toy)
    second, n2 = _capture(backend, Toy())
    assert (n1, n2) == (1, 0) and not first.cache_hit and second.cache_hit
    assert second.model_bytes == first.model_bytes
    assert (_run(second.replay, toy)["y"] - _run(toy.step, toy)["y"]).abs().max() <= TOL


@pytest.mark.parametrize("change", ["weights", "program", "shapes"])
def test_each_content_field_is_a_miss(backend, change):
    _capture(backend, Toy())
    other = {"weights": Toy(seed=1), "program": Toy(scale=0.25), "shapes": Toy(width=5)}[change]
    graph, n = _capture(backend, other)
    assert n == 1 and not graph.cache_hit
    assert (_run(graph.replay, other)["y"] - _run(other.step, other)["y"]).abs().max() <= TOL


@pytest.mark.parametrize("field", ["runtime", "arch", "exporter", "precision", "scheme"])
def test_each_version_field_is_a_miss(backend, tmp_path, field):
    toy = Toy()
    graph, _ = _capture(backend, toy)
    b = backend()
    key = b.key(onnxrt.ox.plan(onnxrt.ox.record(toy.step, toy.buffers), toy.buffers))
    cache = ExportCache(tmp_path / "onnx")
    assert cache.load(key) == graph.model_bytes
    changed = type(key)(**{**key.fields(), field: key.fields()[field] + (1 if field == "scheme" else "x")})
    assert cache.load(changed) is None and cache.last_miss_reason == "no entry"
    shutil.copy(cache.path_for(key), cache.path_for(changed))         # an entry copied under another key
    assert cache.load(changed) is None and f"{field} differ" in cache.last_miss_reason


@pytest.mark.parametrize("damage", ["truncate", "flip_model_byte", "edit_key", "garbage", "empty"])
def test_damaged_entry_is_rebuilt_never_used(backend, tmp_path, damage):
    graph, _ = _capture(backend, Toy())
    (path,) = ExportCache(tmp_path / "onnx").files()
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:len(data) - 100]
    elif damage == "flip_model_byte":
        data[-50] ^= 0x01
    elif damage == "edit_key":
        scheme = onnx_export.SCHEME_VERSION
        edited = bytes(data).replace(f'"scheme":{scheme}'.encode(), f'"scheme":{scheme + 1}'.encode(), 1)
        assert edited != bytes(data)
        data = bytearray(edited)
    elif damage == "garbage":
        data = bytearray(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + bytes(data[24:]))
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    toy = Toy()
    rebuilt, n = _capture(backend, toy)
    assert n == 1 and not rebuilt.cache_hit and rebuilt.model_bytes == graph.model_bytes
    assert path.read_bytes() != bytes(data)                              # replaced by a good entry
    assert (_run(rebuilt.replay, toy)["y"] - _run(toy.step, toy)["y"]).abs().max() <= TOL
    assert [e.problem for e in ExportCache(tmp_path / "onnx").entries()] == [""]


def test_no_cache_exports_every_time(tmp_path):
    toy = Toy()
    for _ in range(2):
        before = onnxrt.STATS.exports
        onnxrt.OnnxRuntimeBackend(cache=False).capture(toy.step, toy.buffers)
        assert onnxrt.STATS.exports == before + 1


def test_a_state_written_through_one_view_and_read_through_another_is_one_input(backend):
    """A K/V cache outside the declared buffers, written with index_copy_ through `cache[i]` and read
    through `cache[i].transpose(1, 2)` in the same step: one state input/output, so the read sees the
    write (two separate inputs gave 31 off and a clobbered cache)."""
    cache = torch.zeros(2, 3, 5, 4)
    views = [(cache[i], cache[i].transpose(1, 2)) for i in range(2)]
    g = torch.Generator().manual_seed(0)
    bufs = {"x": torch.randn(3, 1, 4, generator=g), "slot": torch.tensor([2]), "y": torch.zeros(2, 3, 1, 5)}

    def step() -> None:
        for i, (k, kt) in enumerate(views):
            k.index_copy_(1, bufs["slot"], bufs["x"] * (i + 1))
            bufs["y"][i].copy_(torch.bmm(bufs["x"], kt))

    graph = backend().capture(step, bufs)
    names = [i.name for i in onnx.load_model_from_string(graph.model_bytes).graph.input]
    assert sum(n.startswith("state.") for n in names) == 1, names
    for slot in (2, 4, 0):
        bufs["slot"].fill_(slot)
        start = torch.randn(cache.shape, generator=g)
        cache.copy_(start)
        step()
        want, want_cache = bufs["y"].clone(), cache.clone()
        cache.copy_(start)
        bufs["y"].zero_()
        graph.replay()
        assert (bufs["y"] - want).abs().max() <= TOL
        assert (cache - want_cache).abs().max() == 0


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_attention_exports(backend, causal):
    """SDPA with fewer key/value heads than query heads (enable_gqa, the Llama/Qwen3 layers) runs the CPU
    flash kernel; its export repeats the key/value heads (the exporter's own form failed shape inference)."""
    g = torch.Generator().manual_seed(3)
    bufs = {"q": torch.randn(1, 8, 5, 4, generator=g), "kv": torch.randn(2, 1, 2, 5, 4, generator=g),
            "bias": torch.randn(1, 1, 5, 5, generator=g), "out": torch.zeros(1, 8, 5, 4)}

    def step() -> None:
        mask = None if causal else bufs["bias"]
        att = torch.nn.functional.scaled_dot_product_attention(
            bufs["q"], bufs["kv"][0], bufs["kv"][1], attn_mask=mask, is_causal=causal, enable_gqa=True)
        bufs["out"].copy_(att)

    graph = backend().capture(step, bufs)
    step()
    want = bufs["out"].clone()
    bufs["out"].zero_()
    graph.replay()
    assert (bufs["out"] - want).abs().max() <= TOL


@pytest.mark.parametrize("query", ["contiguous", "transposed"])
def test_attention_lowering_lays_out_its_outputs_as_the_kernel_does(query):
    """A view of the kernel's output that works in eager (Llama: a transposed query, the output transposed
    back and viewed) must work on the lowered form inside the export too: same strides, same values."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, h, 3, 16, generator=g) for h in (8, 2, 2))
    if query == "transposed":
        q = torch.randn(2, 3, 8, 16, generator=g).transpose(1, 2)
    mask = torch.randn(2, 1, 3, 3, generator=g)
    want = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, attn_mask=mask)
    got = onnx_export.PORTABLE[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default](
        q, k, v, attn_mask=mask)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.stride() == b.stride()
        assert (a - b).abs().max() <= TOL


# ------------------------------------------------------------------------------ int8 as Q/DQ


class QuantToy:
    """y = linear2(gelu(linear1(x))) with both weights int8 or fp8 (static scales at `amax`)."""

    def __init__(self, amax: float = 3.0, mode: str = "static", kind: str = "int8") -> None:
        from flashrt.quant import linear as L
        g = torch.Generator().manual_seed(4)
        self.l1, self.l2 = torch.nn.Linear(32, 48), torch.nn.Linear(48, 16)
        for p in (*self.l1.parameters(), *self.l2.parameters()):
            p.data = torch.randn(p.shape, generator=g) * 0.3
        for lin in (self.l1, self.l2):
            L.install(lin, {"": L.quantize_weight(lin.weight, kind, torch.tensor(amax), mode=mode)})
        self.buffers = {"x": torch.randn(24, 32, generator=g), "y": torch.zeros(24, 16)}

    def step(self) -> None:
        b = self.buffers
        b["y"].copy_(self.l2(torch.nn.functional.gelu(self.l1(b["x"]))))

    def replays_match(self, graph, seeds: int = 3) -> None:
        """The graph's replay equals the eager step on fresh inputs (within float rounding of the GEMMs)."""
        for seed in range(seeds):
            self.buffers["x"].copy_(torch.randn(24, 32, generator=torch.Generator().manual_seed(seed)) * 2)
            graph.replay()
            got = self.buffers["y"].clone()
            self.step()
            assert (got - self.buffers["y"]).abs().max() <= 1e-4 * self.buffers["y"].abs().max()


def test_int8_exports_qdq_nodes_with_flashrts_scales_and_matches_eager(backend):
    """onnxruntime runs flashrt's int8 GEMMs from QuantizeLinear / DequantizeLinear nodes whose scales are
    the calibrated ones (no calibrator of its own); the output equals eager int8 within float rounding."""
    from flashrt.quant import linear as L
    toy = QuantToy()
    graph = backend().capture(toy.step, toy.buffers)
    model = onnx.load_model_from_string(graph.model_bytes)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QuantizeLinear") == 2 and ops.count("DequantizeLinear") == 4, ops
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    consts.update({n.output[0]: onnx.numpy_helper.to_array(a.t) for n in model.graph.node
                   if n.op_type == "Constant" for a in n.attribute if a.name == "value"})
    qa = L.activation_qmax("cpu")
    x_scales = [float(consts[n.input[1]]) for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert x_scales == pytest.approx([3.0 / qa] * 2, rel=1e-7)
    weights = [consts[n.input[0]] for n in model.graph.node if n.op_type == "DequantizeLinear"
               and n.input[0] in consts]
    assert sorted(w.shape for w in weights) == [(16, 48), (48, 32)]  # the int8 weights, as stored
    assert all(w.dtype == "int8" for w in weights)
    toy.replays_match(graph)


def test_int8_scales_are_part_of_the_export_key(backend):
    first, n1 = _capture(backend, QuantToy(amax=3.0))
    again, n2 = _capture(backend, QuantToy(amax=3.0))
    other, n3 = _capture(backend, QuantToy(amax=2.0))
    assert (n1, n2, n3) == (1, 0, 1) and again.cache_hit and not other.cache_hit


def test_int8_per_token_exports_its_float_form(backend):
    """Per-token scales have no static Q/DQ: the same integers in plain float ops."""
    toy = QuantToy(mode="per_token")
    graph = backend().capture(toy.step, toy.buffers)
    ops = [n.op_type for n in onnx.load_model_from_string(graph.model_bytes).graph.node]
    assert "QuantizeLinear" not in ops and "Round" in ops
    graph.replay()
    got = toy.buffers["y"].clone()
    toy.step()
    assert (got - toy.buffers["y"]).abs().max() <= 1e-5 * toy.buffers["y"].abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unbind_split_chunk_export_without_sequence_ops(backend, dtype):
    """TensorRT's parser takes no SplitToSequence / SequenceAt, and ONNX defines none for bfloat16."""
    g = torch.Generator().manual_seed(7)
    bufs = {"x": torch.randn(3, 6, 8, generator=g).to(dtype), "y": torch.zeros(6, 15, dtype=dtype)}

    def step():
        a, b, c = bufs["x"].unbind(0)
        p, q = a.chunk(2, dim=-1)
        r, s = b.split([3, 5], dim=-1)
        t = c.split(5, dim=-1)
        bufs["y"].copy_(torch.cat([p * q.sum(-1, keepdim=True), s, r, t[1] + t[0][:, :3]], dim=-1))
    p = onnx_export.plan(onnx_export.record(step, bufs), bufs)
    model = onnx.load_model_from_string(onnx_export.export_onnx(p))
    onnx.checker.check_model(model, full_check=True)  # bfloat16 SplitToSequence failed here
    ops = {n.op_type for n in model.graph.node}
    assert not {"SplitToSequence", "SequenceAt", "SequenceConstruct", "CastLike"} & ops, ops
    if dtype == torch.float32:  # onnxruntime's CPU provider has no bfloat16 Mul
        graph = backend().capture(step, bufs)
        graph.replay()
        got = bufs["y"].clone()
        step()
        assert (got - bufs["y"]).abs().max() <= TOL


def test_castlike_of_a_known_type_becomes_cast():
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    like = numpy_helper.from_array(np.zeros((), np.float16), "like")
    graph = helper.make_graph(
        [helper.make_node("CastLike", ["x", "like"], ["y"]), helper.make_node("CastLike", ["x", "z"], ["w"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
              helper.make_tensor_value_info("z", TensorProto.UNDEFINED, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2]),
         helper.make_tensor_value_info("w", TensorProto.UNDEFINED, None)], [like])
    model = onnx_export.castlike_to_cast(helper.make_model(graph))
    first, second = model.graph.node
    assert first.op_type == "Cast" and list(first.input) == ["x"]
    assert first.attribute[0].i == TensorProto.FLOAT16
    assert second.op_type == "CastLike"  # unknown target type: left as it is


def test_fp8_exports_float8_qdq_and_matches_eager(backend):
    """fp8 GEMMs as float8e4m3fn QuantizeLinear / DequantizeLinear at the calibrated scales (opset 19)."""
    toy = QuantToy(kind="fp8")
    graph = backend().capture(toy.step, toy.buffers)
    model = onnx.load_model_from_string(graph.model_bytes)
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QuantizeLinear") == 2 and ops.count("DequantizeLinear") == 4, ops
    fp8 = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT8E4M3FN]
    assert sorted(tuple(t.dims) for t in fp8) == [(16, 48), (48, 32)]
    toy.replays_match(graph)


@pytest.mark.parametrize("rank", [3, 4])
def test_depthwise_transposed_conv_as_phases_equals_the_transposed_conv(rank):
    """The exporter's form of a depthwise transposed conv (one stride-1 depthwise conv per output phase),
    replayed by torch in float64 over strides, paddings, kernels and lengths (short inputs included)."""
    g, F = torch.Generator().manual_seed(3), torch.nn.functional
    for steps, taps, stride, pad, bias in [(5, 12, 2, 5, False), (17, 12, 2, 0, True), (1, 12, 2, 5, True),
                                           (4, 1, 3, 0, True), (6, 16, 8, 4, True), (9, 7, 3, 2, False),
                                           (3, 4, 4, 3, True), (8, 3, 1, 1, False)]:
        x = torch.randn(2, 3, *[1] * (rank - 3), steps, generator=g, dtype=torch.float64)
        w = torch.randn(3, 1, *[1] * (rank - 3), taps, generator=g, dtype=torch.float64)
        b = torch.randn(3, generator=g, dtype=torch.float64) if bias else None
        one = [1] * (rank - 3)
        args = ([*one, stride], [0] * (rank - 3) + [pad], [1] * (rank - 2), True, [0] * (rank - 2), 3)
        want = (F.conv_transpose2d if rank == 4 else F.conv_transpose1d)(x, w, b, args[0], args[1], groups=3)
        got = onnx_export._convolution(x, w, b, *args)
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-12, (steps, taps, stride, pad)


def test_inner_axis_writes_squares_and_depthwise_upsampling_export_as_cheap_ops(backend):
    """Writes into a slice or an index of the last axis (padding fix-ups), x ** 2 and a depthwise
    transposed conv: no whole-tensor Transpose around a ScatterND, no Pow, no depthwise ConvTranspose
    in the file (each measured slow in onnxruntime; flashrt/runtime/onnx_export.py), same values."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 4, 1, 24, generator=g).contiguous(memory_format=torch.channels_last)
    filt = torch.randn(4, 1, 1, 12, generator=g)
    bufs = {"x": x, "n": torch.tensor([20]), "y": torch.zeros(1, 4, 1, 48)}

    def step():
        n = bufs["n"]
        up = torch.nn.functional.conv_transpose2d(bufs["x"], filt, stride=(1, 2), padding=(0, 5), groups=4)
        up[..., :3].add_(bufs["x"][..., :1] * 0.5)                               # slice write
        up[..., 40::3].mul_(2.0)                                                  # strided slice write
        up[..., 4:40].sub_(up[..., 8:44] * 0.125)                                 # a wide one: Concat
        fill = (2 * n + torch.arange(5)).clamp_max(47)
        up.index_copy_(-1, fill, up.index_select(-1, fill).masked_fill_(fill >= 2 * n, 0.0))
        edge = bufs["x"][..., :1] * torch.tensor([0.25, 0.5])
        up.index_add_(-1, (2 * n - 2 + torch.arange(2)).clamp_min(0), edge)
        bufs["y"].copy_(up.sin_().square_())
    graph = backend().capture(step, bufs)
    ops = {n.op_type for n in onnx.load_model_from_string(graph.model_bytes).graph.node}
    assert not {"Transpose", "ScatterND", "Pow", "ConvTranspose"} & ops, ops
    graph.replay()
    got = bufs["y"].clone()
    step()
    assert (got - bufs["y"]).abs().max() <= TOL


def test_invariant_conv_forms_record_as_plain_convs(backend):
    """A phase-split dilated conv and a polyphase upsampler (the `invariant` policy's oneDNN forms) are
    recorded for export as one dilated Conv and one ConvTranspose; eager keeps the invariant forms."""
    from flashrt.nn.conv1d import ConvTranspose1d, conv1d, plain_forms, to_rows
    torch.manual_seed(0)
    conv, up = conv1d(8, 8, 3, 3), ConvTranspose1d(8, 4, 8, 4)
    for m in (conv, up):
        m.reset_derived()
    conv.phase_split = conv.can_phase_split()
    conv.pack()
    up.set_polyphase(True)
    bufs = {"x": to_rows(torch.randn(1, 8, 30)), "y": torch.zeros(1, 4, 1, 120)}

    def step():
        bufs["y"].copy_(up(conv(bufs["x"])))
    eager = (step(), bufs["y"].clone())[1]
    with plain_forms():
        step()
    assert (bufs["y"] - eager).abs().max() <= TOL
    model = onnx.load_model_from_string(backend().capture(step, bufs).model_bytes)
    convs = [n for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose")]
    assert sorted(n.op_type for n in convs) == ["Conv", "ConvTranspose"]
    dil = next(a.ints for n in convs if n.op_type == "Conv" for a in n.attribute if a.name == "dilations")
    assert list(dil) == [1, 3]
    assert not {"Transpose"} & {n.op_type for n in model.graph.node}
    step()
    assert torch.equal(bufs["y"], eager)                                     # eager: invariant forms still
