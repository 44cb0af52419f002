"""The runner's own timing is host wall-clock: `infer` and `step` make no CUDA event per call unless a
device-clock timer is passed (a frontend that says it lives on "cuda", on a machine without one)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from flashrt.profile import StageTimer, timers
from flashrt.runner.policy import Policy


class _CudaSaysFrontend:
    """Verbs that touch no device, on a frontend whose `device` is a CUDA one."""

    device, chunk_size, action_dim, n_action_steps, buffers = torch.device("cuda"), 4, 2, 2, None
    buckets = (1,)

    def check(self, obs: Any, noise: Any = None) -> tuple[int, Any]:
        return 1, obs

    def write(self, bucket: int, checked: Any, seed: int | None = None) -> None:
        pass

    def replay(self, bucket: int) -> None:
        pass

    def read(self, checked: Any) -> np.ndarray:
        return np.zeros((4, 2), np.float32)


def test_no_cuda_event_per_call_unless_a_device_timer_is_passed(monkeypatch):
    made, marks = [], []
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: made.append(1))  # would be a CUDA event
    monkeypatch.setattr(timers._CudaClock, "mark", lambda self: marks.append(1) or len(marks))
    monkeypatch.setattr(timers._CudaClock, "elapsed_ms", lambda self, a, b: float(b - a))
    policy = Policy(_CudaSaysFrontend())
    out = policy.infer({})
    assert set(out["timing"]) == {"preprocess_ms", "replay_ms", "postprocess_ms", "total_ms"}
    policy.step({})
    assert not made and not marks
    policy.infer({}, timer=StageTimer("cuda"))  # asked for: the stages on the device's clock
    assert len(marks) == 1 + 2 * 4  # the origin, then start and end of each of the four stages
