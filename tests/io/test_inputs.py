"""flashrt.io.inputs: the one rule per run-time input that every family and server applies (#28.7)."""

from __future__ import annotations

import numpy as np
import pytest

from flashrt.errors import InputError
from flashrt.io.inputs import SPEED_MAX, SPEED_MIN, check_speed


@pytest.mark.parametrize("speed", [True, False, "1", None, [1.0], float("nan"), float("inf"), 0, -1.0,
                                   SPEED_MIN / 2, SPEED_MAX * 2, np.bool_(True)])
def test_bad_speeds_are_input_errors(speed):
    with pytest.raises(InputError, match="speed"):
        check_speed(speed)


@pytest.mark.parametrize("speed", [SPEED_MIN, 1, 1.5, SPEED_MAX, np.float32(2.0), np.int64(1)])
def test_good_speeds_come_back_as_floats(speed):
    out = check_speed(speed)
    assert type(out) is float and out == float(speed)
