"""A family added in the test itself runs through the runners without touching them: a toy policy (one
linear layer) through `load_policy` detection, `infer`, `step` and `reset`; a toy frame decoder (a
kernel-3 conv, context one frame each side) through the stream runner with any chunking."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from flashrt.errors import CheckpointError, InputError
from flashrt.frontends.registry import policy_families, register_policy_family, unregister_policy_family
from flashrt.runner.policy import Policy, load_policy
from flashrt.runner.stream import StreamRunner
from flashrt.runtime.buckets import GraphSet
from flashrt.runtime.buffers import Buffers, BufferSpec
from flashrt.runtime.frontend import PolicyFamily, PolicyFrontend, StreamFrontend, Window
from flashrt.runtime.graphs import backend_for_device

CHUNK, STATE, ACTION = 4, 3, 2


class ToyPolicy:
    """actions[h] = W @ state + noise[h] + h (one linear layer), one bucket."""

    def __init__(self, weight: torch.Tensor, backend: str | None) -> None:
        self.device, self.chunk_size, self.action_dim = torch.device("cpu"), CHUNK, ACTION
        self.n_action_steps = 2
        self.linear = nn.Linear(STATE, ACTION, bias=False).requires_grad_(False)
        self.linear.weight.copy_(weight)
        self.buffers = Buffers([BufferSpec("expert_state", (STATE,), torch.float32, "input"),
                                BufferSpec("expert_noise", (CHUNK, ACTION), torch.float32, "input"),
                                BufferSpec("expert_actions", (CHUNK, ACTION), torch.float32, "output")],
                               self.device)
        backend = backend_for_device(backend, self.device)
        self.graphs = GraphSet(backend, self._build, (1,), buffers=self.buffers)
        self.graphs.capture_all()

    @property
    def buckets(self) -> tuple[int, ...]:
        return (1,)

    def _build(self, bucket: int):
        b = self.buffers
        steps = torch.arange(CHUNK, dtype=torch.float32)[:, None]
        return lambda: b["expert_actions"].copy_(self.linear(b["expert_state"]) + b["expert_noise"] + steps)

    def check(self, obs: Any, noise: Any = None) -> tuple[int, Any]:
        if not isinstance(obs, dict) or "state" not in obs:
            raise InputError("toy observations are {'state': (3,) floats}")
        state = torch.as_tensor(np.asarray(obs["state"], dtype=np.float32))
        if state.shape != (STATE,):
            raise InputError(f"state: expected ({STATE},), got {tuple(state.shape)}")
        if noise is not None:
            noise = torch.as_tensor(np.asarray(noise, dtype=np.float32)).reshape(CHUNK, ACTION)
        return 1, (state, noise)

    def write(self, bucket: int, checked: Any, seed: int | None = None) -> None:
        state, noise = checked
        self.buffers["expert_state"].copy_(state)
        if noise is None:
            g = torch.Generator().manual_seed(seed if seed is not None else 0)
            noise = torch.randn(CHUNK, ACTION, generator=g)
        self.buffers["expert_noise"].copy_(noise)

    def replay(self, bucket: int) -> None:
        self.graphs.replay(bucket)

    def read(self, checked: Any) -> np.ndarray:
        return self.buffers["expert_actions"].numpy().copy()

    def describe(self) -> dict[str, Any]:
        return {"family": "toy"}

    def report(self) -> dict[str, Any]:
        return self.graphs.report()


def _detect(folder: Path) -> None:
    if not (folder / "toy.json").is_file():
        raise CheckpointError(f"{folder} has no toy.json")


def _load(folder: Path, device="cpu", precision="float32", num_steps=None, backend=None, buckets=None):
    weight = torch.tensor(json.loads((folder / "toy.json").read_text())["weight"])
    return ToyPolicy(weight, backend)


@pytest.fixture
def toy_dir(tmp_path):
    register_policy_family(PolicyFamily("toy", _detect, _load))
    weight = [[1.0, 2.0, 0.5], [-1.0, 0.0, 3.0]]
    (tmp_path / "toy.json").write_text(json.dumps({"weight": weight}))
    yield tmp_path, np.array(weight, dtype=np.float32)
    unregister_policy_family("toy")


@pytest.mark.parametrize("backend", ["eager", "trace"])
def test_toy_policy_runs_through_the_generic_runner(toy_dir, backend):
    folder, weight = toy_dir
    policy = load_policy(folder, backend=backend)
    assert isinstance(policy, Policy) and isinstance(policy.frontend, PolicyFrontend)
    state, noise = np.array([0.5, -1.0, 2.0], np.float32), np.ones((CHUNK, ACTION), np.float32)
    want = weight @ state + noise + np.arange(CHUNK, dtype=np.float32)[:, None]
    np.testing.assert_allclose(policy.infer({"state": state}, noise=noise)["actions"], want, rtol=1e-6)
    seeded = [policy.infer({"state": state}, seed=5)["actions"] for _ in range(2)]
    assert np.array_equal(*seeded)
    steps = [policy.step({"state": state}, noise=noise) for _ in range(3)]
    assert np.array_equal(steps[0], want[0]) and np.array_equal(steps[1], want[1])
    assert np.array_equal(steps[2], want[0]) and policy.queued == 1      # replanned after 2 steps
    policy.reset()
    assert policy.queued == 0
    with pytest.raises(InputError, match="state"):
        policy.step({"state": [1.0]})


def test_unknown_folder_lists_every_family_and_why(toy_dir, tmp_path_factory):
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(CheckpointError) as err:
        load_policy(empty)
    for name in policy_families():
        assert f"{name}:" in str(err.value)
    assert "has no toy.json" in str(err.value)


class ToyDecoder:
    """out[t*2 + j] = (x[t-1] + 2 x[t] + x[t+1]) * (j + 1): a kernel-3 conv (context one frame each
    side, zero-padded at the signal's ends), two samples per frame."""

    rates, context, hop, sample_rate, batch = (1,), (1, 1), 2, 100, 1

    def __init__(self, max_frames: int = 16) -> None:
        self.device, self.max_frames = torch.device("cpu"), max_frames
        self.buffers = Buffers([BufferSpec("features", (1, 1, max_frames), torch.float32, "input"),
                                BufferSpec("audio", (1, 2 * max_frames), torch.float32, "output")],
                               self.device)
        self._frames = 0

    def samples(self, frames: int) -> int:
        return frames * self.hop

    def check(self, inputs: Any, partial: bool = False) -> tuple[int, list[torch.Tensor]]:
        (x,) = inputs
        x = torch.as_tensor(x, dtype=torch.float32).reshape(1, 1, -1)
        return x.shape[-1], [x]

    def bucket(self, frames: int) -> int:
        return frames

    def write(self, bucket: int, window: Window) -> None:
        self.buffers["features"][..., : window.frames].copy_(window.inputs[0])
        self._frames = window.frames

    def replay(self, bucket: int) -> None:
        x = self.buffers["features"][..., : self._frames]
        y = nn.functional.conv1d(x, torch.tensor([[[1.0, 2.0, 1.0]]]), padding=1)[0, 0]
        self.buffers["audio"][0, : 2 * self._frames].copy_(torch.stack([y, 2 * y], -1).reshape(-1))

    def read(self, window: Window) -> torch.Tensor:
        hi = self.samples(window.frames) if window.hi is None else window.hi
        return self.buffers["audio"][:, window.lo:hi].clone()

    def describe(self) -> dict[str, Any]:
        return {"family": "toy-decoder"}

    def report(self) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize("sizes", [[1] * 13, [2] * 6 + [1], [3, 3, 3, 4], [5, 1, 4, 2, 1]])
def test_toy_decoder_streams_through_the_stream_runner(sizes):
    decoder = ToyDecoder()
    assert isinstance(decoder, StreamFrontend)
    runner = StreamRunner(decoder, chunk=3)
    x = torch.randn(sum(sizes))
    one_shot = runner(x)
    pieces, start = [], 0
    for n in sizes:
        pieces.append(x[start:start + n])
        start += n
    streamed = torch.cat(list(runner.stream(pieces)), dim=-1)
    assert torch.equal(streamed, one_shot)
    assert one_shot.shape == (1, 2 * len(x))
