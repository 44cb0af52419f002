"""The CPU torch-op library (csrc/*_cpu.cpp): built against the running torch, cached by content, CPU and
torch; ``flashrt_cpu::decode_attention`` against a float64 softmax and SDPA; without a compiler nothing
loads and the reference forms run."""

import math
import re

import pytest
import torch
from support.fake_tools import fake_tool

from flashrt.nn.attention import attend
from flashrt.nn.llama import decode_bias
from flashrt.ops import torch_cpu

needs_cxx = pytest.mark.skipif(torch_cpu.compiler() is None, reason="no C++ compiler here")


def test_sources_are_found():
    assert {p.name for p in torch_cpu.sources()} == {"decode_attention_cpu.cpp"}


@needs_cxx
def test_the_library_compiles_exports_its_abi_and_is_cached(tmp_path):
    path = torch_cpu.build(tmp_path)
    assert torch_cpu.build(tmp_path) == path  # cached by content: no second compile
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".sha256"]
    assert b"flashrt_torch_cpu_abi" in path.read_bytes()


def test_nothing_loads_without_a_compiler(monkeypatch):
    monkeypatch.setattr(torch_cpu, "compiler", lambda: None)
    monkeypatch.setattr(torch_cpu, "registered", lambda: False)
    monkeypatch.setattr(torch_cpu, "_LOADED", [])
    assert torch_cpu.load() is None and not torch_cpu.loads()


def _fake_cxx(folder, version: str) -> str:
    return fake_tool(folder, "c++", version)


def _edited_source(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    for path in torch_cpu.sources():
        (src / path.name).write_bytes(path.read_bytes() + b"\n")
    monkeypatch.setattr(torch_cpu, "csrc_dir", lambda: src)


KEY_FIELDS = {
    "a source's contents": _edited_source,
    "the CPU": lambda tmp_path, mp: mp.setattr(torch_cpu.csrc_cpu, "cpu", lambda: "model name: another CPU"),
    "the flags": lambda tmp_path, mp: mp.setattr(torch_cpu, "FLAGS", (*torch_cpu.FLAGS, "-ffast-math")),
    "the torch version": lambda tmp_path, mp: mp.setattr(torch, "__version__", "0.0.1"),
    "torch's C++ ABI": lambda tmp_path, mp: mp.setattr(torch._C, "_GLIBCXX_USE_CXX11_ABI",
                                                       not torch._C._GLIBCXX_USE_CXX11_ABI),
    "the ABI": lambda tmp_path, mp: mp.setattr(torch_cpu, "ABI", torch_cpu.ABI + 1),
}


@pytest.mark.parametrize("field", KEY_FIELDS)
def test_each_key_field_changes_the_library_name(tmp_path, monkeypatch, field):
    cxx = _fake_cxx(tmp_path / "bin", "c++ 1.0")
    before = torch_cpu.library_name(torch_cpu.key_fields(cxx))
    assert torch_cpu.library_name(torch_cpu.key_fields(cxx)) == before
    KEY_FIELDS[field](tmp_path, monkeypatch)
    assert torch_cpu.library_name(torch_cpu.key_fields(cxx)) != before


# ------------------------------------------------------------------------------ decode_attention

needs_op = pytest.mark.skipif(not torch_cpu.loads(), reason="the CPU torch ops do not build here")


def _case(g, rows, kv, group, dim, keys, cache=None):
    """q (B, 1, H, D); k, v (B, KV, keys, D) views of a longer cache (B, KV, T, D) of one layer of N;
    positions from 0 to past the keys (clamped by the op)."""
    cache = cache or keys + 9
    q = torch.randn(rows, 1, kv * group, dim, generator=g)
    k_all, v_all = (torch.randn(3, rows, kv, cache, dim, generator=g) for _ in range(2))
    position = torch.randint(0, keys + 4, (rows,), generator=g)
    position[0] = 0
    return q, k_all[1, :, :, :keys], v_all[1, :, :, :keys], position


def _float64(q, k, v, position):
    """The definition: a float64 softmax over each row's keys up to its position."""
    keys = k.shape[2]
    bias = decode_bias(position.clamp(max=keys - 1), keys, torch.float64)
    return attend(q.double(), k.double(), v.double(), bias)


SHAPES = [  # rows, K/V heads, queries per K/V head, head_dim, keys
    (1, 2, 2, 16, 1), (3, 2, 2, 16, 17), (8, 2, 2, 16, 256), (16, 2, 2, 16, 128), (5, 1, 8, 32, 40),
    (4, 8, 3, 128, 300), (2, 4, 1, 64, 513), (2, 1, 16, 256, 33)]


@needs_op
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_decode_attention_is_as_close_to_a_float64_softmax_as_sdpa(shape):
    g = torch.Generator().manual_seed(sum(shape))
    q, k, v, position = _case(g, *shape)
    scale = 1 / math.sqrt(q.shape[-1])
    got = torch.ops.flashrt_cpu.decode_attention(q, k, v, position, scale)
    want = _float64(q, k, v, position)
    sdpa = attend(q, k, v, decode_bias(position.clamp(max=k.shape[2] - 1), k.shape[2], torch.float32))
    assert got.shape == sdpa.shape == (q.shape[0], 1, q.shape[2] * q.shape[3]) and got.dtype == torch.float32
    err, err_sdpa = ((x.double() - want).abs().max().item() for x in (got, sdpa))
    assert err <= max(3 * err_sdpa, 4e-7), (err, err_sdpa)


@needs_op
def test_a_row_is_computed_the_same_alone_in_any_batch_and_key_bucket():
    """Each row reads its own keys up to its position, in a fixed order: bit for bit the same alone,
    beside other rows, and over a longer key bucket (the keys past its position never read: NaN there
    changes nothing)."""
    g = torch.Generator().manual_seed(3)
    q, k_long, v_long, position = _case(g, 6, 2, 2, 16, 300)
    k, v, position = k_long[:, :, :100], v_long[:, :, :100], position.clamp(max=99)
    op = torch.ops.flashrt_cpu.decode_attention
    batch = op(q, k, v, position, 0.25)
    k_long[:, :, 100:], v_long[:, :, 100:] = float("nan"), float("nan")
    assert torch.equal(op(q, k_long, v_long, position, 0.25), batch)
    for r in range(6):
        alone = op(q[r:r + 1], k[r:r + 1], v[r:r + 1], position[r:r + 1], 0.25)
        assert torch.equal(alone, batch[r:r + 1])


@needs_op
def test_a_large_call_split_over_threads_gives_the_values_of_one_thread():
    """Where torch's thread setting allows, a large call runs its (row, K/V head) pairs on torch's
    inter-op pool: the same values bit for bit as on one thread (each pair computed by the same code)."""
    g = torch.Generator().manual_seed(6)
    q, k, v, position = _case(g, 6, 8, 3, 128, 700)
    op = torch.ops.flashrt_cpu.decode_attention
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(q, k, v, position, 0.1)
        torch.set_num_threads(4)
        split = op(q, k, v, position, 0.1)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, split)


@needs_op
def test_bad_inputs_are_refused_with_a_message():
    g = torch.Generator().manual_seed(4)
    q, k, v, position = _case(g, 2, 2, 2, 16, 20)
    op = torch.ops.flashrt_cpu.decode_attention
    bad = {"float32": (q.double(), k, v, position), "(B, 1, H, D)": (q[:, 0], k, v, position),
           "multiple of 16": (q[..., :8], k[..., :8], v[..., :8], position),
           "int64": (q, k, v, position.int()), "does not match": (q[:1], k, v, position[:1]),
           "alike": (q, k, v[:, :1], position)}
    for message, args in bad.items():
        with pytest.raises(RuntimeError, match=re.escape(message)):
            op(*args, 0.25)


def test_threads_loading_at_once_load_the_library_once(monkeypatch):
    """An op registers itself when its library is loaded, and a second registration aborts the process:
    two threads loading models at once build and load it once."""
    import threading
    import time

    calls = []

    def slow_load(folder, build_missing, timeout_s):
        calls.append(folder)
        time.sleep(0.05)
        return "the library"

    monkeypatch.setattr(torch_cpu, "_LOADED", [])
    monkeypatch.setattr(torch_cpu, "_load_or_build", slow_load)
    got = []
    threads = [threading.Thread(target=lambda: got.append(torch_cpu.load())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == ["the library"] * 4 and len(calls) == 1
