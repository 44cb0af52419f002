"""The csrc CPU library (csrc/*_cpu.c): built once per machine with its C compiler, loaded with ctypes.

    lib = load()          # None where no C compiler is and nothing is cached (the torch forms run)
    build(out_dir)        # what `load` runs on a miss

Kernels: ``flashrt_aa_snake`` (csrc/anti_alias_cpu.c), BigVGAN's anti-aliased snake activation in one
pass (`flashrt.nn.alias_free.Activation1d` with ``kernel="native"``); ``flashrt_bgemm``
(csrc/spectral_cpu.c), the small batched GEMM of the block-spectral convs' DFTs
(`flashrt.nn.spectral_conv.SpectralPlan`); ``flashrt_wino43_in`` / ``_out`` (csrc/winograd_cpu.c), the
transforms of the 3-tap convs' Winograd form (`flashrt.nn.winograd_conv.WinogradPlan`). Like the CUDA library
(`flashrt.runtime.csrc`) the sources include no torch header and export a small C ABI of raw pointers,
so one ``cc -shared`` call builds them in about a second, independent of torch's C++ ABI; the Python
side checks every argument and falls back to the torch form for anything the kernel does not take.

Flags: ``-O3 -march=native`` (the library is built on the machine that runs it: the vector code uses
the widest registers it has), ``-fopenmp`` where the compiler takes it (a compiler without OpenMP
builds a one-thread library; one without ``-march=native`` the baseline ISA). Nothing is built at
install or import time: `load` runs when a CPU float32 model picks the native kernels at load
(`flashrt.frontends.vocoders.prepare_module`).

Cache: ``<user cache dir>/flashrt/csrc/flashrt_cpu-<key>.so``; the key digests the sources, the
compiler's version and this CPU (its model and flags, as ``-march=native`` reads them), so a cache
folder shared by machines of different CPUs holds one library per CPU. Writes are atomic (temp file +
rename); a file that fails to load or reports another ABI is rebuilt. `load(build_missing=False)` only
looks in the cache. Without a compiler nothing loads (the torch forms run).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import platform
import shutil
import subprocess
from pathlib import Path

from flashrt.paths import user_cache_dir
from flashrt.runtime.csrc import OUT, Library, compile_atomically, csrc_dir

log = logging.getLogger(__name__)

__all__ = ["ABI", "FLAGS", "build", "compiler", "load", "sources"]

ABI = 1  # FLASHRT_CPU_ABI of csrc/*_cpu.c
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11")
OPENMP = ("-fopenmp",)
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


def compiler() -> str | None:
    """The C compiler on PATH (cc, gcc, clang); None without one."""
    return next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))), None)


def _cpu() -> str:
    """This CPU as ``-march=native`` sees it: its model name and feature flags (Linux), else the platform."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _key(cc: str) -> str:
    digest = hashlib.sha256()
    for path in sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    digest.update(version.encode() + _cpu().encode() + str(ABI).encode() + " ".join(FLAGS).encode())
    return digest.hexdigest()[:20]


def build(out_dir: str | Path, cc: str | None = None) -> Path:
    """Compile csrc/*_cpu.c into ``out_dir/flashrt_cpu-<key>.so`` for this CPU, atomically; returns its
    path (an existing file of the same key is reused). RuntimeError without a compiler or when it fails
    (its output in the message)."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc, clang) found: the CPU kernels cannot be built here")
    out_dir = Path(out_dir)
    target = out_dir / f"flashrt_cpu-{_key(cc)}.so"
    if target.is_file():
        return target
    portable = tuple(f for f in FLAGS if f != "-march=native")     # compilers without -march=native
    files = [str(p) for p in sources()]
    commands = [[cc, *flags, "-o", OUT, *files] for flags in ((*FLAGS, *OPENMP), FLAGS, portable)]
    compile_atomically(target, commands, "the C compiler")
    log.info("built the csrc CPU kernels: %s", target)
    return target


def _open(path: Path) -> Library | None:
    try:
        handle = ctypes.CDLL(str(path))
        if handle.flashrt_cpu_abi() != ABI:
            return None
        for name, args in SIGNATURES.items():
            fn = getattr(handle, name)
            fn.argtypes, fn.restype = list(args), ctypes.c_int
    except (OSError, AttributeError):
        return None
    return Library(path, handle)


def load(build_missing: bool = True) -> Library | None:
    """The CPU kernels of this machine, built on a miss; None where they cannot be (reason logged). The
    answer is kept for the process."""
    if _LOADED.get("cpu") is None:
        _LOADED["cpu"] = _load_or_build(build_missing)
    return _LOADED["cpu"]


def _load_or_build(build_missing: bool) -> Library | None:
    """Without a compiler nothing loads: a cached library's key (this CPU, the compiler's version) cannot
    be checked, and one built for another CPU of a shared cache could fault."""
    cc, folder = compiler(), user_cache_dir("csrc")
    if cc is None:
        log.info("CPU kernels unavailable: no C compiler (cc, gcc, clang); the torch forms run")
        return None
    path = folder / f"flashrt_cpu-{_key(cc)}.so"
    lib = _open(path) if path.is_file() else None
    if lib is not None or not build_missing:
        return lib
    try:
        path.unlink(missing_ok=True)
        return _open(build(folder, cc))
    except (RuntimeError, OSError) as exc:
        log.warning("CPU kernels unavailable, the torch forms run instead: %s", exc)
        return None
