"""GraphSet bucket choice, pad + mask, over-size requests, capture on a miss, strict mode, counters."""

from __future__ import annotations

import pytest
import torch

from flashrt.errors import CaptureError, ConfigError, InputError
from flashrt.runtime.buckets import FallbackCounter, GraphSet, length_mask, pad_to
from flashrt.runtime.graphs import get_backend


class MaskedMean:
    """A toy frontend: the mean of the valid part of a variable-length sequence, one graph per bucket.

    Per bucket it owns an input buffer (bucket,), a mask buffer (bucket,) and a shared output (1,).
    """

    def __init__(self, backend="trace", buckets=(4, 8, 16), **opts):
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.out = torch.zeros(1)
        self.built: list[int] = []
        self.graphs = GraphSet(get_backend(backend), self.build, buckets, **opts)

    def build(self, bucket):
        self.built.append(bucket)
        x, mask = self.inputs.setdefault(bucket, (torch.zeros(bucket), torch.zeros(bucket, dtype=torch.bool)))

        def fn():
            valid = mask.to(x.dtype)
            self.out.copy_((x * valid).sum(0, keepdim=True) / valid.sum().clamp(min=1))

        return fn

    def run(self, values: torch.Tensor) -> tuple[int, float]:
        n = values.shape[0]
        bucket = self.graphs.bucket_for(n)
        x, mask = self.inputs[bucket]  # populate: the only writer of the static inputs
        x.copy_(pad_to(values, bucket, value=1e6))  # padding is garbage on purpose: the mask hides it
        mask.copy_(length_mask(n, bucket))
        self.graphs.replay(bucket)
        return bucket, self.out.item()


def test_select_picks_the_smallest_fitting_bucket():
    gs = GraphSet(get_backend("eager"), lambda b: lambda: None, [16, 4, 8, 8])
    assert gs.buckets == [4, 8, 16]
    assert [gs.select(n) for n in (1, 4, 5, 8, 9, 16)] == [4, 4, 8, 8, 16, 16]
    assert gs.select(17) is None
    with pytest.raises(InputError, match="positive"):
        gs.select(0)


def test_bad_configuration_is_a_config_error():
    with pytest.raises(ConfigError, match="on_miss"):
        GraphSet(get_backend("eager"), lambda b: None, [4], on_miss="grow")
    with pytest.raises(ConfigError, match="positive"):
        GraphSet(get_backend("eager"), lambda b: None, [0, 4])
    with pytest.raises(ConfigError, match="max_graphs=2"):
        GraphSet(get_backend("eager"), lambda b: None, [1, 2, 3], max_graphs=2)


def test_padded_and_masked_replay_matches_unpadded_result():
    frontend = MaskedMean()
    frontend.graphs.capture_all()
    assert frontend.built == [4, 8, 16] and len(frontend.graphs) == 3
    for n in (3, 4, 7, 13):
        values = torch.linspace(-1.0, 2.0, n)
        bucket, mean = frontend.run(values)
        assert bucket == frontend.graphs.select(n)
        assert mean == pytest.approx(values.mean().item(), abs=1e-6)
    assert frontend.graphs.counter.count() == 0


def test_declared_bucket_is_captured_lazily_on_first_use():
    frontend = MaskedMean()
    assert len(frontend.graphs) == 0
    frontend.run(torch.ones(5))
    assert frontend.built == [8] and frontend.graphs.report()["captured"] == [8]
    with pytest.raises(InputError, match="no bucket 5"):
        frontend.graphs.graph(5)


def test_oversize_request_is_an_input_error_by_default():
    frontend = MaskedMean()
    with pytest.raises(InputError, match="size 17 exceeds the largest bucket 16"):
        frontend.run(torch.ones(17))
    assert frontend.graphs.counter.count() == 0
    assert frontend.run(torch.ones(2))[1] == pytest.approx(1.0)  # the next good call still works


def test_capture_on_miss_is_counted_and_reported():
    frontend = MaskedMean(on_miss="capture", align=8)
    bucket, mean = frontend.run(torch.arange(20.0))
    assert bucket == 24 and mean == pytest.approx(9.5)
    assert frontend.graphs.buckets == [4, 8, 16, 24]
    report = frontend.graphs.report()
    assert report["captured_on_miss"] == [24] and 24 in report["capture_s"]
    assert report["fallbacks"]["by_kind"] == {"capture_on_miss": 1}
    assert "captured a new bucket 24" in report["fallbacks"]["last"][0]
    bucket, mean = frontend.run(torch.arange(22.0))  # now fits the new bucket: no new miss
    assert bucket == 24 and mean == pytest.approx(10.5)
    assert frontend.graphs.counter.count("capture_on_miss") == 1


def test_capture_on_miss_is_bounded_by_max_graphs():
    frontend = MaskedMean(on_miss="capture", max_graphs=4)
    frontend.run(torch.ones(20))
    with pytest.raises(InputError, match="max_graphs=4"):
        frontend.run(torch.ones(30))
    assert frontend.graphs.buckets == [4, 8, 16, 20]


def test_eager_on_miss_runs_uncaptured_and_is_counted():
    frontend = MaskedMean(on_miss="eager")
    bucket, mean = frontend.run(torch.arange(18.0))
    assert bucket == 18 and mean == pytest.approx(8.5)
    assert frontend.graphs.buckets == [4, 8, 16] and len(frontend.graphs) == 0
    assert frontend.run(torch.ones(18)) == (18, 1.0)
    assert frontend.built == [18]  # built once, run eagerly on each miss
    report = frontend.graphs.report()
    assert report["eager_buckets"] == [18] and report["fallbacks"]["by_kind"] == {"eager_fallback": 2}


@pytest.mark.parametrize("on_miss", ["capture", "eager"])
def test_strict_mode_turns_fallbacks_into_errors(on_miss):
    frontend = MaskedMean(on_miss=on_miss, strict=True)
    with pytest.raises(InputError, match="strict mode forbids"):
        frontend.run(torch.ones(20))
    assert frontend.graphs.buckets == [4, 8, 16] and frontend.graphs.counter.count() == 0
    assert frontend.run(torch.ones(3))[0] == 4


def test_graph_sets_can_share_one_counter():
    counter = FallbackCounter()
    a = MaskedMean(on_miss="eager", counter=counter)
    b = MaskedMean(on_miss="capture", counter=counter)
    a.run(torch.ones(17))
    b.run(torch.ones(17))
    assert counter.as_dict()["by_kind"] == {"eager_fallback": 1, "capture_on_miss": 1}


def test_fallback_counter():
    counter = FallbackCounter(keep_last=2)
    for i in range(3):
        counter.record("eager_fallback", f"call {i}")
    counter.record("capture_on_miss", "bucket 32")
    assert counter.count() == 4 and counter.count("eager_fallback") == 3
    stats = counter.as_dict()
    assert stats == {"strict": False, "total": 4, "by_kind": {"eager_fallback": 3, "capture_on_miss": 1},
                     "last": ["eager_fallback: call 2", "capture_on_miss: bucket 32"]}
    counter.reset()
    assert counter.count() == 0 and counter.as_dict()["last"] == []
    strict = FallbackCounter(strict=True)
    with pytest.raises(CaptureError, match="capture failed"):
        strict.record("eager_fallback", "capture failed", error=CaptureError)
    assert strict.count() == 0


def test_pad_to():
    x = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(pad_to(x, 4, dim=1, value=-1), torch.tensor([[1, 2, -1, -1], [3, 4, -1, -1]]))
    assert torch.equal(pad_to(x, 3, dim=0), torch.tensor([[1, 2], [3, 4], [0, 0]]))
    assert pad_to(x, 2) is x
    assert pad_to(x.bool(), 3, value=False).dtype == torch.bool
    with pytest.raises(InputError, match="cannot pad length 2 down to 1"):
        pad_to(x, 1)


def test_length_mask():
    assert length_mask(2, 4).tolist() == [True, True, False, False]
    assert length_mask(0, 2).tolist() == [False, False]
    assert length_mask(torch.tensor([1, 3]), 3).tolist() == [[True, False, False], [True, True, True]]
    for bad in (5, -1, torch.tensor([1, 5])):
        with pytest.raises(InputError, match="outside 0..4"):
            length_mask(bad, 4)
