"""The csrc CPU library: built with the machine's C compiler, exports its C ABI, cached by content and
CPU; without a compiler nothing loads and the torch forms run."""

import ctypes

import pytest
from support.fake_tools import fake_tool

from flashrt.ops import csrc_cpu

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


# ------------------------------------------------------------------ the cache key: one test per field


def _fake_cc(folder, version: str) -> str:
    return fake_tool(folder, "cc", version)


def _sources_copy(dest, edit=None, rename=None, add=None):
    """A copy of the csrc folder: ``edit`` gets a byte more, ``rename`` (old, new) is renamed, ``add`` a new
    file (name, text)."""
    dest.mkdir()
    for path in csrc_cpu.csrc_dir().iterdir():
        if path.is_file():
            name = rename[1] if rename and path.name == rename[0] else path.name
            (dest / name).write_bytes(path.read_bytes() + (b"\n" if path.name == edit else b""))
    if add:
        (dest / add[0]).write_text(add[1])
    return dest


def _change_source(tmp_path, monkeypatch):
    src = _sources_copy(tmp_path / "src", edit="spectral_cpu.c")
    monkeypatch.setattr(csrc_cpu, "csrc_dir", lambda: src)


def _change_header(tmp_path, monkeypatch):  # a header the sources may include
    src = _sources_copy(tmp_path / "src", add=("flashrt_cpu.h", "#define FLASHRT_CPU 1\n"))
    monkeypatch.setattr(csrc_cpu, "csrc_dir", lambda: src)


def _rename_source(tmp_path, monkeypatch):
    src = _sources_copy(tmp_path / "src", rename=("winograd_cpu.c", "winograd2_cpu.c"))
    monkeypatch.setattr(csrc_cpu, "csrc_dir", lambda: src)


KEY_FIELDS = {
    "a source's contents": _change_source,
    "a header's contents": _change_header,
    "a source's name": _rename_source,
    "the CPU": lambda tmp_path, mp: mp.setattr(csrc_cpu, "cpu", lambda: "model name: another CPU"),
    "the flags": lambda tmp_path, mp: mp.setattr(csrc_cpu, "FLAGS", (*csrc_cpu.FLAGS, "-ffast-math")),
    "the OpenMP flags": lambda tmp_path, mp: mp.setattr(csrc_cpu, "OPENMP", ("-fopenmp-simd",)),
    "the ABI": lambda tmp_path, mp: mp.setattr(csrc_cpu, "ABI", csrc_cpu.ABI + 1),
}


@pytest.mark.parametrize("field", KEY_FIELDS)
def test_each_key_field_changes_the_library_name(tmp_path, monkeypatch, field):
    cc = _fake_cc(tmp_path / "bin", "cc 1.0")
    before = csrc_cpu.library_name(csrc_cpu.key_fields(cc))
    KEY_FIELDS[field](tmp_path, monkeypatch)
    assert csrc_cpu.library_name(csrc_cpu.key_fields(cc)) != before


def test_the_compiler_version_changes_the_library_name(tmp_path):
    compilers = [_fake_cc(tmp_path / v, f"cc {v}") for v in ("1", "2")]
    names = {csrc_cpu.library_name(csrc_cpu.key_fields(cc)) for cc in compilers}
    assert len(names) == 2


def test_the_key_is_stable_when_nothing_changes(tmp_path, monkeypatch):
    cc = _fake_cc(tmp_path / "bin", "cc 1.0")
    before = csrc_cpu.library_name(csrc_cpu.key_fields(cc))
    assert csrc_cpu.library_name(csrc_cpu.key_fields(cc)) == before
    copy = _sources_copy(tmp_path / "src")  # the same sources in another folder: the same library
    monkeypatch.setattr(csrc_cpu, "csrc_dir", lambda: copy)
    assert csrc_cpu.library_name(csrc_cpu.key_fields(cc)) == before


@needs_cc
def test_an_edited_kernel_is_rebuilt_not_loaded_stale(tmp_path, monkeypatch):
    first = csrc_cpu.build(tmp_path / "cache")
    _change_source(tmp_path, monkeypatch)
    assert csrc_cpu.build(tmp_path / "cache") != first
