"""The csrc CPU library (csrc/*_cpu.c): built once per machine with its C compiler, loaded with ctypes.

    lib = load()          # None where no C compiler is and nothing is cached (the torch forms run)
    build(out_dir)        # what `load` runs on a miss (the one builder `flashrt.ops.library`, `RECIPE`)

Kernels: ``flashrt_aa_snake`` (csrc/anti_alias_cpu.c), BigVGAN's anti-aliased snake activation in one
pass (`flashrt.nn.alias_free.Activation1d` with ``kernel="native"``); ``flashrt_bgemm``
(csrc/spectral_cpu.c), the small batched GEMM of the block-spectral convs' DFTs
(`flashrt.nn.spectral_conv.SpectralPlan`); ``flashrt_wino43_in`` / ``_out`` (csrc/winograd_cpu.c), the
transforms of the 3-tap convs' Winograd form (`flashrt.nn.winograd_conv.WinogradPlan`). Like the CUDA library
(`flashrt.ops.csrc`) the sources include no torch header and export a small C ABI of raw pointers,
so one ``cc -shared`` call builds them in about a second, independent of torch's C++ ABI; the Python
side checks every argument and falls back to the torch form for anything the kernel does not take.

Flags: ``-O3 -march=native`` (the library is built on the machine that runs it: the vector code uses
the widest registers it has), ``-fopenmp`` where the compiler takes it (a compiler without OpenMP
builds a one-thread library; one without ``-march=native`` the baseline ISA). Nothing is built at
install or import time: `load` runs when a CPU float32 model picks the native kernels at load
(`flashrt.frontends.vocoders.prepare_module`).

Cache: ``<user cache dir>/flashrt/csrc/flashrt_cpu-<key>.so`` (`cache_folder`; ``load(folder=...)`` takes
another); the key digests `key_fields`: the sources' names and contents (with the headers beside them),
the compiler's version, this CPU (its model and flags, as ``-march=native`` reads them), the flags and
the ABI, so a cache folder shared by machines of different CPUs holds one library per CPU, and an edited
kernel is rebuilt. What is loaded and how a planted or damaged file is refused: `flashrt.ops.native`
(a sha256 sidecar written at build time, ownership and permission checks, the verified bytes loaded).
Without a compiler nothing loads (the torch forms run; said once, at WARNING): a cached library's key
(this CPU, the compiler's version) cannot be checked. A compiler that fails or runs past ``timeout_s``
means the torch forms too, with a warning.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from pathlib import Path
from typing import Any

from flashrt.ops import library, native
from flashrt.ops.csrc import csrc_dir
from flashrt.ops.native import OUT, BuildError, Library
from flashrt.paths import user_cache_dir

log = logging.getLogger(__name__)

__all__ = ["ABI", "FLAGS", "build", "cache_folder", "compiler", "cpu", "key_fields", "load", "sources"]

ABI = 1  # FLASHRT_CPU_ABI of csrc/*_cpu.c
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11")
OPENMP = ("-fopenmp",)
TIMEOUT_S = 300.0  # any one compiler process (a build takes seconds at most)
NO_COMPILER = ("no C compiler (cc, gcc, clang): the native CPU kernels are off, vocoders run the torch "
               "forms (slower)")
_POINTER, _INT64 = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {  # symbol -> (argument types), each returning int (0: done)
    "flashrt_aa_snake": (_POINTER, _POINTER, _INT64, _INT64, _INT64, _POINTER, _POINTER, _POINTER, _POINTER,
                         ctypes.c_int),
    "flashrt_bgemm": (_POINTER, _INT64, _INT64, _INT64, _INT64, _POINTER, _INT64, _INT64, _INT64, _INT64,
                      _POINTER, _INT64, _INT64, ctypes.c_int),
    "flashrt_wino43_in": (_POINTER, _POINTER, _INT64, _INT64, _INT64, _INT64),
    "flashrt_wino43_out": (_POINTER, _POINTER, _INT64, _INT64, _INT64, _POINTER),
}
_LOADED: dict[str, Library | None] = {}


def sources() -> list[Path]:
    return sorted(csrc_dir().glob("*_cpu.c"))


def cache_folder() -> Path:
    """Where the built libraries are kept: ``<user cache dir>/flashrt/csrc``."""
    return user_cache_dir("csrc")


def compiler() -> str | None:
    """The C compiler on PATH (cc, gcc, clang); None without one."""
    return native.first_on_path(("cc", "gcc", "clang"))


def cpu() -> str:
    """This CPU as ``-march=native`` sees it: its model name and feature flags (Linux), else the platform."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _commands(cc: str, fields: dict[str, Any]) -> list[list[str]]:
    """With OpenMP, without it, without ``-march=native`` (compilers that lack either)."""
    portable = tuple(f for f in FLAGS if f != "-march=native")
    files = [str(p) for p in sources()]
    return [[cc, *flags, "-o", OUT, *files] for flags in ((*FLAGS, *OPENMP), FLAGS, portable)]


RECIPE = library.Recipe("flashrt_cpu", "native CPU kernels", "the C compiler", sources, _commands)


def key_fields(cc: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Everything the library depends on (its cache key and the sidecar's record); BuildError when the
    compiler's ``--version`` fails or hangs."""
    headers = sorted(csrc_dir().glob("*.h"))
    return {"library": RECIPE.library, "sources": library.sources_digest(sources(), headers),
            "compiler": native.tool_version(cc, timeout_s), "cpu": cpu(), "flags": " ".join(FLAGS),
            "openmp": " ".join(OPENMP), "abi": ABI}


def library_name(fields: dict[str, Any]) -> str:
    return library.library_name(RECIPE, fields)


def build(out_dir: str | Path, cc: str | None = None, timeout_s: float = TIMEOUT_S) -> Path:
    """Compile csrc/*_cpu.c into ``out_dir/flashrt_cpu-<key>.so`` for this CPU, atomically, with its
    sha256 sidecar; returns its path (an existing verified file of the same key is reused). BuildError
    (a RuntimeError) without a compiler, when it fails (its output in the message) or runs past
    ``timeout_s`` seconds."""
    cc = cc or compiler()
    if cc is None:
        raise BuildError(NO_COMPILER)
    return library.build(RECIPE, Path(out_dir), cc, key_fields(cc, timeout_s), timeout_s)


def _bind(handle: ctypes.CDLL) -> bool:
    """Check the ABI and declare the signatures; False for a library of another ABI."""
    try:
        if handle.flashrt_cpu_abi() != ABI:
            return False
        for name, args in SIGNATURES.items():
            fn = getattr(handle, name)
            fn.argtypes, fn.restype = list(args), ctypes.c_int
    except AttributeError:
        return False
    return True


def load(build_missing: bool = True, *, folder: str | Path | None = None,
         timeout_s: float = TIMEOUT_S) -> Library | None:
    """The CPU kernels of this machine, from ``folder`` (default `cache_folder`), built on a miss; None
    where they cannot be (reason logged). The answer is kept for the process (per folder)."""
    folder = Path(folder) if folder is not None else cache_folder()
    slot = str(folder)
    if slot not in _LOADED:
        lib = _load_or_build(folder, build_missing, timeout_s)
        if lib is None and not build_missing:
            return None  # a later call may build it
        _LOADED[slot] = lib
    return _LOADED[slot]


def _load_or_build(folder: Path, build_missing: bool, timeout_s: float) -> Library | None:
    return library.load_compiled(RECIPE, folder, compiler(), NO_COMPILER, key_fields, _bind, timeout_s,
                                 build_missing)
