"""The csrc CUDA library: built once per machine where a CUDA toolkit is, loaded with ctypes, registered
as the CUDA kernels of the ``flashrt::`` custom ops (`flashrt.ops.decoder`).

    lib = load()        # None without CUDA, or when no library is cached and none can be built
    build(out_dir, arch="sm_90")   # nvcc only (no GPU needed): what `load` runs on a miss
                                   # (the one builder `flashrt.ops.library`, `RECIPE`)

Why ctypes and not a torch extension: the kernels (csrc/*.cu) include no torch header and export a
small C ABI (csrc/flashrt_csrc.h: raw pointers, strides, the stream), so one ``nvcc --shared`` call
builds them in seconds, independent of torch's C++ ABI; the Python side (`_CudaOps` here) checks
shapes, dtypes and strides, allocates outputs with torch and launches on torch's current stream, so
the kernels are captured into CUDA graphs like any other. An input a kernel does not take (a
broadcast gate, a non-contiguous row, a dtype it has no instantiation for) runs the reference instead.

Nothing happens at import: `load` runs only when a CUDA model picks the "fused" kernels
(`flashrt.ops.select` asks for it), and a plain install on a CPU machine never compiles anything.

Cache: ``<user cache dir>/flashrt/csrc/flashrt_csrc-<key>.so`` (`cache_folder`; ``open_library(folder=...)``
takes another); the key digests `key_fields`: the sources' names and contents (headers included), the
nvcc version, the flags, the target architecture and the ABI, so an edited kernel is rebuilt. What is
loaded and how a planted or damaged file is refused: `flashrt.ops.native` (a sha256 sidecar written
at build time, ownership and permission checks, the verified bytes loaded). Without nvcc only a
library that passes those checks and was built from these sources, flags, ABI and architecture loads
(by another nvcc: the one field that cannot be checked). `load(build_missing=False)` only looks in the
cache. An nvcc that fails or runs past ``timeout_s`` means the references, with a warning.

Sources: `csrc_dir` is the csrc folder of the flashrt package actually imported (`flashrt.resources`).
"""

from __future__ import annotations

import ctypes
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from flashrt.ops import library, native
from flashrt.ops.native import OUT, BuildError, Library
from flashrt.paths import user_cache_dir
from flashrt.resources import data_dir

log = logging.getLogger(__name__)

__all__ = ["ABI", "OUT", "Library", "build", "cache_folder", "csrc_dir", "key_fields", "load", "nvcc_path",
           "open_library", "sources"]

ABI = 3  # FLASHRT_CSRC_ABI of csrc/flashrt_csrc.h
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NVCC_FLAGS = ("-O3", "-std=c++17", "--shared", "-Xcompiler", "-fPIC")
TIMEOUT_S = 600.0  # any one nvcc process (a build takes seconds to a minute)
NO_NVCC = ("no CUDA toolkit (nvcc): the fused CUDA kernels are off unless a verified build of these "
           "sources is cached; the reference (aten) ops run (slower)")
_LOADED: dict[tuple[str, str], Library | None] = {}


def csrc_dir() -> Path:
    """The csrc sources of the imported flashrt package (`flashrt.resources.data_dir`)."""
    return data_dir("csrc")


def sources() -> list[Path]:
    folder = csrc_dir()
    return sorted(folder.glob("*.cu")) + sorted(folder.glob("*.h"))


def cache_folder() -> Path:
    """Where the built libraries are kept: ``<user cache dir>/flashrt/csrc``."""
    return user_cache_dir("csrc")


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


def _commands(nvcc: str, fields: dict[str, Any]) -> list[list[str]]:
    number = fields["arch"].removeprefix("sm_")
    return [[nvcc, *NVCC_FLAGS, f"-gencode=arch=compute_{number},code=sm_{number}", "-o", OUT,
             *(str(p) for p in sources() if p.suffix == ".cu")]]


RECIPE = library.Recipe("flashrt_csrc", "csrc CUDA kernels", "nvcc", sources, _commands)


def key_fields(arch: str, nvcc: str | None, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Everything the library depends on (its cache key and the sidecar's record); ``nvcc`` None leaves
    the compiler out (what can be checked without one). BuildError when ``nvcc --version`` fails or
    hangs."""
    fields = {"library": RECIPE.library, "sources": library.sources_digest(sources()),
              "flags": " ".join(NVCC_FLAGS), "arch": arch, "abi": ABI}
    return fields if nvcc is None else {**fields, "compiler": native.tool_version(nvcc, timeout_s)}


def library_name(fields: dict[str, Any]) -> str:
    return library.library_name(RECIPE, fields)


def build(out_dir: str | Path, arch: str = "sm_90", nvcc: str | None = None, timeout_s: float = TIMEOUT_S
          ) -> Path:
    """Compile csrc/*.cu into ``out_dir/flashrt_csrc-<key>.so`` for ``arch`` (e.g. "sm_90"), atomically,
    with its sha256 sidecar; returns the path (an existing verified file of the same key is reused).
    BuildError (a RuntimeError) without nvcc, when it fails (its output in the message) or runs past
    ``timeout_s`` seconds."""
    nvcc = nvcc or nvcc_path()
    if nvcc is None:
        raise BuildError("no CUDA toolkit (nvcc) found: the csrc kernels cannot be built here")
    return library.build(RECIPE, Path(out_dir), nvcc, key_fields(arch, nvcc, timeout_s), timeout_s)


def _bind(handle: ctypes.CDLL) -> bool:
    try:
        return handle.flashrt_csrc_abi() == ABI
    except AttributeError:
        return False


def load(build_missing: bool = True, device: torch.device | str | None = None) -> Library | None:
    """The csrc library for the current CUDA device, its kernels registered on the custom ops; None
    without CUDA, or when it is not cached and cannot be built (the reason is logged)."""
    if not torch.cuda.is_available():
        return None
    arch = _arch(torch.device(device) if device is not None else None)
    slot = (arch, str(cache_folder()))
    if slot in _LOADED:
        return _LOADED[slot]
    lib = open_library(arch, build_missing=build_missing)
    if lib is not None:
        _register(lib)
    if lib is not None or build_missing:
        _LOADED[slot] = lib
    return lib


def open_library(arch: str, *, build_missing: bool = True, folder: str | Path | None = None,
                 timeout_s: float = TIMEOUT_S) -> Library | None:
    """The csrc library for ``arch`` ("sm_90") from ``folder`` (default `cache_folder`), verified and
    loaded, built on a miss where nvcc is; None where it cannot be (reason logged). Needs no GPU:
    nothing is registered and no kernel runs (`load` does both)."""
    folder = Path(folder) if folder is not None else cache_folder()
    nvcc = nvcc_path()
    if nvcc is None:
        native.warn_once(NO_NVCC)
        wanted = key_fields(arch, None)
        match = lambda fields: {k: v for k, v in fields.items() if k != "compiler"} == wanted  # noqa: E731
        return native.find_verified(folder, "flashrt_csrc-*.so", match, _bind, "csrc CUDA kernels")
    try:
        fields = key_fields(arch, nvcc, timeout_s)
    except BuildError as exc:
        log.warning("csrc CUDA kernels off, the references run instead (slower): %s", exc)
        return None
    return library.load(RECIPE, folder, nvcc, fields, _bind, timeout_s, build_missing)


def _register(lib: Library) -> None:
    from flashrt.ops import decoder
    from flashrt.ops.csrc_ops import CudaOps

    ops = CudaOps(lib.handle)
    for name, op in decoder.CUSTOM_OPS.items():
        op.register_kernel("cuda")(getattr(ops, name))
