"""Graph backends are built for the frontend's own device (a frontend on cuda:1 captures on cuda:1)."""

from __future__ import annotations

import pytest
import torch

from flashrt.errors import ConfigError
from flashrt.runtime.graphs import _REGISTRY, EagerBackend, backend_for_device, register_backend


class RecordingBackend(EagerBackend):
    built_for: list[torch.device] = []

    def __init__(self, device: torch.device, **opts) -> None:
        super().__init__(**opts)
        RecordingBackend.built_for.append(torch.device(device))


@pytest.fixture
def recording():
    RecordingBackend.built_for.clear()
    register_backend("recording", RecordingBackend, devices=("cpu", "cuda"), takes_device=True)
    yield RecordingBackend.built_for
    _REGISTRY.pop("recording")


def test_the_device_reaches_the_backend(recording):
    backend_for_device("recording", torch.device("cpu"))
    assert recording == [torch.device("cpu")]


def test_default_and_refusals():
    assert isinstance(backend_for_device(None, torch.device("cpu")), EagerBackend)
    with pytest.raises(ConfigError, match="does not run on cpu"):
        backend_for_device("cuda", torch.device("cpu"))
    with pytest.raises(ConfigError, match="unknown graph backend"):
        backend_for_device("nope", torch.device("cpu"))


def test_pi0_policy_builds_its_backend_for_its_device(recording):
    from support import pi0_e2e as E2E

    from flashrt.runner.policy import load_policy

    load_policy(E2E.case("pi0_cam1").policy_dir, tokenizer=E2E.TOKENIZER, backend="recording")
    assert recording == [torch.device("cpu")]
