"""The tensorrt graph backend. Without a GPU and tensorrt (this machine): its refusals, the engine key
(every field a miss), the engine cache with a fake builder (hit without a build, tampered / truncated /
refused entries rebuilt and never used, `cache ls` rows) and the parts of its export that run anywhere
(attention on the math path, flashrt's custom ops lowered), checked with onnxruntime. With CUDA and
tensorrt (`bench/gpu_check.sh`, marked cuda): parity with eager on the buffers, the second capture from
the cache, replay on the current stream and inside a CUDA graph."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flashrt.errors import CaptureError, ConfigError, DeviceError
from flashrt.runtime import graphs
from flashrt.runtime import onnx_export as ox
from flashrt.runtime import tensorrt as trt_backend
from flashrt.runtime.export_cache import EngineKey, ExportCache, ExportKey
from flashrt.runtime.tensorrt import BuildOptions, engine_key, load_engine

HAVE_TRT = torch.cuda.is_available() and importlib.util.find_spec("tensorrt") is not None
TOL = 1e-5


# ------------------------------------------------------------------------------ refusals (any machine)


def test_registered_for_cuda_only_and_refused_on_the_cpu_naming_what_it_needs():
    assert "tensorrt" in graphs.backend_names()
    assert "tensorrt" in graphs.backends_for("cuda") and "tensorrt" not in graphs.backends_for("cpu")
    with pytest.raises(ConfigError, match=r"'tensorrt' does not run on cpu \(needs CUDA \+ tensorrt\)"):
        graphs.backend_for_device("tensorrt", torch.device("cpu"))


@pytest.mark.skipif(HAVE_TRT, reason="checks the path without CUDA or tensorrt")
def test_get_backend_without_cuda_or_tensorrt_is_a_device_error():
    with pytest.raises(DeviceError, match=r"needs CUDA \+ tensorrt: "):
        graphs.get_backend("tensorrt")


def test_a_cpu_profile_refuses_it(tmp_path):
    from flashrt.bench.profiles import load_profile
    path = tmp_path / "p.toml"
    path.write_text('[device]\nkind = "cpu"\n[runtime]\nbackend = "tensorrt"\n')
    with pytest.raises(ConfigError, match=r"needs CUDA \+ tensorrt"):
        load_profile(path)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_int8_and_fp8_are_refused_saying_why(precision):
    """Checked before the device: the same answer on every machine."""
    why = f"{precision!r} refused: .*calibration scales.*Q/DQ.*own calibrator"
    with pytest.raises(ConfigError, match=why):
        graphs.get_backend("tensorrt", precision=precision)


BAD_OPTIONS = [({"precision": "int4"}, "precision"), ({"opt_level": 9}, "opt_level"),
               ({"workspace_mb": -1}, "workspace_mb")]


@pytest.mark.parametrize("opts, match", BAD_OPTIONS)
def test_bad_options(opts, match):
    with pytest.raises(ConfigError, match=match):
        graphs.get_backend("tensorrt", **opts)


def test_importing_the_backend_does_not_import_tensorrt():
    code = ("import sys, flashrt.runtime.graphs, flashrt.runtime.tensorrt; "
            "print('tensorrt' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------ plan checks


def _plan(weight_dtype=torch.float32, buffer_dtype=torch.float32):
    w = torch.randn(3, 3).to(weight_dtype)
    bufs = {"x": torch.randn(2, 3).to(buffer_dtype), "y": torch.zeros(2, 3, dtype=buffer_dtype)}

    def step():
        bufs["y"].copy_(torch.nn.functional.linear(bufs["x"], w.to(buffer_dtype)))
    return ox.plan(ox.record(step, bufs), bufs)


def test_check_plan_refuses_quantized_weights_float64_and_reduced_builds_of_non_fp32_steps():
    trt_backend.check_plan(_plan(), BuildOptions("fp16"))
    trt_backend.check_plan(_plan(torch.bfloat16, torch.bfloat16), BuildOptions("auto"))
    with pytest.raises(ConfigError, match=r"reach \['int8: aten._to_copy.default'\].*own calibrator"):
        trt_backend.check_plan(_plan(torch.int8), BuildOptions("auto"))
    with pytest.raises(ConfigError, match=r"reach \['float8_e4m3fn: aten._to_copy.default'\]"):
        trt_backend.check_plan(_plan(torch.float8_e4m3fn), BuildOptions("auto"))
    with pytest.raises(CaptureError, match="float64"):
        trt_backend.check_plan(_plan(torch.float64, torch.float64), BuildOptions("auto"))
    with pytest.raises(ConfigError, match="'bf16' builds from an fp32 export.*bfloat16"):
        trt_backend.check_plan(_plan(torch.bfloat16, torch.bfloat16), BuildOptions("bf16"))


@pytest.mark.parametrize("kind, dtype", [("int8", torch.int8), ("fp8", torch.float8_e4m3fn)])
def test_check_plan_takes_a_quantized_step_in_its_qdq_form(kind, dtype):
    """flashrt's int8 / fp8 GEMMs record as Q/DQ (`portable`): an explicitly quantized network."""
    from flashrt.quant import linear as L
    lin = torch.nn.Linear(16, 8)
    L.install(lin, {"": L.quantize_weight(lin.weight, kind, torch.tensor(2.0))})
    bufs = {"x": torch.randn(4, 16), "y": torch.zeros(4, 8)}

    def step():
        bufs["y"].copy_(lin(bufs["x"]))
    p = ox.plan(ox.record(step, bufs), bufs)
    assert any(t.dtype == dtype for t in p.constants)
    assert trt_backend.quantized_outside_qdq(p) == []
    trt_backend.check_plan(p, BuildOptions("auto"))


# ------------------------------------------------------------------------------ the engine key


ONNX_KEY = ExportKey(weights="w" * 64, program="p" * 64, shapes='{"x": [2, 3]}', precision="torch.float32",
                     exporter="torch 2.x; onnxscript; onnx; opset 18", runtime="tensorrt 10.0.0", arch="sm90",
                     scheme=ox.SCHEME_VERSION)
KEY_ARGS = {"runtime": "tensorrt 10.0.0", "arch": "sm90", "device_name": "NVIDIA H200"}


def _key(onnx=b"model", options=None, **changes):
    return engine_key(ONNX_KEY, onnx, options or BuildOptions(), **{**KEY_ARGS, **changes})


def test_engine_key_has_every_field_and_each_change_is_another_entry():
    key = _key()
    assert key == _key() and key.filename().endswith(".trtengine")
    assert set(key.fields()) >= {"weights", "program", "shapes", "precision", "exporter", "onnx", "builder",
                                 "scales", "runtime", "arch", "device", "scheme"}
    variants = [_key(onnx=b"other model"), _key(options=BuildOptions("fp16")),
                _key(options=BuildOptions(opt_level=5)), _key(options=BuildOptions(workspace_mb=512)),
                _key(runtime="tensorrt 10.1.0"), _key(arch="sm89"), _key(device_name="NVIDIA H100"),
                _key(scales="s" * 64),
                engine_key(ExportKey(**{**ONNX_KEY.fields(), "weights": "v" * 64}), b"model", BuildOptions(),
                           **KEY_ARGS)]
    names = {key.filename(), *(v.filename() for v in variants)}
    assert len(names) == len(variants) + 1


# ------------------------------------------------------------------------------ the engine cache


class FakeTRT:
    """A builder that counts its builds and a deserializer that refuses any bytes it never built."""

    def __init__(self) -> None:
        self.builds, self.seen = 0, []
        self.refuse: set[bytes] = set()

    def build(self) -> bytes:
        self.builds += 1
        return b"ENGINE:" + bytes(range(256)) * 8

    def deserialize(self, data: bytes):
        self.seen.append(data)
        if data in self.refuse or not data.startswith(b"ENGINE:"):
            return None
        return ("engine", len(data))


def _load(cache, fake, key=None):
    return load_engine(cache, key or _key(), fake.build, fake.deserialize)


def test_second_load_builds_nothing(tmp_path):
    cache, fake = ExportCache(tmp_path), FakeTRT()
    engine, data, hit = _load(cache, fake)
    assert (fake.builds, hit) == (1, False)
    before = trt_backend.STATS.engine_hits
    engine2, data2, hit2 = _load(ExportCache(tmp_path), fake)
    assert (fake.builds, hit2, data2, engine2) == (1, True, data, engine)
    assert trt_backend.STATS.engine_hits == before + 1


@pytest.mark.parametrize("field", ["onnx", "builder", "runtime", "arch", "device", "scales"])
def test_each_key_field_is_a_miss_even_for_a_copied_entry(tmp_path, field):
    cache, fake = ExportCache(tmp_path), FakeTRT()
    _load(cache, fake)
    changed = EngineKey(**{**_key().fields(), field: _key().fields()[field] + "x"})
    assert cache.load(changed) is None and cache.last_miss_reason == "no entry"
    Path(cache.path_for(changed)).write_bytes(Path(cache.path_for(_key())).read_bytes())  # copied over
    assert cache.load(changed) is None and f"{field} differ" in cache.last_miss_reason
    _load(cache, fake, changed)
    assert fake.builds == 2


@pytest.mark.parametrize("damage", ["truncate", "flip_engine_byte", "edit_key", "empty", "onnx_entry"])
def test_damaged_engine_is_rebuilt_never_used(tmp_path, damage):
    cache, fake = ExportCache(tmp_path), FakeTRT()
    _, good, _ = _load(cache, fake)
    path = Path(cache.path_for(_key()))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-100]
    elif damage == "flip_engine_byte":
        data[-50] ^= 0x01
    elif damage == "edit_key":
        data = bytearray(bytes(data).replace(b"NVIDIA H200", b"NVIDIA H201", 1))
    elif damage == "empty":
        data = bytearray()
    else:  # a valid ONNX-kind entry of the same key fields placed under the engine's name
        onnx_cache = ExportCache(tmp_path / "o")
        onnx_cache.store(ONNX_KEY, good)
        data = bytearray(Path(onnx_cache.path_for(ONNX_KEY)).read_bytes())
    path.write_bytes(bytes(data))
    fake.seen.clear()
    _, rebuilt, hit = _load(ExportCache(tmp_path), fake)
    assert (hit, fake.builds, rebuilt) == (False, 2, good)
    assert fake.seen == [good]                                   # the damaged bytes never reached TensorRT
    assert [e.problem for e in ExportCache(tmp_path).entries()] == [""]


def test_an_entry_tensorrt_refuses_is_rebuilt_and_replaced(tmp_path):
    """A stale engine that passes the cache's checks (say a TensorRT build with the same version string)
    but that TensorRT refuses to deserialize: rebuilt, stored again, the fresh engine used."""
    cache, fake = ExportCache(tmp_path), FakeTRT()
    stale = b"ENGINE:stale"
    cache.store(_key(), stale)
    fake.refuse.add(stale)
    engine, data, hit = _load(cache, fake)
    assert (hit, fake.builds, fake.seen) == (False, 1, [stale, data]) and engine is not None
    assert cache.load(_key()) == data


def test_an_engine_that_never_deserializes_is_a_capture_error(tmp_path):
    fake = FakeTRT()
    fake.deserialize = lambda data: None
    with pytest.raises(CaptureError, match="could not deserialize"):
        _load(ExportCache(tmp_path), fake)
    assert fake.builds == 1 and ExportCache(tmp_path).files() == []     # nothing unusable is stored


def test_cache_ls_lists_engines_beside_exports(tmp_path):
    from flashrt.quant.cli import _export_rows
    cache, fake = ExportCache(tmp_path), FakeTRT()
    _load(cache, fake)
    cache.store(ONNX_KEY, b"onnx bytes")
    rows = {r["kind"]: r for r in _export_rows(tmp_path)}
    assert set(rows) == {"onnx", "tensorrt"}
    assert rows["tensorrt"]["runtime"] == "tensorrt 10.0.0" and rows["tensorrt"]["problem"] == ""
    assert rows["tensorrt"]["name"].endswith(".trtengine") and rows["onnx"]["name"].endswith(".onnxrt")


# ------------------------------------------------------------------------------ the export it builds from


def _ort_run(data: bytes, p: ox.ExportPlan) -> dict[str, np.ndarray]:
    import onnxruntime as ort
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    feeds = {port.input_name: port.tensor.numpy() for port in p.ports}
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in session.get_inputs()}}
    return dict(zip(p.output_names(), session.run(p.output_names(), feeds)))


def test_attention_on_the_math_path_exports_and_matches_eager(make_block):
    """The tensorrt backend records attention on torch's math path (no fused CUDA attention kernel for
    the exporter); on the CPU the same recording exports and gives eager's output."""
    _, bufs, fn, feed = make_block(seed=2)
    feed(1, torch.Generator().manual_seed(5))
    start = {k: v.clone() for k, v in bufs.items()}
    p = ox.plan(ox.record(fn, bufs, math_attention=True), bufs)
    assert not any("flash_attention" in str(s.func) for s in p.recording.steps)
    want = {k: v.clone() for k, v in bufs.items()}
    for k, v in start.items():
        bufs[k].copy_(v)
    got = _ort_run(ox.export_onnx(p), p)
    for name in ("out", "k_cache", "v_cache"):
        assert np.abs(got[name] - want[name].numpy()).max() <= TOL, name


def test_flashrt_custom_ops_export_as_their_references():
    """The CUDA kernel table runs flashrt::rms_norm / add_rms_norm / gelu_mul / rope_qkv as custom ops;
    the export writes their references."""
    from flashrt.nn.rope import rope_cos_sin
    g = torch.Generator().manual_seed(0)
    d, heads = 8, 2
    bufs = {"x": torch.randn(1, 3, 2 * d, generator=g), "qkv": torch.randn(1, 3, heads + 2, d, generator=g),
            "y": torch.zeros(1, 3, d), "q": torch.zeros(1, 3, heads, d), "k": torch.zeros(1, 3, 1, d),
            "v": torch.zeros(1, 3, 1, d)}
    scale = torch.rand(d, generator=g) + 0.5
    cos, sin = rope_cos_sin(torch.arange(3)[None], d)
    ops = torch.ops.flashrt

    def step():
        h = ops.gelu_mul(bufs["x"])
        h = ops.rms_norm(h, scale, None, 1e-6)
        s, h = ops.add_rms_norm(h, h * 0.5, None, scale, None, 1e-6)
        bufs["y"].copy_(h + s)
        bufs["q"].copy_(ops.rope_qkv(bufs["qkv"], cos, sin, bufs["k"], bufs["v"], heads))

    p = ox.plan(ox.record(step, bufs), bufs)
    recorded = {str(s.func) for s in p.recording.steps}
    assert recorded >= {"flashrt.gelu_mul.default", "flashrt.rope_qkv.default"}
    want = {k: v.clone() for k, v in bufs.items()}
    got = _ort_run(ox.export_onnx(p), p)
    for name in ("y", "q", "k", "v"):
        assert np.abs(got[name] - want[name].numpy()).max() <= TOL, name


# ------------------------------------------------------------------------------ on a GPU with tensorrt

def gpu(test):
    """Marked cuda (bench/gpu_check.sh runs these), skipped without CUDA + tensorrt."""
    return pytest.mark.cuda(pytest.mark.skipif(not HAVE_TRT, reason="needs CUDA + tensorrt")(test))


@pytest.fixture
def trt(tmp_path):
    return lambda **opts: graphs.get_backend("tensorrt", cache_dir=tmp_path / "cache", **opts)


def _replay_vs_eager(make, backend, steps=3, atol=TOL):
    _, bufs, fn, feed = make(seed=0, device="cuda")
    _, ref, ref_fn, ref_feed = make(seed=0, device="cuda")
    graph = backend.capture(fn, bufs)
    for step in range(steps):
        feed(step, torch.Generator().manual_seed(step))
        ref_feed(step, torch.Generator().manual_seed(step))
        graph.replay()
        with torch.no_grad():
            ref_fn()
        torch.cuda.synchronize()
        for name in bufs:
            torch.testing.assert_close(bufs[name], ref[name], atol=atol, rtol=atol)
    return graph, bufs


@gpu
@pytest.mark.parametrize("which", ["block", "conv"])
def test_gpu_engine_matches_eager_on_the_buffers(trt, make_block, make_conv, which):
    graph, bufs = _replay_vs_eager(make_block if which == "block" else make_conv, trt())
    assert graph.backend == "tensorrt" and not graph.cache_hit
    bound = graph._binding.addresses
    assert bound and all(bound[n] == bufs[n.removesuffix(".in")].data_ptr() for n in bound
                         if n.removesuffix(".in") in bufs and not graph._binding.after)


@gpu
def test_gpu_second_capture_comes_from_the_cache(trt, make_conv):
    _replay_vs_eager(make_conv, trt(), steps=1)
    builds, exports = trt_backend.STATS.builds, trt_backend.STATS.exports
    graph, _ = _replay_vs_eager(make_conv, trt(), steps=1)
    assert graph.cache_hit and (trt_backend.STATS.builds, trt_backend.STATS.exports) == (builds, exports)


@gpu
def test_gpu_replay_on_a_side_stream_and_inside_a_cuda_graph(trt, make_block):
    _, bufs, fn, feed = make_block(seed=0, device="cuda")
    _, ref, ref_fn, ref_feed = make_block(seed=0, device="cuda")
    engine = trt().capture(fn, bufs)
    cuda_graph = graphs.get_backend("cuda").capture(engine.replay, bufs)   # its warm-up runs the engine
    side = torch.cuda.Stream()
    for step in range(3):
        for f in (feed, ref_feed):
            f(step, torch.Generator().manual_seed(step))
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            (engine.replay if step == 0 else cuda_graph.replay)()
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():
            ref_fn()
        torch.cuda.synchronize()
        for name in ("out", "k_cache", "v_cache"):
            torch.testing.assert_close(bufs[name], ref[name], atol=TOL, rtol=TOL)


@gpu
@pytest.mark.parametrize("dtype, precision", [(torch.bfloat16, "auto"), (torch.float32, "fp16")])
def test_gpu_reduced_precision(trt, make_conv, dtype, precision):
    import tensorrt
    if precision == "fp16" and not hasattr(tensorrt.BuilderFlag, "FP16"):
        _, bufs, fn, _ = make_conv(seed=0, device="cuda")
        with pytest.raises(ConfigError, match="no weak typing"):           # TensorRT 11 removed it
            trt(precision=precision).capture(fn, bufs)
        return
    model, bufs, fn, feed = make_conv(seed=0, device="cuda")
    _, ref, ref_fn, ref_feed = make_conv(seed=0, device="cuda")
    model.to(dtype)                                       # fn reads bufs[...] at call time: swap them too
    for name in bufs:
        bufs[name] = bufs[name].to(dtype)
    graph = trt(precision=precision).capture(fn, bufs)
    feed(0, torch.Generator().manual_seed(0))
    ref_feed(0, torch.Generator().manual_seed(0))
    graph.replay()
    with torch.no_grad():
        ref_fn()
    torch.cuda.synchronize()
    torch.testing.assert_close(bufs["audio"].float(), ref["audio"], atol=3e-2, rtol=3e-2)


@gpu
def test_gpu_int8_engine_from_flashrts_qdq_matches_eager_int8(trt):
    """An int8 frontend's GEMMs reach TensorRT as Q/DQ with flashrt's scales (no calibrator)."""
    from flashrt.quant import linear as L
    g = torch.Generator().manual_seed(5)
    lin1, lin2 = torch.nn.Linear(64, 128).cuda(), torch.nn.Linear(128, 32).cuda()
    for lin in (lin1, lin2):
        lin.weight.data = (torch.randn(lin.weight.shape, generator=g) * 0.2).cuda()
        L.install(lin, {"": L.quantize_weight(lin.weight, "int8", torch.tensor(3.0, device="cuda"))})
    bufs = {"x": torch.randn(32, 64, generator=g).cuda(), "y": torch.zeros(32, 32, device="cuda")}

    def step():
        bufs["y"].copy_(lin2(torch.nn.functional.gelu(lin1(bufs["x"]))))
    with L.tuning():
        step()
    want = bufs["y"].clone()
    graph = trt().capture(step, bufs)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(bufs["y"], want, atol=1e-3 * float(want.abs().max()), rtol=0)
