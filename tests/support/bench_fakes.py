"""Fake benchmark adapters for the bench tests: deterministic, fast, and each breakable on purpose."""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Any

import torch

from flashrt.bench.registry import ReferenceUnavailable, register_benchmark, unregister_benchmark


@dataclass
class FakeImpl:
    """y = 2x (+ `offset`); raises on calls listed in `fail_on` (call counter, from 0)."""

    name: str = "fake"
    offset: float = 0.0
    fail_on: frozenset[int] = frozenset()
    calls: int = 0
    hoard: list = field(default_factory=list)
    leak_bytes: int = 0

    def run(self, inputs: dict[str, Any], timer: Any) -> dict[str, torch.Tensor]:
        call, self.calls = self.calls, self.calls + 1
        with timer.stage("validate"):
            x = torch.as_tensor(inputs["x"])
        with timer.stage("replay"):
            if call in self.fail_on:
                raise RuntimeError(f"injected failure at call {call}")
            y = x * 2 + self.offset
        if self.leak_bytes:
            self.hoard.append(_resident(self.leak_bytes))
        return {"y": y}


def _resident(size: int) -> mmap.mmap:
    """``size`` bytes of fresh anonymous pages, written (resident): the process's RSS grows by them
    whatever its heap holds (a bytes object of the same size may reuse free heap pages that are resident
    already, and then the RSS does not move: a process that ran other tests first has plenty)."""
    pages = mmap.mmap(-1, size)
    pages.write(b"\x01" * size)
    return pages


class FakeBenchmark(FakeImpl):
    """The adapter: FakeImpl plus trace, references and accounting. Options come from profile.model."""

    def __init__(self, profile: Any, device: str, **opts: Any):
        super().__init__(name="fake", offset=opts.get("offset", 0.0),
                         fail_on=frozenset(opts.get("fail_on", ())), leak_bytes=opts.get("leak_bytes", 0))
        self.profile, self.device = profile, device
        self.refs = opts.get("refs", {})
        self.cold_start_ms = {"load": 1.0, "capture": 2.0}

    def make_inputs(self, trace_seed: int) -> list[dict[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(trace_seed)
        return [{"x": torch.randn(4, 3, generator=gen)} for _ in range(self.profile.bench.trace_len)]

    def reference(self, name: str) -> FakeImpl:
        if name == "eager":
            return FakeImpl(name="eager")
        if name in self.refs:
            return self.refs[name]
        raise ReferenceUnavailable(f"package {name!r} is not installed")

    def flops_bytes(self) -> tuple[float, float]:
        return 12.0, 96.0

    def memory(self) -> dict[str, int]:
        return {"buffers": 48}

    def kernels_per_replay(self) -> dict[str, Any]:
        from flashrt.profile.kernels import count_kernels

        x = torch.empty(4, 3, device="meta")
        return count_kernels(lambda: x * 2 + self.offset).to_dict()

    def policy(self) -> Any:
        return FakePolicy()


class FakePolicy:
    chunk_size = 4

    def __init__(self):
        self.n = 0
        self.replanned = False

    def reset(self) -> None:
        self.n = 0

    def step(self, obs: Any) -> int:
        self.replanned = self.n % self.chunk_size == 0
        self.n += 1
        return self.n


def register_fake(name: str = "fake-test", **opts: Any) -> str:
    """Register a FakeBenchmark factory under `name` (replacing any previous one)."""
    register_benchmark(name, lambda profile, checkpoint, device: FakeBenchmark(profile, device, **opts),
                       description="test fake", replace=True)
    return name


__all__ = ["FakeBenchmark", "FakeImpl", "FakePolicy", "register_fake", "unregister_benchmark"]
