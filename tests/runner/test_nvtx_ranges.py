"""NVTX ranges are on by default in `Policy.infer` and the vocoder runner, named as the stages are, so an
Nsight Systems timeline shows flashrt's stages over the graph launches. The NVTX provider (the `nvtx`
package, or torch.cuda.nvtx) is replaced by a recorder: the test runs without a GPU or the package."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from support import pi0_e2e as E2E

import flashrt.profile.nvtx as nvtx
from flashrt.profile import StageTimer
from flashrt.runner.policy import load_policy
from flashrt.runner.vocoder import load_vocoder

pytestmark = pytest.mark.usefixtures("one_thread")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vocoders"


@pytest.fixture
def ranges(monkeypatch):
    """Names of the NVTX ranges opened, in order (nesting is checked by the recorder's stack)."""
    opened, stack = [], []

    @contextmanager
    def record(name):
        opened.append(name)
        stack.append(name)
        try:
            yield
        finally:
            assert stack.pop() == name

    monkeypatch.setattr(nvtx, "_PROVIDER", [record])
    return opened


def test_policy_infer_marks_its_stages_by_default(ranges):
    case = E2E.case("pi0_cam1")
    policy = load_policy(case.policy_dir, tokenizer=E2E.TOKENIZER)
    ranges.clear()
    timer = StageTimer("cpu")
    policy.infer(case.obs(0), noise=case.tensor(0, "noise").numpy(), timer=timer)
    assert ranges == ["validate", "h2d", "replay", "postprocess"] == [r.stage for r in timer.records()]
    ranges.clear()
    policy.infer(case.obs(0), noise=case.tensor(0, "noise").numpy())  # no timer given: still marked
    assert ranges == ["validate", "h2d", "replay", "postprocess"]


def test_vocoder_runner_marks_its_stages_by_default(ranges):
    voc = load_vocoder(FIXTURES / "hifigan_v1_tiny", buckets=(8,))
    ranges.clear()
    voc(torch.randn(1, voc.signature.inputs[0].channels, 6))
    assert ranges and set(ranges) <= {"validate", "h2d", "replay", "d2h"}
    assert ranges[0] == "validate" and "replay" in ranges and ranges[-1] == "d2h"


def test_no_provider_is_a_no_op(monkeypatch):
    monkeypatch.setattr(nvtx, "_PROVIDER", [None])
    with nvtx.nvtx_range("replay"):
        pass
    assert nvtx.nvtx_provider() == "none"
