"""flashrt/ops/native.py through the two native libraries: a library planted in the cache (wrong bytes,
a symlink, a foreign owner, a folder others can write) is never loaded -- its constructor, which
writes a marker file, never runs -- and the real kernels still load (rebuilt); compilers that fail,
hang or are killed mid-build cost a warning and the torch forms, never a raw error, a hang or a temp
file left behind."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flashrt.ops import csrc, csrc_cpu, native

needs_cc = pytest.mark.skipif(csrc_cpu.compiler() is None, reason="no C compiler here")
needs_nvcc = pytest.mark.skipif(csrc.nvcc_path() is None, reason="no CUDA toolkit (nvcc) here")
FOREIGN_UID = 54321
PLANT = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("planted constructor ran\\n", f); fclose(f); }
}
int flashrt_cpu_abi(void) { return 1; }
int flashrt_csrc_abi(void) { return 1; }
"""


@pytest.fixture
def planted(tmp_path):
    """(library path, marker path): a tiny .so whose constructor writes the marker when it is loaded.
    Checked here in a separate process: loading it does write the marker (so a test that finds no
    marker proves it was not loaded)."""
    src, lib, marker = tmp_path / "plant.c", tmp_path / "plant.so", tmp_path / "marker"
    src.write_text(PLANT)
    cmd = [csrc_cpu.compiler(), "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(lib), str(src)]
    subprocess.run(cmd, check=True, timeout=60)
    load = f"import ctypes; ctypes.CDLL({str(lib)!r})"
    subprocess.run([sys.executable, "-c", load], check=True, timeout=60)
    assert marker.read_text() == "planted constructor ran\n"
    marker.unlink()
    return lib, marker


def _forge_sidecar(library: Path, fields: dict) -> None:
    """The sidecar an attacker who knows the format would write: consistent with the planted bytes."""
    data = library.read_bytes()
    meta = {"format": native.SIDECAR_FORMAT, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
            "fields": fields}
    library.with_name(library.name + native.SIDECAR).write_text(json.dumps(meta))


def _cpu_fields() -> dict:
    return csrc_cpu.key_fields(csrc_cpu.compiler())


def _assert_real_cpu_kernels(lib) -> None:
    assert lib is not None
    assert lib.handle.flashrt_cpu_abi() == csrc_cpu.ABI
    assert all(hasattr(lib.handle, name) for name in csrc_cpu.SIGNATURES)  # the planted one has none


def _plant_wrong_bytes(folder, plant):
    fields = _cpu_fields()
    folder.mkdir(mode=0o700)
    (folder / csrc_cpu.library_name(fields)).write_bytes(plant.read_bytes())


def _plant_over_a_real_build(folder, plant):  # a real build's sidecar, the library swapped
    path = csrc_cpu.build(folder)
    path.write_bytes(plant.read_bytes())


def _plant_symlink(folder, plant):  # a consistent sidecar, the library a link to the planted file
    fields = _cpu_fields()
    folder.mkdir(mode=0o700)
    path = folder / csrc_cpu.library_name(fields)
    path.symlink_to(plant)
    _forge_sidecar(path, fields)


def _plant_foreign_owner(folder, plant):  # a consistent sidecar, the library another user's
    fields = _cpu_fields()
    folder.mkdir(mode=0o700)
    path = folder / csrc_cpu.library_name(fields)
    path.write_bytes(plant.read_bytes())
    _forge_sidecar(path, fields)
    os.chown(path, FOREIGN_UID, FOREIGN_UID)


def _plant_group_writable_file(folder, plant):
    fields = _cpu_fields()
    folder.mkdir(mode=0o700)
    path = folder / csrc_cpu.library_name(fields)
    path.write_bytes(plant.read_bytes())
    _forge_sidecar(path, fields)
    os.chmod(path, 0o775)


PLANTS = {"wrong bytes": _plant_wrong_bytes, "wrong bytes, real sidecar": _plant_over_a_real_build,
          "symlink": _plant_symlink, "foreign owner": _plant_foreign_owner,
          "group-writable file": _plant_group_writable_file}


@needs_cc
@pytest.mark.parametrize("how", PLANTS)
def test_a_planted_cpu_library_never_runs_and_is_rebuilt(tmp_path, planted, how, caplog):
    if how == "foreign owner" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    plant, marker = planted
    folder = tmp_path / "cache"
    PLANTS[how](folder, plant)
    with caplog.at_level(logging.WARNING, logger="flashrt.ops.native"):
        lib = csrc_cpu.load(folder=folder)
    assert not marker.exists(), "the planted library was loaded: its constructor ran"
    _assert_real_cpu_kernels(lib)
    assert lib.path.parent == folder and not lib.path.is_symlink()
    assert lib.path.read_bytes() != plant.read_bytes()  # rebuilt in place
    assert any("refusing the cached" in r.getMessage() for r in caplog.records)
    native.read_verified(lib.path, _cpu_fields())  # and recorded: the next load takes it as it is


@needs_cc
@pytest.mark.parametrize("mode", [0o770, 0o777, 0o757], ids=oct)
def test_a_folder_others_can_write_is_not_used(tmp_path, planted, mode, caplog):
    plant, marker = planted
    fields = _cpu_fields()
    folder = tmp_path / "cache"
    folder.mkdir()
    path = folder / csrc_cpu.library_name(fields)
    path.write_bytes(plant.read_bytes())
    _forge_sidecar(path, fields)  # anyone could have written both
    os.chmod(folder, mode)
    with caplog.at_level(logging.WARNING, logger="flashrt.ops.native"):
        lib = csrc_cpu.load(folder=folder)
    assert not marker.exists()
    _assert_real_cpu_kernels(lib)  # built in a private temporary folder
    assert lib.path.parent != folder and not lib.path.parent.exists()
    assert "writable by other users" in caplog.text
    assert sorted(p.name for p in folder.iterdir()) == sorted([path.name, path.name + native.SIDECAR])


def test_folder_rules(tmp_path):
    ok = tmp_path / "ok"
    native.make_private_folder(ok / "a" / "b")
    assert (os.stat(ok / "a").st_mode & 0o777, os.stat(ok / "a" / "b").st_mode & 0o777) == (0o700, 0o700)
    native.check_folder(ok / "a" / "b")
    link = tmp_path / "link"
    link.symlink_to(ok / "a" / "b")
    with pytest.raises(native.Untrusted, match="is a symlink"):
        native.check_folder(link)
    os.chmod(ok / "a", 0o777)  # a folder above it that others can write: they could swap "b"
    with pytest.raises(native.Untrusted, match=r"above the cache folder .* writable by other users"):
        native.check_folder(ok / "a" / "b")
    os.chmod(ok / "a", 0o1777)  # sticky, like /tmp: others cannot rename what is ours
    native.check_folder(ok / "a" / "b")
    if os.geteuid() == 0:
        os.chown(ok / "a" / "b", FOREIGN_UID, FOREIGN_UID)
        with pytest.raises(native.Untrusted, match=f"belongs to uid {FOREIGN_UID}"):
            native.check_folder(ok / "a" / "b")


@needs_cc
def test_a_verified_library_is_loaded_from_the_bytes_that_were_checked(tmp_path, monkeypatch, planted):
    """The bytes hashed are the bytes loaded: swapping the file right after the check changes nothing."""
    plant, marker = planted
    real = csrc_cpu.build(tmp_path / "cache")
    read = native.read_verified

    def read_then_swap(path, fields=None):
        result = read(path, fields)
        os.replace(plant, path)  # another process swaps the file between the check and the load
        return result

    monkeypatch.setattr(native, "read_verified", read_then_swap)
    lib = native.open_verified(real, None, csrc_cpu._bind, tmp_path)
    assert not marker.exists()
    _assert_real_cpu_kernels(lib)


# ------------------------------------------------------------------------------- the CUDA library


@needs_nvcc
@needs_cc
def test_a_planted_cuda_library_never_runs_and_is_rebuilt(tmp_path, planted):
    plant, marker = planted
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    fields = csrc.key_fields("sm_90", csrc.nvcc_path())
    (folder / csrc.library_name(fields)).write_bytes(plant.read_bytes())
    lib = csrc.open_library("sm_90", folder=folder)
    assert not marker.exists()
    assert lib is not None and lib.handle.flashrt_csrc_abi() == csrc.ABI
    assert hasattr(lib.handle, "flashrt_add_rms_norm")


@needs_cc
def test_without_nvcc_only_a_verified_library_of_these_sources_loads(tmp_path, planted, monkeypatch):
    plant, marker = planted
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    for name in ("flashrt_csrc-0123456789abcdef0123.so", "flashrt_csrc-aaaaaaaaaaaaaaaaaaaa.so"):
        (folder / name).write_bytes(plant.read_bytes())  # any name that matches the pattern
    _forge_sidecar(folder / "flashrt_csrc-aaaaaaaaaaaaaaaaaaaa.so", {**csrc.key_fields("sm_90", None),
                                                                      "compiler": "x"})
    os.chmod(folder / "flashrt_csrc-aaaaaaaaaaaaaaaaaaaa.so", 0o666)  # ...but others could write it
    monkeypatch.setattr(csrc, "nvcc_path", lambda: None)
    assert csrc.open_library("sm_90", folder=folder) is None
    assert not marker.exists()


@needs_nvcc
def test_without_nvcc_a_verified_build_loads_unless_a_source_changed(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    built = csrc.build(folder, arch="sm_90")
    nvcc = csrc.nvcc_path()
    monkeypatch.setattr(csrc, "nvcc_path", lambda: None)
    lib = csrc.open_library("sm_90", folder=folder)
    assert lib is not None and lib.path == built
    assert csrc.open_library("sm_80", folder=folder) is None  # built for another architecture
    edited = _copy_sources(tmp_path / "src", "rms_norm.cu")
    monkeypatch.setattr(csrc, "csrc_dir", lambda: edited)
    assert csrc.open_library("sm_90", folder=folder) is None  # a stale build of an edited kernel
    monkeypatch.setattr(csrc, "nvcc_path", lambda: nvcc)
    fresh = csrc.open_library("sm_90", folder=folder)
    assert fresh is not None and fresh.path != built


def _copy_sources(dest: Path, edit: str) -> Path:
    dest.mkdir()
    for path in csrc_cpu.csrc_dir().iterdir():
        if path.is_file():
            text = path.read_bytes()
            (dest / path.name).write_bytes(text + b"\n// edited\n" if path.name == edit else text)
    return dest


# --------------------------------------------------------------------------------------- compilers


def _fake_compiler(folder: Path, body: str) -> str:
    """An executable shell script ``folder/cc``: ``body`` runs for every call ("$@" are the arguments)."""
    folder.mkdir(exist_ok=True)
    path = folder / "cc"
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def fake_cc(tmp_path, monkeypatch):
    """Put a fake ``cc`` first on PATH; returns a function that writes its script."""
    bin_dir = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(native, "_WARNED", set())
    return lambda body: _fake_compiler(bin_dir, body)


def test_a_compiler_whose_version_fails_costs_a_warning(fake_cc, tmp_path, caplog):
    cc = fake_cc('echo "cc: broken install" >&2; exit 3\n')
    assert csrc_cpu.compiler() == cc
    with caplog.at_level(logging.WARNING):
        assert csrc_cpu.load(folder=tmp_path / "cache") is None
    assert "--version failed (exit 3)" in caplog.text and "reference forms run" in caplog.text


def test_a_hanging_compiler_is_killed_after_the_timeout(fake_cc, tmp_path, caplog):
    child = tmp_path / "child.pid"
    cc = fake_cc(f"""\
        case "$1" in --version) echo "fake cc 1.0"; exit 0;; esac
        sleep 60 & echo $! > {child}; wait   # a child of the shell: the whole process group must go
        """)
    try:
        with caplog.at_level(logging.WARNING):
            assert csrc_cpu.load(folder=tmp_path / "cache", timeout_s=1.0) is None
        assert f"{cc} did not finish within 1 s" in caplog.text
        assert not [p.name for p in (tmp_path / "cache").iterdir()]  # its temporary output removed
        _wait_for(lambda: not _running(int(child.read_text())), 10)  # the compiler's child killed too
    finally:
        if child.is_file() and _running(int(child.read_text())):
            os.kill(int(child.read_text()), signal.SIGKILL)
    with pytest.raises(native.BuildError, match="did not finish"):  # --version hanging: the same
        native.tool_version(fake_cc("sleep 60\n"), 1.0)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_failing_compiler_leaves_no_temporary_file(fake_cc, tmp_path, caplog):
    fake_cc("""\
        case "$1" in --version) echo "fake cc 1.0"; exit 0;; esac
        while [ "$1" != "-o" ]; do shift; done; echo partial > "$2"; exit 1
        """)
    with caplog.at_level(logging.WARNING):
        assert csrc_cpu.load(folder=tmp_path / "cache") is None
    assert "the C compiler failed" in caplog.text
    assert not list((tmp_path / "cache").iterdir())


@needs_cc
def test_a_build_killed_mid_compile_leaves_temp_files_the_next_build_removes(fake_cc, tmp_path):
    real_cc = csrc_cpu.compiler()
    pid_file = tmp_path / "compiler.pid"
    fake = fake_cc(f"""\
        case "$1" in --version) echo "fake cc 1.0"; exit 0;; esac
        echo $$ > {pid_file}
        while [ "$1" != "-o" ]; do shift; done; echo partial > "$2"; sleep 60
        """)
    folder = tmp_path / "cache"
    code = f"from flashrt.ops import csrc_cpu; csrc_cpu.build({str(folder)!r}, cc={fake!r})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    build = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        _wait_for(lambda: pid_file.is_file() and pid_file.read_text().strip() and _temps(folder), 60)
    finally:
        build.kill()
        build.wait(timeout=30)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)  # the fake compiler (its own process group)
    left = _temps(folder)
    assert left, "the killed build should have left its temporary output"
    path = csrc_cpu.build(folder, cc=real_cc)
    assert not _temps(folder)
    assert sorted(p.name for p in folder.iterdir()) == [path.name, path.name + native.SIDECAR]


def _temps(folder: Path) -> list[Path]:
    return list(folder.glob(f"{native.TMP_PREFIX}*")) if folder.is_dir() else []


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_a_temp_file_of_a_live_build_is_kept(tmp_path):
    folder = tmp_path / "cache"
    native.make_private_folder(folder)
    mine = folder / f"{native._temp_prefix()}abc.so"  # this process: alive
    mine.write_bytes(b"")
    assert native.remove_stale_temps(folder) == [] and mine.exists()


def test_no_compiler_is_said_once_at_warning_with_its_cost(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(csrc_cpu, "compiler", lambda: None)
    monkeypatch.setattr(native, "_WARNED", set())
    with caplog.at_level(logging.DEBUG):
        for name in ("a", "b", "c"):
            assert csrc_cpu.load(folder=tmp_path / name) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no C compiler" in warnings[0].getMessage() and "torch forms (slower)" in warnings[0].getMessage()


def test_key_digest_is_canonical():
    fields = {"a": 1, "b": "x"}
    assert native.key_digest(fields) == native.key_digest(dict(reversed(fields.items())))
    assert native.key_digest(fields) != native.key_digest({**fields, "b": "y"})
