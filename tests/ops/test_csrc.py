"""The csrc CUDA library: compiles with nvcc wherever a toolkit is (no GPU needed), exports its C ABI,
is cached by content; on a machine without CUDA nothing loads and the references run."""

import ctypes

import pytest
import torch
from support.fake_tools import fake_tool

from flashrt.ops import csrc

needs_nvcc = pytest.mark.skipif(csrc.nvcc_path() is None, reason="no CUDA toolkit (nvcc) here")


def test_sources_are_found():
    names = {p.name for p in csrc.sources()}
    assert {"rms_norm.cu", "rope_qkv.cu", "gelu_mul.cu", "flashrt_csrc.h"} <= names


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_nothing_loads_without_cuda():
    assert csrc.load() is None


@needs_nvcc
def test_kernels_compile_and_export_the_abi(tmp_path):
    path = csrc.build(tmp_path, arch="sm_90")
    lib = ctypes.CDLL(str(path))
    assert lib.flashrt_csrc_abi() == csrc.ABI
    from flashrt.ops.csrc_ops import SIGNATURES

    for symbol in SIGNATURES:  # every entry point the Python side binds (flashrt_silu_mul among them)
        assert hasattr(lib, symbol)
    assert csrc.build(tmp_path, arch="sm_90") == path  # cached by content: no second compile
    # written atomically with its sha256 sidecar, no temp left
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".sha256"]


@needs_nvcc
def test_a_compile_error_is_reported_with_the_compiler_output(tmp_path, monkeypatch):
    bad = tmp_path / "src"
    bad.mkdir()
    (bad / "broken.cu").write_text("this is not CUDA\n")
    monkeypatch.setattr(csrc, "csrc_dir", lambda: bad)
    with pytest.raises(RuntimeError, match="nvcc failed"):
        csrc.build(tmp_path / "out", arch="sm_90")
    assert not any((tmp_path / "out").iterdir())


# ------------------------------------------------------------------ the cache key: one test per field


def _fake_nvcc(folder, version: str) -> str:
    return fake_tool(folder, "nvcc", version)


def _edited_sources(tmp_path, edit):
    dest = tmp_path / "src"
    dest.mkdir()
    for path in csrc.csrc_dir().iterdir():
        if path.is_file():
            (dest / path.name).write_bytes(path.read_bytes() + (b"\n" if path.name == edit else b""))
    return dest


def _use_sources(monkeypatch, folder):
    monkeypatch.setattr(csrc, "csrc_dir", lambda: folder)


KEY_FIELDS = {
    "a kernel's contents": lambda tmp, mp: _use_sources(mp, _edited_sources(tmp, "rms_norm.cu")),
    "the header's contents": lambda tmp, mp: _use_sources(mp, _edited_sources(tmp, "flashrt_csrc.h")),
    "the flags": lambda tmp, mp: mp.setattr(csrc, "NVCC_FLAGS", (*csrc.NVCC_FLAGS, "--use_fast_math")),
    "the ABI": lambda tmp, mp: mp.setattr(csrc, "ABI", csrc.ABI + 1),
}


@pytest.mark.parametrize("field", KEY_FIELDS)
def test_each_key_field_changes_the_library_name(tmp_path, monkeypatch, field):
    nvcc = _fake_nvcc(tmp_path / "bin", "nvcc 13.0")
    before = csrc.library_name(csrc.key_fields("sm_90", nvcc))
    KEY_FIELDS[field](tmp_path, monkeypatch)
    assert csrc.library_name(csrc.key_fields("sm_90", nvcc)) != before


def test_the_architecture_and_the_nvcc_version_change_the_library_name(tmp_path):
    nvcc = _fake_nvcc(tmp_path / "a", "nvcc 13.0")
    names = {csrc.library_name(csrc.key_fields(arch, nvcc)) for arch in ("sm_80", "sm_90")}
    names.add(csrc.library_name(csrc.key_fields("sm_90", _fake_nvcc(tmp_path / "b", "nvcc 13.1"))))
    assert len(names) == 3


def test_the_key_is_stable_when_nothing_changes(tmp_path):
    nvcc = _fake_nvcc(tmp_path / "bin", "nvcc 13.0")
    first = csrc.library_name(csrc.key_fields("sm_90", nvcc))
    assert csrc.library_name(csrc.key_fields("sm_90", nvcc)) == first


def test_the_norm_kernel_takes_contiguous_rows_and_head_splits_of_a_fused_projection():
    import torch

    from flashrt.ops.csrc_ops import norm_takes, row_layout

    qkv = torch.zeros(2, 5, 4 + 2 * 2, 16, dtype=torch.bfloat16)
    q, k, v = qkv.split((4, 2, 2), dim=2)
    assert row_layout(qkv) == (1, 16) and row_layout(q) == (4, 8 * 16) and row_layout(k) == (2, 8 * 16)
    scale = torch.ones(16)
    assert norm_takes(q, None, None, scale, None) and norm_takes(k, None, None, scale, None)
    assert not norm_takes(q, q, None, scale, None)  # with a residual: contiguous rows only
    assert row_layout(qkv.transpose(1, 2)) is None and not norm_takes(qkv[..., ::2], None, None, scale, None)
