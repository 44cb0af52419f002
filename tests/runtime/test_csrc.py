"""The csrc CUDA library: compiles with nvcc wherever a toolkit is (no GPU needed), exports its C ABI,
is cached by content; on a machine without CUDA nothing loads and the references run."""

import ctypes

import pytest
import torch

from flashrt.runtime import csrc

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
    for symbol in ("flashrt_add_rms_norm", "flashrt_rope_qkv", "flashrt_gelu_mul"):
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
