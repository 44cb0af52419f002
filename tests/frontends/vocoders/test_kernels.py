"""Kernels per replay of a vocoder: counted on a meta twin of the loaded frontend (the CUDA path: the
CPU's oneDNN-fused convs launch fewer), reported by describe()."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashrt.frontends.vocoders.kernels import kernels_per_replay
from flashrt.runner.vocoder import load_vocoder

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vocoders"


@pytest.mark.parametrize("name", ["hifigan_v1_tiny", "vocos_mel_tiny", "snac_24khz_tiny"])
def test_meta_count_does_not_depend_on_the_bucket_and_is_described(name):
    voc = load_vocoder(FIXTURES / name, backend="trace", buckets=(40, 64), stream_chunk=4)
    counts = {b: kernels_per_replay(voc.frontend, b) for b in (40, 64)}
    assert counts[40].by_op == counts[64].by_op and counts[64].total > 20
    assert voc.frontend.describe()["kernels_per_replay"] == counts[64].total
    assert f"{counts[64].total:,d} kernels per replay" in voc.summary()

