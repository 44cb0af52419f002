"""The csrc CPU library: built with the machine's C compiler, exports its C ABI, cached by content and
CPU; without a compiler nothing loads and the torch forms run."""

import ctypes

import pytest

from flashrt.runtime import csrc_cpu

needs_cc = pytest.mark.skipif(csrc_cpu.compiler() is None, reason="no C compiler here")


def test_sources_are_found():
    assert {p.name for p in csrc_cpu.sources()} == {"anti_alias_cpu.c", "spectral_cpu.c", "winograd_cpu.c"}


@needs_cc
def test_kernels_compile_and_export_the_abi(tmp_path):
    path = csrc_cpu.build(tmp_path)
    lib = ctypes.CDLL(str(path))
    assert lib.flashrt_cpu_abi() == csrc_cpu.ABI
    assert all(hasattr(lib, name) for name in csrc_cpu.SIGNATURES)
    assert csrc_cpu.build(tmp_path) == path  # cached by content: no second compile
    # written atomically with its sha256 sidecar, no temp left
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".sha256"]


@needs_cc
def test_a_compile_error_is_reported_with_the_compiler_output(tmp_path, monkeypatch):
    bad = tmp_path / "src"
    bad.mkdir()
    (bad / "broken_cpu.c").write_text("this is not C\n")
    monkeypatch.setattr(csrc_cpu, "csrc_dir", lambda: bad)
    with pytest.raises(RuntimeError, match="compiler failed"):
        csrc_cpu.build(tmp_path / "out")
    assert not any((tmp_path / "out").glob("*.so"))


def test_nothing_loads_without_a_compiler(monkeypatch):
    monkeypatch.setattr(csrc_cpu, "compiler", lambda: None)
    monkeypatch.setattr(csrc_cpu, "_LOADED", {})
    assert csrc_cpu.load() is None
