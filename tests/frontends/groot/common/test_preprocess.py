"""GROOT's Qwen-VL `smart_resize` (flashrt/frontends/groot/common/preprocess.py) against transformers'
Qwen2-VL image processor's, on many odd sizes and on each edge: the rounded size exactly at max_pixels or at
min_pixels (kept as rounded), and the aspect ratio exactly at 200 (allowed) or past it (refused)."""

from __future__ import annotations

import pytest
import torch

from flashrt.errors import InputError
from flashrt.frontends.groot.common.preprocess import QWEN3VL_MAX_PIXELS, QWEN3VL_MIN_PIXELS, smart_resize

qwen2_vl = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

# (factor, min_pixels, max_pixels): GROOT N1.7's Qwen3-VL (patch 16 x merge 2, the processor's
# defaults: flashrt's ImageSpec defaults), Qwen2-VL's defaults (patch 14 x merge 2), a small window
SETTINGS = [(32, QWEN3VL_MIN_PIXELS, QWEN3VL_MAX_PIXELS), (28, 56 * 56, 28 * 28 * 1280),
            (16, 64 * 64, 96 * 96)]


def _odd_sizes(n: int = 400) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(0)
    log_sides = torch.rand(n, 2, generator=g, dtype=torch.float64) * torch.tensor(9000.0).log()
    sides = (log_sides.exp().long() | 1).tolist()  # 1..9000, log-uniform; odd: never a multiple
    small = [(h, w) for h in (1, 3, 15, 17, 31, 33, 47, 63, 95, 97) for w in (1, 5, 29, 33, 201, 639)]
    return [tuple(s) for s in sides] + small


def _reference(h: int, w: int, factor: int, lo: int, hi: int) -> tuple[int, int] | None:
    try:
        return tuple(qwen2_vl.smart_resize(h, w, factor=factor, min_pixels=lo, max_pixels=hi))
    except ValueError:  # aspect ratio above 200
        return None


def _ours(h: int, w: int, factor: int, lo: int, hi: int) -> tuple[int, int] | None:
    try:
        return smart_resize(h, w, factor, lo, hi)
    except InputError:
        return None


@pytest.mark.parametrize("factor, lo, hi", SETTINGS)
def test_odd_sizes_match_transformers(factor, lo, hi):
    sizes = [s for s in _odd_sizes() if max(s) / min(s) <= 200]
    mismatches = [(h, w, _ours(h, w, factor, lo, hi), _reference(h, w, factor, lo, hi)) for h, w in sizes
                  if _ours(h, w, factor, lo, hi) != _reference(h, w, factor, lo, hi)]
    assert not mismatches, mismatches[:10]
    ends = {"down": 0, "up": 0, "rounded": 0}
    for h, w in sizes:
        out = _reference(h, w, factor, lo, hi)
        rounded = (round(h / factor) * factor) * (round(w / factor) * factor)
        ends["down" if rounded > hi else "up" if rounded < lo else "rounded"] += out is not None
    assert all(ends.values()), f"every branch is exercised: {ends}"


@pytest.mark.parametrize("h, w, kept", [
    (4100, 4090, (4096, 4096)),   # rounds to exactly max_pixels: kept, not scaled down
    (250, 260, (256, 256)),       # rounds to exactly min_pixels: kept, not scaled up
    (4080, 4111, (4096, 4096)),
    (241, 270, (256, 256))])
def test_a_size_rounding_exactly_to_a_pixel_bound_is_kept(h, w, kept):
    factor, lo, hi = SETTINGS[0]
    assert (round(h / factor) * factor) * (round(w / factor) * factor) in (lo, hi)
    assert _reference(h, w, factor, lo, hi) == kept
    assert smart_resize(h, w, factor, lo, hi) == kept


@pytest.mark.parametrize("h, w", [(1, 200), (200, 1), (3, 600), (601, 3), (7, 1401)])
def test_aspect_ratio_200_is_allowed_and_past_it_refused_like_transformers(h, w):
    for factor, lo, hi in SETTINGS:
        theirs = _reference(h, w, factor, lo, hi)
        assert _ours(h, w, factor, lo, hi) == theirs
        assert (theirs is None) == (max(h, w) / min(h, w) > 200)
