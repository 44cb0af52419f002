"""`load_vocoder` = a vocoder frontend behind the stream runner: any chunking equals the one-shot output for
every family (SNAC with attention windows included: chunks that cut a window, code levels arriving
unevenly), the precision vocabulary, the graph backend built for the frontend's own device."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import flashrt
from flashrt.errors import ConfigError, InputError
from flashrt.frontends.vocoders.frontend import VocoderFrontend
from flashrt.runner.vocoder import Vocoder, load_vocoder
from flashrt.runtime import graphs
from flashrt.runtime.frontend import StreamFrontend
from flashrt.runtime.graphs import EagerBackend, register_backend

pytestmark = pytest.mark.usefixtures("one_thread")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vocoders"
FOLDERS = ("hifigan_v1_tiny", "bigvgan_tiny_wn", "vocos_mel_tiny", "vocos_encodec_tiny", "snac_24khz_tiny",
           "snac_32khz_tiny", "snac_44khz_tiny")
TOL = 1e-5


def _inputs(voc: Vocoder, frames: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, s.high + 1, (1, frames * s.rate), generator=g) if s.is_codes
            else torch.randn(1, s.channels, frames * s.rate, generator=g) for s in voc.signature.inputs]


def _cut(inputs: list[torch.Tensor], sizes: list[list[int]]):
    """Every input cut by its own step counts (inputs run ahead of or behind each other)."""
    pos = [0] * len(inputs)
    for step in zip(*sizes):
        yield tuple(x[..., p:p + n] for x, p, n in zip(inputs, pos, step))
        pos = [p + n for p, n in zip(pos, step)]


def _even(inputs: list[torch.Tensor], rates: list[int], unit: int, steps: int) -> list[tuple]:
    """Chunks of `steps` units, a unit being `unit` steps of the slowest input (rate r: r/rates[0] times
    more of the others); a unit smaller than a frame cuts frames."""
    total = inputs[0].shape[-1] // unit
    n = -(-total // steps)
    return list(_cut(inputs, [[steps * unit * r // rates[0]] * n for r in rates]))


def _uneven(inputs: list[torch.Tensor], seed: int) -> list[tuple]:
    """Random cut points drawn per input: frames split, one input's chunk empty while another's is long."""
    rng = random.Random(seed)
    sizes = []
    for x in inputs:
        cuts = sorted(rng.sample(range(1, x.shape[-1]), k=min(9, x.shape[-1] - 1)))
        sizes.append([b - a for a, b in zip([0, *cuts], [*cuts, x.shape[-1]])])
    width = max(map(len, sizes))
    return list(_cut(inputs, [s + [0] * (width - len(s)) for s in sizes]))


@pytest.mark.parametrize("name", FOLDERS)
def test_any_chunking_equals_one_shot(name):
    """Chunks of 1, 2, 3, 5 units (for SNAC with attention a unit is ONE coarse code, a fraction of a frame)
    and two uneven mixes: every stream equals the one-shot output, and all streams equal each other bit
    for bit (the windows depend only on the stream chunk, never on how the input was cut)."""
    voc = load_vocoder(FIXTURES / name, buckets=(64,), stream_chunk=3)
    rates = [s.rate for s in voc.signature.inputs]
    frames = sum(voc.signature.context) + 7
    inputs = _inputs(voc, frames, seed=len(name))
    whole = voc(*inputs)
    unit = max(1, rates[0] // getattr(voc.config, "coarse_per_frame", rates[0]))   # one coarse code
    streams = [_even(inputs, rates, unit, k) for k in (1, 2, 3, 5)] + [_uneven(inputs, s) for s in (0, 1)]
    first = None
    for chunks in streams:
        got = torch.cat(list(voc.stream(chunks)), -1)
        assert got.shape == whole.shape and (got - whole).abs().max() <= TOL
        first = got if first is None else first
        assert torch.equal(got, first)


def test_snac_with_attention_takes_single_coarse_codes():
    """One coarse code (and its 2, 4, 8 finer codes) per chunk: half an attention window each."""
    voc = load_vocoder(FIXTURES / "snac_32khz_tiny", buckets=(32,), stream_chunk=2)
    assert voc.config.coarse_per_frame == 2 and [s.rate for s in voc.signature.inputs] == [2, 4, 8, 16]
    codes = _inputs(voc, 9, seed=3)
    chunks = [tuple(c[:, i * r:(i + 1) * r] for c, r in zip(codes, (1, 2, 4, 8))) for i in range(18)]
    assert (torch.cat(list(voc.stream(chunks)), -1) - voc(*codes)).abs().max() <= TOL
    with pytest.raises(InputError, match="whole number of frames"):        # 17 coarse codes: half a frame
        list(voc.stream(chunks[:-1]))
    with pytest.raises(InputError, match="whole number of frames"):
        voc(*[c[:, :-1] for c in codes])                                    # one-shot: whole frames only


@pytest.mark.parametrize("spelling,dtype", [("fp32", torch.float32), ("float32", torch.float32),
                                            (torch.float32, torch.float32), ("bf16", torch.bfloat16),
                                            ("bfloat16", torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_one_precision_vocabulary(spelling, dtype):
    voc = load_vocoder(FIXTURES / "hifigan_v1_tiny", precision=spelling, buckets=(8,))
    assert voc.dtype == dtype and voc.buffers["features"].dtype == dtype


def test_unknown_precision_names_the_vocabulary():
    with pytest.raises(ConfigError, match="fp32"):
        load_vocoder(FIXTURES / "hifigan_v1_tiny", precision="fp64")


class _DeviceBackend(EagerBackend):
    """An eager backend that records the device it was built for."""

    built_for: list[torch.device] = []

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.built_for.append(device)


def test_graph_backend_is_built_for_the_frontend_device(monkeypatch):
    monkeypatch.setattr(graphs, "_REGISTRY", dict(graphs._REGISTRY))        # the registration ends here
    register_backend("test-device", _DeviceBackend, devices=("cpu",), takes_device=True, replace=True)
    voc = load_vocoder(FIXTURES / "hifigan_v1_tiny", device="cpu", backend="test-device", buckets=(8,))
    assert _DeviceBackend.built_for == [torch.device("cpu")]
    assert voc.graphs.report()["captured"] == list(voc.buckets)
    mel = torch.randn(1, 16, 5)
    assert (voc(mel) - load_vocoder(FIXTURES / "hifigan_v1_tiny", buckets=(8,))(mel)).abs().max() <= TOL


def test_the_runner_is_over_the_frontend_and_flashrt_points_here():
    voc = flashrt.load_vocoder(FIXTURES / "vocos_mel_tiny", buckets=(16,))
    assert isinstance(voc, Vocoder) and isinstance(voc.frontend, VocoderFrontend)
    assert isinstance(voc.frontend, StreamFrontend)
    assert "vocos vocoder" in voc.summary() and voc.describe()["exact_length"] is True
    assert voc.sample_rate == voc.describe()["sample_rate"] and isinstance(voc.sample_rate, int)


class _Largest(TorchDispatchMode):
    """The largest tensor any op allocates (views of existing storage are not allocations)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t._is_view():
                self.numel = max(self.numel, t.numel())
        return out


def _largest(fn) -> int:
    with _Largest() as mode:
        fn()
    return mode.numel


def test_eager_call_allocates_nothing_bucket_sized():
    """20 frames with buckets (64, 256): the eager call allocates no tensor larger than the module itself
    allocates on exactly those 20 frames; the same call through the padded bucket (exact_length=False,
    the graph path run eagerly) allocates bucket-sized tensors (the counter can fail)."""
    voc = load_vocoder(FIXTURES / "hifigan_v1_tiny", buckets=(64, 256), stream_chunk=4)
    mel = torch.randn(1, 16, 20)
    voc(mel)
    own = _largest(lambda: voc.module(mel))
    assert _largest(lambda: voc(mel)) <= own
    padded = Vocoder(voc.family, voc.config, voc.module, buckets=(64, 256), stream_chunk=4,
                     exact_length=False).capture()
    assert torch.equal(padded(mel), voc(mel)) or (padded(mel) - voc(mel)).abs().max() <= TOL
    bucket = padded.frontend.bucket(20)                   # the stream window (23), else 64
    assert bucket > 20 and _largest(lambda: padded(mel)) >= own * bucket // 20


def test_graph_backends_capture_a_ladder():
    """No buckets given: the eager backend keeps the family's (they only bound the buffers), a graph
    backend captures their range as a geometric ladder, so a call between buckets pads at most 25 %."""
    eager = load_vocoder(FIXTURES / "hifigan_v1_tiny", stream_chunk=4, capture=False)
    traced = load_vocoder(FIXTURES / "hifigan_v1_tiny", stream_chunk=4, backend="trace", capture=False)
    assert set(eager.family.default_buckets) <= set(eager.buckets) and len(eager.buckets) <= 4
    rungs = [b for b in traced.buckets if b >= 64]                # and the stream window below them
    assert rungs[0] == 64 and rungs[-1] == 1024 and max(b / a for a, b in zip(rungs, rungs[1:])) <= 1.25
    assert traced.stream_window in traced.buckets


def test_a_bare_frontend_drives_any_stream_runner():
    """`load_vocoder_frontend` gives the frontend alone (what a TTS path feeds codes into); a runner built
    over it decodes what `load_vocoder` decodes."""
    from flashrt.frontends.vocoders import load_vocoder_frontend
    from flashrt.runner.stream import StreamRunner

    fe = load_vocoder_frontend(FIXTURES / "snac_32khz_tiny", buckets=(32,))
    runner = StreamRunner(fe, chunk=2)
    codes = _inputs(load_vocoder(FIXTURES / "snac_32khz_tiny", buckets=(32,)), 9, seed=4)
    want = load_vocoder(FIXTURES / "snac_32khz_tiny", buckets=(32,), stream_chunk=2)(*codes)
    assert torch.equal(runner(*codes), want)
    assert (torch.cat(list(runner.stream(_uneven(codes, 2))), -1) - want).abs().max() <= TOL
