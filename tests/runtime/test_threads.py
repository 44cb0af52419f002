"""flashrt.runtime.threads: the thread count as a pure function of the cores and their load."""

import pytest
import torch

from flashrt.errors import ConfigError
from flashrt.runtime.threads import CpuLoad, check_threads, choose_threads, free_cores, torch_threads


@pytest.mark.parametrize(
    ("cores", "busy", "free"),
    [(2, 0, 2), (2, 1, 1), (2, 2, 1), (2, 5, 1), (8, 3, 5), (4, 0.4, 4), (4, 1.6, 2), (1, 0, 1)],
)
def test_free_cores_are_the_cores_not_held_by_other_tasks(cores, busy, free):
    assert free_cores(CpuLoad(cores, busy)) == free


@pytest.mark.parametrize(
    ("threads", "load", "ceiling", "want"),
    [
        ("auto", CpuLoad(2, 0), 2, 2),  # an idle 2-core CPU: both
        ("auto", CpuLoad(2, 1), 2, 1),  # a peer core busy: two threads would wait for it at every op
        ("auto", CpuLoad(8, 0), 2, 2),  # never above torch's setting
        ("auto", CpuLoad(8, 2), 16, 6),
        (2, CpuLoad(2, 1), 1, 2),  # an int is the caller's choice, as given
        (None, CpuLoad(2, 1), 2, None),  # torch's setting at each call
    ],
)
def test_choose_threads(threads, load, ceiling, want):
    assert choose_threads(threads, load, ceiling) == want


@pytest.mark.parametrize(
    ("load", "ceiling", "want"),
    [
        (CpuLoad(2, 0), 2, 1),  # two stages on an idle 2-core CPU: one core each, not two pools of two
        (CpuLoad(2, 1), 2, 1),  # a busy peer: still at least one each
        (CpuLoad(8, 0), 16, 4),
        (CpuLoad(8, 0), 2, 2),  # never above torch's setting
    ],
)
def test_auto_shares_the_free_cores_between_stages_that_compute_at_once(load, ceiling, want):
    assert choose_threads("auto", load, ceiling, stages=2) == want
    assert choose_threads(3, load, ceiling, stages=2) == 3  # an int is as given, whatever the stages
    with pytest.raises(ConfigError, match="stages"):
        choose_threads("auto", load, ceiling, stages=0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "two", True])
def test_bad_thread_counts_are_config_errors(bad):
    with pytest.raises(ConfigError, match="threads"):
        check_threads(bad)


def test_probe_sees_this_machine():
    load = CpuLoad.probe(samples=2, gap_s=0.0)
    assert load.cores >= 1 and load.busy >= 0


def test_torch_threads_sets_then_restores():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with torch_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(other):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before
