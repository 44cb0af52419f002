"""`settle`: one full collection, then every live object frozen; garbage made later is still
collected, and the frozen objects are the ones alive at the call."""

from __future__ import annotations

import gc
import weakref

import pytest

from flashrt.runtime.heap import Settled, settle


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the suite runs with its objects collectable


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> _Node:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a


def test_settle_freezes_what_is_alive_and_collects_what_comes_later(unfrozen):
    kept = _cycle()                      # alive at the call: frozen
    assert gc.get_freeze_count() == 0
    settled = settle()
    assert isinstance(settled, Settled) and settled.collect_ms >= 0
    assert settled.frozen == gc.get_freeze_count() >= len(gc.get_objects(generation=None)) // 2 > 0
    assert all(o is not kept for o in gc.get_objects())  # frozen objects are no generation's
    for _ in range(50):
        _cycle()                         # garbage made after: still collected
    assert gc.collect() >= 100
    assert settled.to_dict() == {"frozen": settled.frozen, "collect_ms": settled.collect_ms}
    assert f"{settled.frozen:,d} objects frozen" in settled.summary()


def test_a_cycle_dropped_before_settle_is_collected_not_frozen(unfrozen):
    gc.disable()  # no automatic collection between the drop and settle's own
    try:
        node = _cycle()
        ref = weakref.ref(node)
        del node
        assert ref() is not None         # a cycle: only the collector frees it
        settled = settle()
    finally:
        gc.enable()
    assert ref() is None and settled.frozen == gc.get_freeze_count()
