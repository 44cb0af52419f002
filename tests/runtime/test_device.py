"""Device resolution, architecture tags and the description `flashrt info` prints."""

from __future__ import annotations

import platform

import pytest
import torch

from flashrt.errors import DeviceError
from flashrt.runtime.device import available_backends, describe_device, device_arch, resolve_device

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


def test_resolve_cpu_forms():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_auto_picks_cuda_when_present():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want
    assert resolve_device().type == want


@pytest.mark.parametrize("spec", ["tpu", "mps", "gpu", "cpu:1", "cuda:x", "cuda:-1"])
def test_unknown_or_malformed_devices(spec):
    with pytest.raises(DeviceError):
        resolve_device(spec)


@NO_CUDA
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_without_a_gpu_is_a_device_error(spec):
    with pytest.raises(DeviceError, match="CUDA is not available"):
        resolve_device(spec)


def test_cpu_arch_and_description():
    arch = device_arch("cpu")
    assert arch == f"cpu-{platform.machine().lower()}"
    info = describe_device("cpu")
    assert info["device"] == "cpu" and info["arch"] == arch and info["capability"] is None
    assert info["torch"] == torch.__version__ and info["threads"] >= 1
    assert isinstance(info["name"], str) and info["name"]
    assert info["memory_bytes"] is None or info["memory_bytes"] > 0
    assert info["backends"] == ["eager", "trace", "onnxrt", "jit"]
    assert info["isa"] == torch.backends.cpu.get_cpu_capability()
    vnni_or_amx = info["int8"]["vnni"] or info["int8"]["amx"]
    assert info["int8"]["activation_qmax"] == (127 if vnni_or_amx else 63)


def test_available_backends_cpu_default_first():
    assert available_backends("cpu") == ["eager", "trace", "onnxrt", "jit"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_arch_and_description():
    major, minor = torch.cuda.get_device_capability(0)
    assert device_arch("cuda:0") == f"sm{major}{minor}"
    info = describe_device("cuda")
    assert info["capability"] == [major, minor] and info["memory_bytes"] > 0
    assert info["backends"][0] == "cuda" and info["cuda"] == torch.version.cuda
    with pytest.raises(DeviceError, match="visible"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")
