"""Image preprocessing against lerobot 0.6.1's pixels, layouts, missing cameras and refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import pi0_e2e

from flashrt.errors import InputError
from flashrt.frontends.pi0.preprocess import (
    ImagePreprocessor,
    camera_key,
    camera_name,
    resize_with_pad,
    resized_size,
)

E2E = pi0_e2e


def test_camera_names_round_trip():
    assert camera_name("observation.images.top") == "top"
    assert camera_name("top") == "top"
    assert camera_key("top") == "observation.images.top"
    assert camera_key("observation.images.top") == "observation.images.top"


@pytest.mark.parametrize("name", E2E.CASES)
def test_pixels_match_lerobot(name):
    """Every fixture image (resized down, up, or already at size) equals lerobot's preprocessed pixels."""
    case = E2E.case(name)
    pre = ImagePreprocessor(tuple(case.info["cameras"]), case.info["resolution"])
    n, r = len(pre.cameras), pre.resolution
    for i in case.observations:
        pixels, masks = torch.zeros(n, 3, r, r), torch.zeros(n, dtype=torch.bool)
        pre.write(pre.check(case.images(i)), pixels, masks)
        for slot, cam in enumerate(pre.cameras):
            if cam in case.cameras(i):
                ref = case.tensor(i, f"pixels.{cam}")
                assert float((pixels[slot] - ref).abs().max()) <= 1e-6, (name, i, cam)
                assert masks[slot]
            else:
                assert not masks[slot] and bool((pixels[slot] == -1).all())


def test_layouts_and_dtypes_agree():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (37, 50, 3), dtype=np.uint8)
    ref = resize_with_pad(img, 28)
    as_float = img.astype(np.float32) / np.float32(255.0)
    assert torch.equal(resize_with_pad(as_float, 28), ref)  # float HWC
    assert torch.equal(resize_with_pad(np.ascontiguousarray(as_float.transpose(2, 0, 1)), 28), ref)  # CHW
    assert torch.equal(resize_with_pad(torch.from_numpy(img), 28), ref)  # torch uint8
    assert torch.allclose(resize_with_pad(as_float.astype(np.float64), 28), ref, atol=1e-6)
    assert ref.shape == (3, 28, 28) and float(ref.min()) >= -1 and float(ref.max()) <= 1


def test_resize_geometry_and_padding():
    assert resized_size(480, 640, 224) == (168, 224)
    assert resized_size(20, 15, 28) == (28, 21)
    out = resize_with_pad(np.full((10, 40, 3), 255, dtype=np.uint8), 28)  # wide: padded top and bottom
    h = resized_size(10, 40, 28)[0]  # 7 rows of image, 21 rows of padding: 10 above, 11 below
    top = (28 - h) // 2
    assert bool((out[:, :top] == -1).all()) and bool((out[:, top + h:] == -1).all())
    assert torch.allclose(out[:, top:top + h], torch.ones(3, h, 28), atol=1e-6)


def test_image_at_resolution_is_only_rescaled():
    img = np.arange(28 * 28 * 3, dtype=np.uint8).reshape(28, 28, 3)
    expected = torch.from_numpy(img).permute(2, 0, 1).float() / 255.0 * 2.0 - 1.0
    assert torch.equal(resize_with_pad(img, 28), expected)


def test_missing_camera_is_masked():
    pre = ImagePreprocessor(("top", "wrist"), 28)
    pixels, masks = torch.zeros(2, 3, 28, 28), torch.ones(2, dtype=torch.bool)
    pre.write(pre.check({"observation.images.wrist": np.zeros((5, 5, 3), np.uint8)}), pixels, masks)
    assert masks.tolist() == [False, True]
    assert bool((pixels[0] == -1).all())


BAD_IMAGES = {
    "four channels": np.zeros((20, 20, 4), np.uint8),
    "one channel": np.zeros((20, 20, 1), np.uint8),
    "grey 2-D": np.zeros((20, 20), np.uint8),
    "batched": np.zeros((1, 20, 20, 3), np.uint8),
    "int64": np.zeros((20, 20, 3), np.int64),
    "bool": np.zeros((20, 20, 3), bool),
    "float 0..255": np.full((20, 20, 3), 200.0, np.float32),
    "negative float": np.full((20, 20, 3), -0.5, np.float32),
    "nan": np.full((20, 20, 3), np.nan, np.float32),
    "too narrow": np.zeros((1, 400, 3), np.uint8),
    "empty": np.zeros((0, 20, 3), np.uint8),
    "a list": [[[0, 0, 0]]],
}


@pytest.mark.parametrize("what", sorted(BAD_IMAGES))
def test_bad_images_are_refused(what):
    pre = ImagePreprocessor(("top",), 28)
    with pytest.raises(InputError, match="top"):
        pre.check({"top": BAD_IMAGES[what]})


def test_bad_camera_sets_are_refused():
    pre = ImagePreprocessor(("top", "wrist"), 28)
    good = np.zeros((28, 28, 3), np.uint8)
    with pytest.raises(InputError, match="unknown camera.*'side'.*top"):
        pre.check({"top": good, "side": good})
    with pytest.raises(InputError, match="at least one"):
        pre.check({})
    with pytest.raises(InputError, match="mapping"):
        pre.check([good])
