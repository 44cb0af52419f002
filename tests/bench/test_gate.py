import math

import numpy as np
import pytest
import torch

from flashrt.bench.gate import compare


def test_within_and_beyond_tolerance():
    ref = {"actions": torch.tensor([[1.0, -2.0], [0.0, 4.0]])}
    close = {"actions": ref["actions"] + 1e-6}
    far = {"actions": ref["actions"].clone()}
    far["actions"][1, 1] += 0.5
    ok = compare(close, ref, atol=1e-5, rtol=0)
    assert ok.passed and math.isclose(ok.max_abs, 1e-6, rel_tol=1e-2)
    bad = compare(far, ref, atol=1e-5, rtol=1e-3)
    assert not bad.passed and bad.where == "output['actions']"
    assert math.isclose(bad.max_abs, 0.5, rel_tol=1e-6)
    assert compare(far, ref, atol=0.0, rtol=0.2).passed  # 0.5 <= 0.2 * 4


def test_structure_mismatches_fail():
    ref = {"a": np.zeros(3), "b": [np.ones(2), "text"]}
    assert compare({"a": np.zeros(3), "b": [np.ones(2), "text"]}, ref, 0, 0).passed
    assert not compare({"a": np.zeros(4), "b": [np.ones(2), "text"]}, ref, 1, 1).passed  # shape
    assert not compare({"a": np.zeros(3)}, ref, 1, 1).passed  # keys
    assert not compare({"a": np.zeros(3), "b": [np.ones(2)]}, ref, 1, 1).passed  # length
    assert not compare({"a": np.zeros(3), "b": [np.ones(2), "other"]}, ref, 1, 1).passed  # string
    assert not compare(np.zeros(3), ref, 1, 1).passed  # type


def test_non_finite_and_dtypes():
    ref = torch.tensor([1.0, float("inf")])
    assert compare(torch.tensor([1.0, float("inf")]), ref, 0, 0).passed
    assert not compare(torch.tensor([1.0, float("nan")]), ref, 1, 1).passed
    assert not compare(torch.tensor([float("nan"), float("inf")]), ref, 1, 1).passed
    bf = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert compare(bf, torch.tensor([1.0, 2.0]), 0, 0).passed
    assert compare(torch.tensor([3], dtype=torch.int64), np.array([3]), 0, 0).passed


# The tolerance is atol + rtol * |ref| (the reference's magnitude, never the output's), inclusive.
# Each row fails on one mutation: |out| instead of |ref|, or `<` instead of `<=`.
GATE_BOUNDARIES = {
    "rtol scales with |ref| (small ref)": (2.0, 1.0, 0.0, 0.75, False),  # |out| would allow 1.5
    "rtol scales with |ref| (large ref)": (1.0, 2.0, 0.0, 0.75, True),   # |out| would allow 0.75 < 1
    "negative ref uses its magnitude": (-1.0, -2.0, 0.0, 0.5, True),
    "exactly at atol passes": (4.5, 4.0, 0.5, 0.0, True),
    "exactly at atol + rtol|ref| passes": (5.0, 4.0, 0.5, 0.125, True),
    "just over fails": (5.0 + 2**-20, 4.0, 0.5, 0.125, False),
}


@pytest.mark.parametrize("case", GATE_BOUNDARIES)
def test_gate_tolerance_boundaries(case):
    out, ref, atol, rtol, passed = GATE_BOUNDARIES[case]
    result = compare(torch.tensor([out], dtype=torch.float64), torch.tensor([ref], dtype=torch.float64),
                     atol=atol, rtol=rtol)
    assert result.passed is passed
    assert compare(np.array([out]), np.array([ref]), atol=atol, rtol=rtol).passed is passed
