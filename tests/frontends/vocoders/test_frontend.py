"""`VocoderFrontend`: the smallest captured bucket that holds a window is the one replayed, the eager path
runs every call at its own length, and `describe()` warns when a window's padding exceeds 50 % of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashrt.frontends.vocoders.frontend import PADDING_WARN, PaddingLog
from flashrt.runner.vocoder import load_vocoder

pytestmark = pytest.mark.usefixtures("one_thread")

HIFIGAN = Path(__file__).resolve().parents[2] / "fixtures" / "vocoders" / "hifigan_v1_tiny"


@pytest.fixture(scope="module")
def traced():
    return load_vocoder(HIFIGAN, backend="trace", buckets=(40, 64, 256), stream_chunk=4)


def test_the_smallest_fitting_bucket_is_chosen(traced):
    buckets = traced.buckets
    assert {40, 64, 256} <= set(buckets)
    for frames in range(1, 257):
        assert traced.frontend.bucket(frames) == min(b for b in buckets if b >= frames), frames


def test_the_eager_path_runs_each_call_at_its_own_length():
    eager = load_vocoder(HIFIGAN, buckets=(64, 256), stream_chunk=4)
    assert eager.frontend.exact_length and [eager.frontend.bucket(n) for n in (1, 65, 200)] == [1, 65, 200]
    eager(torch.randn(1, 16, 100))
    d = eager.frontend.describe()
    assert d["padding"]["windows"] == 1 and d["padding"]["worst_overhead"] == 0 and d["warnings"] == []
    assert "WARNING" not in eager.summary()


def test_describe_warns_when_a_call_is_padded_by_more_than_half():
    voc = load_vocoder(HIFIGAN, backend="trace", buckets=(64, 256), stream_chunk=4)
    voc(torch.randn(1, 16, 60))                          # 64: +7 %
    voc(torch.randn(1, 16, 171))                         # 256: +49.7 %, just under the limit
    assert voc.frontend.describe()["warnings"] == [] and "WARNING" not in voc.summary()
    voc(torch.randn(1, 16, 100))                         # 256: +156 %
    d = voc.frontend.describe()
    assert d["padding"] | {"worst_overhead": 0} == {"windows": 3, "over_limit": 1, "limit": PADDING_WARN,
                                                     "worst_overhead": 0, "worst_frames": 100,
                                                     "worst_bucket": 256}
    assert d["padding"]["worst_overhead"] == pytest.approx(1.56)
    assert len(d["warnings"]) == 1 and "100 frames replayed at the 256-frame bucket" in d["warnings"][0]
    assert "WARNING: 1 of 3 window(s) padded by more than 50 %" in voc.summary()


@pytest.mark.parametrize(("frames", "bucket", "warned"), [(2, 3, False), (2, 4, True), (10, 15, False),
                                                          (10, 16, True), (7, 7, False)])
def test_the_limit_is_half_of_the_window_itself(frames, bucket, warned):
    log = PaddingLog()
    log.record(frames, bucket)
    assert bool(log.warnings()) is warned and log.over == warned
