"""The csrc CPU torch-op library (csrc/*_cpu.cpp): built once per machine and torch with the C++ compiler,
against the running torch's headers, loaded into torch's operator registry.

    lib = load()          # None where it cannot be built or loaded (the reference forms run)
    loads()               # the same as a bool: `flashrt.ops.Form` ``available``
    build(out_dir)        # what `load` runs on a miss (the one builder `flashrt.ops.library`, `RECIPE`)

Ops: ``torch.ops.flashrt_cpu.decode_attention`` (csrc/decode_attention_cpu.cpp), one decode token per row
over that row's own keys (`flashrt.nn.llama.DECODE_ATTENTION`, the slot-batched LM step's attention).

Why a torch op and not the C ABI of `flashrt.ops.csrc_cpu`: a CPU LM's decode step runs as TorchScript
(`flashrt.runtime.jit`), which calls registered ops without the GIL; a ctypes kernel would be a Python
call inside the step, taking the GIL back at every layer of every token from the threads beside it (the
codec stage, the server). The price is torch's C++ ABI: the library is keyed by the torch version and its
``_GLIBCXX_USE_CXX11_ABI`` as well as the sources, the compiler's version, this CPU and the flags.

Build: ``c++ -O3 -march=native -std=c++20 -shared`` with torch's include folders, linked to
``libc10`` and ``libtorch_cpu`` (rpath to torch's lib folder); then without ``-march=native``. Once per
cache key. No OpenMP of its own: a large call is split over torch's inter-op pool as far as the caller's
intra-op thread setting allows (`torch.set_num_threads`, a stage's ``threads``).

Loading: `flashrt.ops.native`'s checks (the sha256 sidecar, ownership and permissions, the verified bytes
loaded), once per process: an op registers itself when its library is loaded, and registering it twice
would abort, so the first library loaded serves every later `load` (whatever its folder).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path
from typing import Any

import torch

from flashrt.ops import csrc_cpu, library, native
from flashrt.ops.csrc import csrc_dir
from flashrt.ops.native import OUT, BuildError, Library

log = logging.getLogger(__name__)

__all__ = ["ABI", "FLAGS", "OPS", "build", "cache_folder", "compiler", "key_fields", "load", "loads",
           "sources"]

ABI = 1  # FLASHRT_TORCH_CPU_ABI of csrc/*_cpu.cpp
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c++20")
OPS = ("decode_attention",)  # what the library registers under torch.ops.flashrt_cpu
TIMEOUT_S = 300.0
NO_COMPILER = ("no C++ compiler (c++, g++, clang++): the CPU torch ops are off, their reference forms run "
               "(slower)")
_LOADED: list[Library | None] = []  # the process's one answer (see the module docstring)
_LOADING = threading.Lock()  # two threads loading models at once must not load the library twice


def sources() -> list[Path]:
    return sorted(csrc_dir().glob("*_cpu.cpp"))


def cache_folder() -> Path:
    """Where the built libraries are kept: the C library's folder (`flashrt.ops.csrc_cpu.cache_folder`)."""
    return csrc_cpu.cache_folder()


def compiler() -> str | None:
    """The C++ compiler on PATH (c++, g++, clang++); None without one."""
    return native.first_on_path(("c++", "g++", "clang++"))


def _torch_paths() -> tuple[list[str], str]:
    root = Path(torch.__file__).resolve().parent
    include = root / "include"
    return [str(include), str(include / "torch" / "csrc" / "api" / "include")], str(root / "lib")


def _commands(cxx: str, fields: dict[str, Any]) -> list[list[str]]:
    """With ``-march=native``, then without it (a compiler that lacks it)."""
    includes, lib = _torch_paths()
    tail = [f"-D_GLIBCXX_USE_CXX11_ABI={fields['cxx11_abi']}",
            *(f for inc in includes for f in ("-isystem", inc)), "-o", OUT, *(str(p) for p in sources()),
            f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu"]
    portable = tuple(f for f in FLAGS if f != "-march=native")
    return [[cxx, *flags, *tail] for flags in (FLAGS, portable)]


RECIPE = library.Recipe("flashrt_torch_cpu", "CPU torch ops", "the C++ compiler", sources, _commands)


def key_fields(cxx: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Everything the library depends on (its cache key and the sidecar's record); BuildError when the
    compiler's ``--version`` fails or hangs."""
    return {"library": RECIPE.library, "sources": library.sources_digest(sources()),
            "compiler": native.tool_version(cxx, timeout_s), "cpu": csrc_cpu.cpu(), "flags": " ".join(FLAGS),
            "torch": torch.__version__, "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI), "abi": ABI}


def library_name(fields: dict[str, Any]) -> str:
    return library.library_name(RECIPE, fields)


def build(out_dir: str | Path, cxx: str | None = None, timeout_s: float = TIMEOUT_S) -> Path:
    """Compile csrc/*_cpu.cpp into ``out_dir/flashrt_torch_cpu-<key>.so`` for this CPU and torch,
    atomically, with its sha256 sidecar; returns its path (an existing verified file of the same key is
    reused). BuildError (a RuntimeError) without a compiler, when it fails (its output in the message) or
    runs past ``timeout_s`` seconds. Builds only: `load` loads."""
    cxx = cxx or compiler()
    if cxx is None:
        raise BuildError(NO_COMPILER)
    return library.build(RECIPE, Path(out_dir), cxx, key_fields(cxx, timeout_s), timeout_s)


def registered() -> bool:
    """Whether every op of `OPS` is in torch's registry (a library of this ABI was loaded)."""
    namespace = torch.ops.flashrt_cpu  # a missing op is an AttributeError
    return all(hasattr(namespace, name) for name in OPS)


def _bind(handle: ctypes.CDLL) -> bool:
    """The library's ABI is this module's and its ops are registered; False otherwise."""
    try:
        return handle.flashrt_torch_cpu_abi() == ABI and registered()
    except AttributeError:
        return False


def load(build_missing: bool = True, *, folder: str | Path | None = None,
         timeout_s: float = TIMEOUT_S) -> Library | None:
    """The CPU torch ops, from ``folder`` (default `cache_folder`), built on a miss; None where they
    cannot be (the reason logged). The first answer serves the process (module docstring)."""
    with _LOADING:
        if not _LOADED:
            lib = _load_or_build(Path(folder) if folder is not None else cache_folder(), build_missing,
                                 timeout_s)
            if lib is None and not build_missing:
                return None  # a later call may build it
            _LOADED.append(lib)
        return _LOADED[0]


def loads() -> bool:
    """Whether the CPU torch ops run here (built and loaded on first use)."""
    return load() is not None


def _load_or_build(folder: Path, build_missing: bool, timeout_s: float) -> Library | None:
    if registered():  # another copy of the library was loaded into this process (not by `load`)
        log.warning("the flashrt_cpu torch ops were registered before flashrt loaded them; not loading again")
        return None
    return library.load_compiled(RECIPE, folder, compiler(), NO_COMPILER, key_fields, _bind, timeout_s,
                                 build_missing)
