"""Environment record saved with every result: versions, device, driver, clocks, git revision.

Only reads what is there: a missing tool (nvidia-smi, git) or file (cpufreq) leaves its field None.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("flashrt", "torch", "numpy", "safetensors", "nvtx", "triton", "lerobot", "transformers",
            "vocos", "bigvgan", "snac", "onnxruntime", "tensorrt", "matplotlib")
_SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "power.limit",
               "temperature.gpu", "persistence_mode")


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed version of each package (None when not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_revision(root: Path | None = None) -> dict[str, Any]:
    """{'commit', 'dirty'} of the checkout holding flashrt (None where not a git checkout)."""
    root = root or Path(__file__).resolve().parent  # git looks upward for the checkout
    commit = _run(["git", "rev-parse", "HEAD"], root)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], root)
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def cpu_record() -> dict[str, Any]:
    """CPU model, core counts, governor, current/max clock (MHz) and 1-minute load where readable
    (a busy machine explains a noisy measurement)."""
    model = next((line.split(":", 1)[1].strip() for line in (_read("/proc/cpuinfo") or "").splitlines()
                  if line.startswith("model name")), platform.processor() or None)
    khz = lambda p: int(v) / 1000 if (v := _read(p)) and v.isdigit() else None
    base = "/sys/devices/system/cpu/cpu0/cpufreq/"
    return {"model": model, "logical_cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "governor": _read(base + "scaling_governor"), "cur_mhz": khz(base + "scaling_cur_freq"),
            "max_mhz": khz(base + "cpuinfo_max_freq"),
            "loadavg_1m": float(v.split()[0]) if (v := _read("/proc/loadavg")) else None}


def gpu_record() -> dict[str, Any] | None:
    """CUDA device, capability, memory, CUDA version and nvidia-smi fields (clocks, driver)."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    smi = _run(["nvidia-smi", f"--query-gpu={','.join(_SMI_FIELDS)}", "--format=csv,noheader", "-i", "0"])
    fields = dict(zip(_SMI_FIELDS, (v.strip() for v in smi.split(",")))) if smi else {}
    return {"name": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_gb": props.total_memory / 2**30, "sm_count": props.multi_processor_count,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "nvidia_smi": fields}


def environment() -> dict[str, Any]:
    """The whole record (see module doc)."""
    import torch

    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "packages": package_versions(), "torch_threads": torch.get_num_threads(),
            "cpu": cpu_record(), "gpu": gpu_record(), "git": git_revision()}
