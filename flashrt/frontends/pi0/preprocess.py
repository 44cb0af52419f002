"""Pi0 / Pi0.5 image preprocessing: any size in, the model's square resolution out, values in [-1, 1].

What the reference (lerobot 0.6.1 `PI0Policy._preprocess_images` + `resize_with_pad_torch`, the openpi
PyTorch port) does, and what this module reproduces:

1. the image becomes float32 in [0, 1] (a uint8 image is divided by 255 first);
2. if its size differs from the model's (S, S): resize keeping the aspect ratio — ratio
   ``max(W / S, H / S)``, new size ``int(H / ratio) x int(W / ratio)``, bilinear, ``align_corners=False``,
   no antialiasing — clamp to [0, 1], then pad with 0 (black) centred, the odd pixel going to the
   bottom / right; an image already at (S, S) is left untouched;
3. ``x * 2 - 1`` maps it to [-1, 1] (the padding becomes -1).

A camera missing from an observation is an image of -1 everywhere with its mask off (the reference's
"empty camera"); at least one camera must be present. Cameras are named openpi-style by the suffix of
their lerobot key: ``top`` for ``observation.images.top``; either spelling is accepted.

Accepted image layouts: ``H x W x 3`` (uint8 or float) and ``3 x H x W`` (float or uint8); an array with
3 in both places is read as ``H x W x 3`` when uint8 and ``3 x H x W`` when float, as the reference does.
Float images must already lie in [0, 1].

Shape legend: N cameras, S model resolution, H/W input height/width.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from flashrt.errors import InputError

CAMERA_PREFIX = "observation.images."
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def camera_name(key: str) -> str:
    """``observation.images.top`` -> ``top``; a plain name is returned unchanged."""
    return key.removeprefix(CAMERA_PREFIX)


def camera_key(name: str) -> str:
    """``top`` -> ``observation.images.top`` (the lerobot key)."""
    return name if name.startswith(CAMERA_PREFIX) else CAMERA_PREFIX + name


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise InputError(f"image {name!r}: dtype {value.dtype} is not accepted; pass uint8 or float")
        try:
            return torch.from_numpy(np.ascontiguousarray(value))
        except TypeError:
            raise InputError(f"image {name!r}: dtype {value.dtype} is not accepted") from None
    raise InputError(f"image {name!r}: expected a numpy array or torch tensor, got {type(value).__name__}")


def _to_chw(name: str, t: torch.Tensor) -> torch.Tensor:
    """(3, H, W) view of an HxWx3 or 3xHxW image; InputError for any other shape or channel count."""
    if t.dim() != 3:
        raise InputError(f"image {name!r}: expected H x W x 3 or 3 x H x W, got shape {tuple(t.shape)}")
    last, first = t.shape[-1] == 3, t.shape[0] == 3
    if last and (not first or t.dtype == torch.uint8):
        t = t.permute(2, 0, 1)
    elif not first:
        raise InputError(f"image {name!r}: expected 3 colour channels (H x W x 3 or 3 x H x W), "
                         f"got shape {tuple(t.shape)}")
    if t.shape[1] == 0 or t.shape[2] == 0:
        raise InputError(f"image {name!r}: empty image of shape {tuple(t.shape)}")
    return t


def _check_values(name: str, t: torch.Tensor) -> torch.Tensor:
    """uint8 (0..255) as is; a float image as float32, checked to be finite and within [0, 1]."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype not in _FLOAT_DTYPES:
        raise InputError(f"image {name!r}: dtype {t.dtype} is not accepted; "
                         "pass uint8 (0..255) or float (0..1)")
    t = t.to(torch.float32)
    lo, hi = torch.aminmax(t)
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise InputError(f"image {name!r}: contains NaN or inf")
    if lo < 0.0 or hi > 1.0:
        raise InputError(f"image {name!r}: float images must lie in [0, 1], got values in "
                         f"[{lo:.4g}, {hi:.4g}] (pass uint8 for 0..255 data)")
    return t


def resized_size(height: int, width: int, size: int) -> tuple[int, int]:
    """The reference's resize target for an H x W image into an S x S frame (aspect ratio kept)."""
    ratio = max(width / size, height / size)
    return int(height / ratio), int(width / ratio)


@dataclass(frozen=True)
class CheckedImage:
    """A validated image: (3, H, W) uint8 or float32 in [0, 1] (any memory order, still on the host)
    and its resize target (None when already S x S)."""

    pixels: torch.Tensor
    resize_to: tuple[int, int] | None


def check_image(name: str, value: Any, size: int) -> CheckedImage:
    """Validate one image (layout, channels, dtype, range); touches no buffer, converts nothing."""
    t = _check_values(name, _to_chw(name, _as_tensor(name, value)))
    h, w = t.shape[1:]
    if (h, w) == (size, size):
        return CheckedImage(t, None)
    target = resized_size(h, w, size)
    if min(target) == 0:
        raise InputError(f"image {name!r}: {h} x {w} is too narrow to resize into {size} x {size}")
    return CheckedImage(t, target)


class FrameStaging:
    """Reusable tensors that one camera's frames of ONE layout (shape, strides, dtype) travel through to
    ``device``; made on the first such frame, reused by every later one (no per-call allocation):

        host     a pinned (page-locked) twin of the frame, CUDA only: the frame is copied into it, then
                 to the device with one non_blocking copy (from pageable memory that copy would block)
        frame    the frame on the device as it came (CUDA only; uint8 travels 4x smaller than float)
        unit     float32 in [0, 1] on the device (uint8 frames; a float32 frame is its own)
        resized  the bilinear resize, one per target size (the first resize's own output, kept)

    Each is laid out like the frame (``empty_like``, as ``.to()`` lays out its copy), so every op computes
    what the unstaged code computed, bit for bit (the resize kernel is chosen by memory layout).
    Reuse hazard: ``host`` is read by an asynchronous copy after `write` returns, so it must not be
    rewritten before that copy ran: the owner (`ImagePreprocessor`) keeps one staging per camera slot
    (two cameras never share a host twin within a call) and waits for the previous call's copies
    before writing (one CUDA event)."""

    def __init__(self, pixels: torch.Tensor, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.empty_like(pixels, pin_memory=torch.cuda.is_available()) if cuda else None
        self.frame = torch.empty_like(pixels, device=device) if cuda else None
        self.unit = (torch.empty_like(pixels, dtype=torch.float32, device=device)
                     if pixels.dtype == torch.uint8 else None)
        self.resized: dict[tuple[int, int], torch.Tensor] = {}

    def unit_float(self, pixels: torch.Tensor) -> torch.Tensor:
        """The frame on the device as float32 in [0, 1]; a uint8 frame is converted, then divided by 255
        in place: bit-identical to ``t.float() / 255`` (and faster on the CPU than one mixed-dtype
        division)."""
        if self.host is not None:
            self.host.copy_(pixels)
            pixels = self.frame.copy_(self.host, non_blocking=True)
        return pixels if self.unit is None else self.unit.copy_(pixels).div_(255.0)

    def resize(self, pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """Bilinear, align_corners=False, no antialiasing (F.interpolate's op), into the kept output."""
        out = self.resized.get(size)
        if out is None:
            out = self.resized[size] = F.interpolate(pixels[None], size=size, mode="bilinear",
                                                     align_corners=False)
        else:
            torch.ops.aten.upsample_bilinear2d.out(pixels[None], list(size), False, None, None, out=out)
        return out[0]

    def write(self, image: CheckedImage, out: torch.Tensor) -> None:
        """Resize-with-pad `image` into `out` (3, S, S) and map it to [-1, 1], in place."""
        pixels = self.unit_float(image.pixels)
        if image.resize_to is None:
            torch.mul(pixels, 2.0, out=out).sub_(1.0)
            return
        rh, rw = image.resize_to
        resized = self.resize(pixels, (rh, rw))
        top, left = (out.shape[1] - rh) // 2, (out.shape[2] - rw) // 2
        out.fill_(-1.0)  # the padding: 0 * 2 - 1
        torch.mul(resized.clamp_(0.0, 1.0), 2.0, out=out[:, top:top + rh, left:left + rw]).sub_(1.0)


def write_image(image: CheckedImage, out: torch.Tensor) -> None:
    """Resize-with-pad `image` into `out` (3, S, S) on out's device and map it to [-1, 1], in place
    (one-off: its staging tensors are made for this call; `ImagePreprocessor` keeps them)."""
    FrameStaging(image.pixels, out.device).write(image, out)


def resize_with_pad(image: Any, size: int) -> torch.Tensor:
    """One image (HxWx3 or 3xHxW, uint8 or float in [0, 1]) -> float32 (3, S, S) in [-1, 1]."""
    out = torch.empty(3, size, size)
    write_image(check_image("image", image, size), out)
    return out


MAX_LAYOUTS = 4  # frame layouts per camera an ImagePreprocessor keeps staging for (the oldest goes first)


class ImagePreprocessor:
    """Validates a camera dict and writes it into static (N, 3, S, S) pixel and (N,) mask buffers.

    `cameras` fixes the slot of each camera (the checkpoint's order); `check` validates everything
    and touches nothing, `write` fills the buffers from a checked dict.
    """

    def __init__(self, cameras: tuple[str, ...], resolution: int) -> None:
        if not cameras:
            raise ValueError("a Pi0 policy needs at least one camera")
        self.cameras = tuple(camera_name(c) for c in cameras)
        self.resolution = int(resolution)
        self._slot = {c: i for i, c in enumerate(self.cameras)}
        self._staging: dict[tuple[Any, ...], FrameStaging] = {}
        self._rows = 1  # batch rows written so far (the staging bound grows with them)
        self._copied: Any = None  # CUDA event after the last write's frame copies (made on first use)

    def check(self, images: Mapping[str, Any]) -> dict[str, CheckedImage]:
        """Validate every image (names, layout, dtype, range); InputError before any buffer is touched."""
        if not isinstance(images, Mapping):
            raise InputError(f"images must be a mapping camera -> image, got {type(images).__name__}")
        named = {camera_name(str(k)): v for k, v in images.items()}
        unknown = sorted(set(named) - set(self.cameras))
        if unknown:
            raise InputError(f"unknown camera(s) {unknown}; this checkpoint's cameras are "
                             f"{list(self.cameras)}")
        present = {c: v for c, v in named.items() if v is not None}
        if not present:
            raise InputError(f"no camera image given; at least one of {list(self.cameras)} is required")
        return {c: check_image(c, v, self.resolution) for c, v in present.items()}

    def staging(self, slot: int, pixels: torch.Tensor, device: torch.device, row: int = 0) -> FrameStaging:
        """The `FrameStaging` of camera `slot` of batch `row` for this frame's layout on `device` (made on
        its first frame; at most MAX_LAYOUTS per camera and row are kept). Rows of one batch never share
        a host twin: their copies are all in flight at once."""
        key = (row, slot, tuple(pixels.shape), pixels.stride(), pixels.dtype, device)
        stage = self._staging.get(key)
        if stage is None:
            self._rows = max(self._rows, row + 1)
            if len(self._staging) >= MAX_LAYOUTS * len(self.cameras) * self._rows:
                del self._staging[next(iter(self._staging))]
            stage = self._staging[key] = FrameStaging(pixels, device)
        return stage

    def write(self, checked: Mapping[str, CheckedImage], pixels: torch.Tensor, masks: torch.Tensor,
              row: int = 0) -> None:
        """Fill `pixels` (N, 3, S, S) and `masks` (N,) of batch `row`; a missing camera is -1 with its
        mask off. On CUDA the frames go through pinned staging (`FrameStaging`): row 0 (the first of a
        call) first waits for the previous call's copies out of it; each row then records that its
        copies are queued."""
        if self._copied is not None and row == 0:
            self._copied.synchronize()
        for camera, slot in self._slot.items():
            image = checked.get(camera)
            if image is None:
                pixels[slot].fill_(-1.0)
                masks[slot].fill_(False)
            else:
                self.staging(slot, image.pixels, pixels.device, row).write(image, pixels[slot])
                masks[slot].fill_(True)
        if pixels.device.type == "cuda":
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(pixels.device))
