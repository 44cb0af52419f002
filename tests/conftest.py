"""Fixtures shared by the whole suite; `tests/support/` (readers of the committed fixtures) is put on
the import path here, so test modules import it as `support`."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def one_thread():
    """Run single-threaded: on a loaded 2-core machine every parallel op waits for a descheduled OpenMP
    worker (measured 0.2 ms -> 15 ms per op); results are the same. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
