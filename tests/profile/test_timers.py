import pytest

from flashrt.profile import StageTimer, Timer, nvtx_provider, nvtx_range


def test_stage_timer_groups_calls_and_orders_stages():
    timer = StageTimer("cpu")
    for _ in range(3):
        timer.new_call()
        with timer.stage("validate"):
            pass
        with timer.stage("replay"):
            sum(range(1000))
        with timer.stage("replay"):
            pass
    records = timer.records()
    assert [r.call for r in records] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(r.end_ms >= r.start_ms >= 0 for r in records)
    assert all(b.start_ms >= a.end_ms for a, b in zip(records, records[1:]))
    samples = timer.samples()
    assert list(samples) == ["validate", "replay"] and len(samples["replay"]) == 6
    per_call = timer.per_call()
    assert len(per_call) == 3 and set(per_call[0]) == {"validate", "replay"}
    assert timer.stats(rate_hz=10)["replay"].count == 6


def test_stage_recorded_even_when_body_raises():
    timer = StageTimer()
    with pytest.raises(RuntimeError), timer.stage("boom"):
        raise RuntimeError("x")
    assert [r.stage for r in timer.records()] == ["boom"]


def test_new_call_without_stages_does_not_skip_indices():
    timer = StageTimer()
    timer.new_call()
    timer.new_call()
    with timer.stage("a"):
        pass
    assert timer.records()[0].call == 0
    timer.reset()
    assert timer.records() == [] and timer.call == 0


def test_timer_and_nvtx_noop():
    with Timer() as t, nvtx_range("x"):
        sum(range(100))
    assert t.ms >= 0
    assert nvtx_provider() in {"nvtx", "torch", "none"}
    with pytest.raises(RuntimeError):
        _ = Timer().ms
