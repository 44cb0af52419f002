"""The frontend interface: what every family declares and the verbs the runners call.

The contract between `flashrt/frontends` (below it: nothing here knows a family) and the runners
(`flashrt/runner`, `flashrt/chain`, the bench adapters).

A **frontend** owns one loaded model of one family: its module, its declared `Buffers`, its shape
buckets and every input check. A **runner** (`Policy`, the stream runner, the AR decode runner, the
local chain) owns the call pattern and knows no model. They meet here, and only here.

Hot path, in this order, for one call (each verb has one job; a runner never reaches past them):

    bucket, checked = frontend.check(inputs, ...)   every check; NO buffer touched (InputError)
    frontend.write(bucket, checked, ...)            the only writer of static inputs
    frontend.replay(bucket)                         the captured step of that bucket
    out = frontend.read(checked)                    outputs copied to the host, post-processed

`check` may raise `InputError` naming the field; `write`, `replay` and `read` must not fail on what
`check` accepted. `describe()` says what was chosen at load (backend, buckets, precision, kernels,
bytes); `report()` gives the graphs' counters (captures, replays, fallbacks).

`PolicyFrontend` adds what the `Policy` runner needs from a robot-policy family: the chunk and action
sizes, the checkpoint's replan period, and how randomness enters (a `noise` array checked by `check`,
a `seed` drawn in `write`). Family-specific extras (prefix K/V, embodiment tables, tokenizers,
normalizers, observation spellings) stay inside the family's folder.

`StreamFrontend` is the same contract for a family that decodes a signal frame by frame (vocoders,
codec decoders): the inputs are time series whose steps come `rates[i]` to a frame, an output frame
depends on `context` = (left, right) frames around it, and each replay decodes one `Window` of frames
(the whole signal, or a piece of a stream with its context). The stream runner
(`flashrt.runner.stream`) holds partial frames, cuts windows and stitches their audio; it never
looks inside the model.

A family registers a `PolicyFamily` (detect -> load) in `flashrt.frontends.registry`; `detect`
raises `CheckpointError` with its reason when a folder is not its own, so `load_policy` can list,
for an unknown folder, every family tried and why each declined.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from flashrt.errors import ConfigError
from flashrt.runtime.buffers import Buffers

__all__ = ["Frontend", "PolicyFrontend", "PolicyFamily", "StreamFrontend", "Window", "ChunkSchedule"]


@runtime_checkable
class Frontend(Protocol):
    """The verbs every frontend answers (module docstring)."""

    device: torch.device
    buffers: Buffers

    @property
    def buckets(self) -> tuple[int, ...]: ...

    def check(self, inputs: Any) -> tuple[int, Any]: ...

    def write(self, bucket: int, checked: Any) -> None: ...

    def replay(self, bucket: int) -> None: ...

    def read(self, checked: Any) -> Any: ...

    def describe(self) -> dict[str, Any]: ...

    def report(self) -> dict[str, Any]: ...


@runtime_checkable
class PolicyFrontend(Protocol):
    """A robot-policy frontend: observation in, one un-normalized action chunk out.

    chunk_size       actions per inferred chunk
    action_dim       the checkpoint's own action size (columns of the chunk `read` returns)
    n_action_steps   the checkpoint's replan period (actions of a chunk executed by `Policy.step`)

    check(obs, noise)        -> (bucket, checked); validates the observation (and the caller's noise,
                                None when not given); nothing written
    write(bucket, checked, seed) static inputs written; noise from `checked`, else drawn from `seed`
                                (an int already validated by the runner), else the frontend's own
                                generator (a family without randomness ignores both)
    replay(bucket)           the captured step
    read(checked)            -> (chunk_size, action_dim) float32 numpy, un-normalized (relative
                                actions made absolute with the raw state kept in `checked`)

    Batching (optional; `Policy.infer_batch`, the policy server's several robots). A family that
    batches has ``batches`` (the batch buckets captured at load, 1 among them) and the row verbs:
    ``batch_for(n)`` (the smallest batch bucket holding n rows), ``write_rows(bucket, [(checked,
    seed), ...])`` (observation i into row i, its own noise), ``replay(bucket, batch)`` and
    ``read_rows([checked, ...])``; row i's actions must equal `read` of observation i served alone up
    to float rounding. A family that cannot batch has ``batches = (1,)`` and ``cannot_batch``: one
    sentence saying why (both also in `describe()`); the runner then answers requests one by one.
    """

    device: torch.device
    buffers: Buffers
    chunk_size: int
    action_dim: int
    n_action_steps: int

    @property
    def buckets(self) -> tuple[int, ...]: ...

    def check(self, obs: Mapping[str, Any], noise: Any = None) -> tuple[int, Any]: ...

    def write(self, bucket: int, checked: Any, seed: int | None = None) -> None: ...

    def replay(self, bucket: int) -> None: ...

    def read(self, checked: Any) -> np.ndarray: ...

    def describe(self) -> dict[str, Any]: ...

    def report(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class PolicyFamily:
    """A registry entry: `detect(folder)` returns None when the folder is this family's and raises
    `CheckpointError` saying why not otherwise; `load(folder, **options)` returns a captured
    `PolicyFrontend`. Options every family accepts: device, precision, num_steps, backend, buckets;
    a family lists its own extras (tokenizer, asset_id, embodiment, ...) in `options`."""

    name: str
    detect: Callable[[Path], None]
    load: Callable[..., PolicyFrontend]
    options: tuple[str, ...] = ()
    doc: str = ""


@dataclass(frozen=True)
class Window:
    """One replay of a `StreamFrontend`: `frames` frames of every input (checked tensors, time last),
    whose first frame is frame `offset` of the whole signal; `read` returns its output samples
    [lo, hi) (None: all of them)."""

    inputs: tuple[torch.Tensor, ...]
    frames: int
    offset: int = 0
    lo: int = 0
    hi: int | None = None


@runtime_checkable
class StreamFrontend(Protocol):
    """A frame-by-frame decoder (vocoder, codec decoder): the verbs of `Frontend` over `Window`s.

    rates          steps per frame of each input, in input order (e.g. 1 for mel frames; 1, 2, 4 for
                   codes at three temporal resolutions)
    context        (left, right) frames one output frame depends on, whole frames
    hop            output samples per frame; `samples(frames)` the samples of a whole signal of
                   `frames` frames (at the real end a family may trim)
    max_frames     the most frames one replay decodes
    batch          the largest batch

    check(inputs, partial) -> (frames, tensors)  every check, nothing written; `partial=True` (a
                             stream chunk) accepts steps that are not whole frames, frames is then
                             the whole frames every input covers
    bucket(frames)       -> the shape a window of `frames` frames replays at (>= frames)
    write(bucket, window)   the window's inputs into the static buffers
    replay(bucket)          the captured decode
    read(window)         -> its samples [lo, hi) copied to the host
    """

    device: torch.device
    rates: tuple[int, ...]
    context: tuple[int, int]
    hop: int
    sample_rate: int
    max_frames: int
    batch: int

    def samples(self, frames: int) -> int: ...

    def check(self, inputs: Any, partial: bool = False) -> tuple[int, list[torch.Tensor]]: ...

    def bucket(self, frames: int) -> int: ...

    def write(self, bucket: int, window: Window) -> None: ...

    def replay(self, bucket: int) -> None: ...

    def read(self, window: Window) -> torch.Tensor: ...

    def describe(self) -> dict[str, Any]: ...

    def report(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ChunkSchedule:
    """Frames a stream window decodes: ``first`` while nothing or little is out, then as many as the
    stream has already emitted (so each window at most doubles what was sent: a consumer playing the
    audio as it comes has the previous windows to play while the next is made), at most ``limit``.
    ``limit == first``: every window decodes ``first`` frames."""

    first: int
    limit: int

    def __post_init__(self) -> None:
        if isinstance(self.first, bool) or isinstance(self.limit, bool) or self.first <= 0 \
                or self.limit < self.first:
            raise ConfigError(f"stream_chunk ({self.first}) must be positive and max_stream_chunk "
                              f"({self.limit}) at least stream_chunk")

    def chunk(self, emitted: int) -> int:
        """Frames of the window after ``emitted`` frames were decoded."""
        return min(self.limit, max(self.first, emitted))

    def sizes(self) -> tuple[int, ...]:
        """Every chunk a stream's windows decode before its end (the last one may be shorter)."""
        sizes, emitted = [], 0
        while not sizes or sizes[-1] < self.limit:
            chunk = self.chunk(emitted)
            if chunk not in sizes:
                sizes.append(chunk)
            emitted += chunk
        return tuple(sizes)
