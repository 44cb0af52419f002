"""The csrc CUDA library: built once per machine where a CUDA toolkit is, loaded with ctypes, registered
as the CUDA kernels of the ``flashrt::`` custom ops (`flashrt.nn.fused`).

    lib = load()        # None without CUDA, or when no library is cached and none can be built
    build(out_dir, arch="sm_90")   # nvcc only (no GPU needed): what `load` runs on a miss

Why ctypes and not a torch extension: the kernels (csrc/*.cu) include no torch header and export a
small C ABI (csrc/flashrt_csrc.h: raw pointers, strides, the stream), so one ``nvcc --shared`` call
builds them in seconds, independent of torch's C++ ABI; the Python side (`_CudaOps` here) checks
shapes, dtypes and strides, allocates outputs with torch and launches on torch's current stream, so
the kernels are captured into CUDA graphs like any other. An input a kernel does not take (a
broadcast gate, a non-contiguous row, a dtype it has no instantiation for) runs the reference instead.

Nothing happens at import: `load` runs only when a CUDA model picks the "fused" kernels
(`flashrt.nn.fused.resolve_kernels`), and a plain install on a CPU machine never compiles anything.

Cache: ``<user cache dir>/flashrt/csrc/flashrt_csrc-<key>.so``; the key digests the sources, the nvcc
version and the target architecture. Writes are atomic (temp file + rename); a file that fails to load
or reports another ABI version is rebuilt. `load(build=False)` only looks in the cache.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from flashrt.paths import user_cache_dir

log = logging.getLogger(__name__)

__all__ = ["ABI", "OUT", "Library", "build", "compile_atomically", "csrc_dir", "load", "nvcc_path", "sources"]

ABI = 1  # FLASHRT_CSRC_ABI of csrc/flashrt_csrc.h
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NVCC_FLAGS = ("-O3", "-std=c++17", "--shared", "-Xcompiler", "-fPIC")
_LOADED: dict[str, Library | None] = {}


def csrc_dir() -> Path:
    """The csrc sources: the shipped data package, or the checkout's csrc/ (an editable install made
    before the package existed)."""
    try:
        return Path(str(resources.files("flashrt._csrc")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "csrc"


def sources() -> list[Path]:
    folder = csrc_dir()
    return sorted(folder.glob("*.cu")) + sorted(folder.glob("*.h"))


def nvcc_path() -> str | None:
    """nvcc of torch's CUDA_HOME, else the one on PATH; None without a toolkit."""
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except (ImportError, OSError):
        CUDA_HOME = None  # noqa: N806
    if CUDA_HOME and (Path(CUDA_HOME) / "bin" / "nvcc").is_file():
        return str(Path(CUDA_HOME) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _arch(device: torch.device | None) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _key(nvcc: str, arch: str) -> str:
    digest = hashlib.sha256()
    for path in sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    digest.update(version.encode() + arch.encode() + str(ABI).encode())
    return digest.hexdigest()[:20]


def build(out_dir: str | Path, arch: str = "sm_90", nvcc: str | None = None) -> Path:
    """Compile csrc/*.cu into ``out_dir/flashrt_csrc-<key>.so`` for ``arch`` (e.g. "sm_90"), atomically;
    returns the path (an existing file of the same key is reused). RuntimeError without nvcc or when
    the compiler fails (its output in the message)."""
    nvcc = nvcc or nvcc_path()
    if nvcc is None:
        raise RuntimeError("no CUDA toolkit (nvcc) found: the csrc kernels cannot be built here")
    out_dir = Path(out_dir)
    target = out_dir / f"flashrt_csrc-{_key(nvcc, arch)}.so"
    if target.is_file():
        return target
    number = arch.removeprefix("sm_")
    cmd = [nvcc, *NVCC_FLAGS, f"-gencode=arch=compute_{number},code=sm_{number}", "-o", OUT,
           *(str(p) for p in sources() if p.suffix == ".cu")]
    compile_atomically(target, [cmd], "nvcc")
    log.info("built the csrc CUDA kernels for %s: %s", arch, target)
    return target


OUT = "{out}"  # the output-file argument of a `compile_atomically` command


def compile_atomically(target: Path, commands: list[list[str]], compiler: str) -> Path:
    """Run the first of ``commands`` that succeeds, its `OUT` argument a temp file beside ``target``,
    then rename that to ``target`` (no half-written library is ever seen); RuntimeError with the last
    command's output when none succeeds (nothing left behind)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    for command in commands:
        cmd = [tmp if arg == OUT else arg for arg in command]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode == 0:
            os.replace(tmp, target)
            return target
    Path(tmp).unlink(missing_ok=True)
    raise RuntimeError(f"{compiler} failed ({' '.join(cmd)}):\n{done.stderr.strip()[-4000:]}")


@dataclass
class Library:
    """A loaded csrc library (the ctypes handle and where it came from)."""

    path: Path
    handle: ctypes.CDLL


def _open(path: Path) -> Library | None:
    try:
        handle = ctypes.CDLL(str(path))
        if handle.flashrt_csrc_abi() != ABI:
            return None
    except (OSError, AttributeError):
        return None
    return Library(path, handle)


def load(build_missing: bool = True, device: torch.device | str | None = None) -> Library | None:
    """The csrc library for the current CUDA device, its kernels registered on the custom ops; None
    without CUDA, or when it is not cached and cannot be built (the reason is logged)."""
    if not torch.cuda.is_available():
        return None
    arch = _arch(torch.device(device) if device is not None else None)
    if arch in _LOADED:
        return _LOADED[arch]
    lib = _load_or_build(arch, build_missing)
    if lib is not None:
        _register(lib)
    _LOADED[arch] = lib
    return lib


def _load_or_build(arch: str, build_missing: bool) -> Library | None:
    nvcc, folder = nvcc_path(), user_cache_dir("csrc")
    if nvcc is None:
        cached = sorted(folder.glob("flashrt_csrc-*.so")) if folder.is_dir() else []
        found = next((lib for lib in map(_open, cached) if lib is not None), None)
        if found is None:
            log.info("csrc kernels unavailable: no CUDA toolkit to build them and none cached in %s", folder)
        return found
    path = folder / f"flashrt_csrc-{_key(nvcc, arch)}.so"
    lib = _open(path) if path.is_file() else None
    if lib is not None or not build_missing:
        return lib
    try:
        path.unlink(missing_ok=True)
        return _open(build(folder, arch, nvcc))
    except (RuntimeError, OSError) as exc:
        log.warning("csrc kernels unavailable, the references run instead: %s", exc)
        return None


def _register(lib: Library) -> None:
    from flashrt.nn import fused
    from flashrt.runtime.csrc_ops import CudaOps

    ops = CudaOps(lib.handle)
    for name, op in fused.CUSTOM_OPS.items():
        op.register_kernel("cuda")(getattr(ops, name))
