"""The stream runner over a toy frontend written in the test (no vocoder, no family): held partial frames,
windows with context, stream == one-shot at any chunking, the end-of-stream check, timing stages."""

from __future__ import annotations

import pytest
import torch

from flashrt.errors import ConfigError, InputError
from flashrt.profile import StageTimer
from flashrt.runner.stream import StreamRunner
from flashrt.runtime.frontend import ChunkSchedule, StreamFrontend, Window


class ToyFrontend:
    """Two inputs: a (B, T) coarse series at 1 step per frame and a (B, 2T) fine one at 2. Output frame t
    (hop 3 samples) mixes frames t-2 .. t+1 (context (2, 1)), zero outside the signal."""

    rates, context, hop, sample_rate, max_frames, batch = (1, 2), (2, 1), 3, 100, 64, 2
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.windows: list[tuple[int, int]] = []    # (offset, frames) of every replay

    def samples(self, frames: int) -> int:
        return frames * self.hop

    def check(self, inputs, partial=False):
        a, b = (torch.as_tensor(x) for x in inputs)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
            raise InputError(f"bad shapes {tuple(a.shape)}, {tuple(b.shape)}")
        frames = min(a.shape[-1], b.shape[-1] // 2)
        if not partial and (b.shape[-1] != 2 * a.shape[-1] or frames == 0):
            raise InputError("inputs are not one whole number of frames")
        return frames, [a, b]

    def bucket(self, frames: int) -> int:
        return frames

    def write(self, bucket: int, window: Window) -> None:
        self._window = window

    def replay(self, bucket: int) -> None:
        w = self._window
        a, b = w.inputs
        x = a + b[..., 0::2] - b[..., 1::2]                                   # (B, T) one value per frame
        x = torch.nn.functional.pad(x, (2, 1))
        y = x[..., :-3] + 2 * x[..., 1:-2] + 3 * x[..., 2:-1] + 5 * x[..., 3:]  # context (2, 1)
        self._out = (y.unsqueeze(-1) * torch.tensor([1.0, 0.5, 0.25])).flatten(1)
        self.windows.append((w.offset, w.frames))

    def read(self, window: Window) -> torch.Tensor:
        return self._out[:, window.lo:window.hi].clone()

    def describe(self):
        return {}

    def report(self):
        return {"toy": True}


def _signal(frames: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, frames, generator=g), torch.randn(1, 2 * frames, generator=g)


def _cut(inputs, sizes):
    """Cut every input by its own list of step counts (inputs may run ahead of each other)."""
    pos = [0] * len(inputs)
    for step in zip(*sizes):
        yield tuple(x[..., p:p + n] for x, p, n in zip(inputs, pos, step))
        pos = [p + n for p, n in zip(pos, step)]


def test_toy_frontend_answers_the_protocol():
    assert isinstance(ToyFrontend(), StreamFrontend)


@pytest.mark.parametrize("steps", [1, 2, 3, 5])
def test_any_chunking_equals_one_shot(steps):
    """Chunks of `steps` coarse steps (and 2x that of the fine input), then chunks that split frames
    unevenly: the fine input half a frame behind, some chunks empty for one input."""
    runner = StreamRunner(ToyFrontend(), chunk=4)
    a, b = _signal(23, seed=steps)
    whole = runner(a, b)
    n = -(-23 // steps)
    even = list(_cut((a, b), ([steps] * n, [2 * steps] * n)))
    assert torch.equal(torch.cat(list(runner.stream(even)), -1), whole)
    uneven = list(_cut((a, b), ([3, 0, 1, 7, 2, 10], [1, 4, 0, 13, 9, 19])))
    assert sum(c[0].shape[-1] for c in uneven) == 23 and sum(c[1].shape[-1] for c in uneven) == 46
    assert torch.equal(torch.cat(list(runner.stream(uneven)), -1), whole)


def test_windows_carry_context_and_absolute_offsets():
    fe = ToyFrontend()
    runner = StreamRunner(fe, chunk=4)
    list(runner.stream([_signal(12)]))
    assert fe.windows == [(0, 5), (2, 7), (6, 6)]       # L + chunk + R at most, starting L frames back


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_growing_windows_equal_one_shot_and_grow_as_the_audio_sent(steps):
    """With max_chunk the first window is as early as before, each later one decodes as many frames as
    the stream has already emitted (at most max_chunk): fewer windows, the same audio."""
    fe = ToyFrontend()
    runner = StreamRunner(fe, chunk=2, max_chunk=8)
    assert runner.stream_windows == (5, 7, 11) and runner.stream_window == 11  # L + (2, 4, 8) + R
    a, b = _signal(40, seed=steps)
    whole = runner(a, b)
    n = -(-40 // steps)
    fe.windows.clear()
    pieces = list(runner.stream(_cut((a, b), ([steps] * n, [2 * steps] * n))))
    assert torch.equal(torch.cat(pieces, -1), whole)
    kept = [p.shape[-1] // fe.hop for p in pieces]
    assert sum(kept) == 40 and kept[:5] == [2, 2, 4, 8, 8]  # then 8s, the last one what is left
    assert fe.windows[:3] == [(0, 3), (0, 5), (2, 7)]       # chunk + R from the start, then L + chunk + R
    fixed = StreamRunner(ToyFrontend(), chunk=2)
    assert len(list(fixed.stream([(a, b)]))) == 20 > len(pieces)


def test_a_chunk_schedule_is_checked():
    assert ChunkSchedule(4, 16).sizes() == (4, 8, 16)
    assert ChunkSchedule(4, 12).sizes() == (4, 8, 12)
    assert ChunkSchedule(3, 3).sizes() == (3,)
    assert [ChunkSchedule(4, 16).chunk(e) for e in (0, 4, 8, 16, 32, 100)] == [4, 4, 8, 16, 16, 16]
    for first, limit in ((0, 4), (4, 2), (True, 4)):
        with pytest.raises(ConfigError, match="stream_chunk"):
            ChunkSchedule(first, limit)
    with pytest.raises(ConfigError, match="max_stream_chunk"):
        StreamRunner(ToyFrontend(), chunk=4, max_chunk=3)


def test_a_stream_ending_inside_a_frame_is_refused():
    runner = StreamRunner(ToyFrontend(), chunk=4)
    a, b = _signal(10)
    with pytest.raises(InputError, match="whole number of frames"):
        list(runner.stream([(a, b[..., :-1])]))
    assert torch.equal(torch.cat(list(runner.stream([(a, b)])), -1), runner(a, b))


def test_stages_and_report():
    runner = StreamRunner(ToyFrontend(), chunk=4)
    timer = StageTimer()
    parts = list(runner.stream(_cut(_signal(10), ([5, 5], [10, 10])), timer=timer))
    stages = [r.stage for r in timer.records()]
    assert stages.count("validate") == 2 and stages.count("replay") == len(parts) == 3
    report = runner.report()
    assert report["frames"] == 10 and report["windows"] == 3 and report["graphs"] == {"toy": True}
    assert report["audio_s"] == 10 * 3 / 100 and report["ttfa_ms"] > 0
