"""GR00T N1.7 preprocessing: camera images, the prompt, the state; and action decoding.

As lerobot 0.6.1's N1.7 processor does it (``processor_groot.py``), for one observation:

* Image (``_transform_n1_7_image_for_vlm_torch`` then the Qwen3-VL image processor): uint8 HxWx3 →
  bicubic antialiased resize to a square ``edge`` (= shortest_image_edge or the target height; a
  non-square camera is squashed) → centre crop of ``round(edge * crop_fraction)`` (offset floored) →
  bicubic resize to the target size; each resize on the uint8 image, skipped when the size matches →
  ``(x / 255 - 0.5) / 0.5``. The Qwen processor's own resize is the identity for
  target sizes that are multiples of 32 (required here).
* Prompt: lower-cased and stripped to letters, digits, spaces and ``_`` when ``formalize_language``;
  empty → "Perform the task.". The Qwen3-VL chat template for one user turn with I images:
  ``<|im_start|>user\\n`` + I x (``<|vision_start|>`` + n x ``<|image_pad|>`` + ``<|vision_end|>``) +
  prompt + ``<|im_end|>\\n``, tokenized with the backbone's ``tokenizer.json``.
* State: min/max from the checkpoint statistics → ``2 (x - min) / (max - min) - 1`` (0 where max ==
  min), clipped to [-1, 1] when ``clip_outliers``, zero-padded to max_state_dim.
* Actions: group by group in `flashrt.frontends.groot.common.actions` (absolute or relative to the state).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from flashrt.errors import CheckpointError, InputError
from flashrt.io.files import read_tokenizer_json

DEFAULT_PROMPT = "Perform the task."


QWEN3VL_MIN_PIXELS, QWEN3VL_MAX_PIXELS = 256 * 256, 4096 * 4096  # Qwen3-VL's image processor defaults
IMAGE_MODES = ("torch", "albumentations")


def smart_resize(h: int, w: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen-VL image processor's target size: each side rounded to a multiple of ``factor``, then
    scaled (keeping the aspect ratio) into [min_pixels, max_pixels]."""
    if max(h, w) / min(h, w) > 200:
        raise InputError(f"images: aspect ratio {max(h, w) / min(h, w):.0f} is above the processor's 200")
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb, wb = (
            max(factor, math.floor(h / beta / factor) * factor),
            max(factor, math.floor(w / beta / factor) * factor),
        )
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


def _shortest_edge(h: int, w: int, edge: int) -> tuple[int, int]:
    if min(h, w) == edge:
        return h, w
    scale = edge / float(min(h, w))
    return max(1, int(round(h * scale))), max(1, int(round(w * scale)))


@dataclass(frozen=True)
class ImageSpec:
    """How a camera frame becomes the backbone's pixels (module docstring): lerobot's ``torch`` geometry
    (square resize, centre crop, resize to ``target``) or its ``albumentations`` one (OpenCV INTER_AREA
    shortest-edge resize, crop, shortest-edge resize; the aspect ratio is kept), then the Qwen image
    processor's ``smart_resize`` and normalization."""

    target: tuple[int, int]  # (height, width)
    edge: int  # the first resize (torch: a square of this side; albumentations: the shortest edge)
    crop_fraction: float | None
    mode: str = "torch"
    factor: int = 32  # patch x merge
    min_pixels: int = QWEN3VL_MIN_PIXELS
    max_pixels: int = QWEN3VL_MAX_PIXELS
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_kwargs(
        cls,
        target: Sequence[int] | None,
        crop: Sequence[int] | None,
        shortest_edge: int | None,
        crop_fraction: float | None,
        multiple: int,
        **extra: Any,
    ) -> ImageSpec:
        if target is None:
            raise CheckpointError("processor_config.json: image_target_size is required")
        th, tw = int(target[0]), int(target[1])
        if crop_fraction is None and crop is not None:
            crop_fraction = int(crop[0]) / float(th)
        if extra.get("mode", "torch") not in IMAGE_MODES:
            raise CheckpointError(f"image transform {extra.get('mode')!r}; known: {IMAGE_MODES}")
        return cls((th, tw), int(shortest_edge or th), crop_fraction, factor=multiple, **extra)

    def output_size(self, h: int, w: int) -> tuple[int, int]:
        """The pixel size a (h, w) camera frame ends at (the backbone's image grid follows from it)."""
        if self.mode == "torch":
            size = self.target
        else:
            eh, ew = _shortest_edge(h, w, self.edge)
            frac = self.crop_fraction
            if frac is not None and 0.0 < frac < 1.0:
                eh, ew = max(1, int(eh * frac)), max(1, int(ew * frac))
            size = _shortest_edge(eh, ew, self.edge)
        return smart_resize(*size, self.factor, self.min_pixels, self.max_pixels)


def _resize(img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(3, h, w) uint8 -> (3, *size) uint8: torch's native uint8 bicubic antialiased kernel, which is what
    torchvision's v2 ``resize`` runs on CPU uint8 images (the float32 kernel differs by up to 15 levels)."""
    if tuple(img.shape[-2:]) == tuple(size):
        return img
    return F.interpolate(img[None], size=list(size), mode="bicubic", align_corners=False, antialias=True)[0]


def _centre_crop(img: torch.Tensor, ch: int, cw: int) -> torch.Tensor:
    top, left = max(0, (img.shape[-2] - ch) // 2), max(0, (img.shape[-1] - cw) // 2)
    return img[:, top : top + ch, left : left + cw]


def _torch_geometry(img: torch.Tensor, spec: ImageSpec) -> torch.Tensor:
    img = _resize(img, (spec.edge, spec.edge))
    frac = spec.crop_fraction
    if frac is not None and 0.0 < frac < 1.0:
        img = _centre_crop(
            img, max(1, int(round(img.shape[-2] * frac))), max(1, int(round(img.shape[-1] * frac)))
        )
    return _resize(img, spec.target)


def _area_resize(img: torch.Tensor, edge: int) -> torch.Tensor:
    """OpenCV's INTER_AREA shortest-edge resize, as the reference runs it (cv2 is an optional dependency,
    needed only by checkpoints that ask for this transform)."""
    h, w = img.shape[-2:]
    size = _shortest_edge(h, w, edge)
    if size == (h, w):
        return img
    try:
        import cv2
    except ModuleNotFoundError:
        raise CheckpointError(
            "this checkpoint prepares images with OpenCV's INTER_AREA resize "
            "(use_albumentations): pip install opencv-python-headless"
        ) from None
    hwc = np.ascontiguousarray(img.permute(1, 2, 0).numpy())
    return torch.from_numpy(cv2.resize(hwc, (size[1], size[0]), interpolation=cv2.INTER_AREA)).permute(
        2, 0, 1
    )


def _albumentations_geometry(img: torch.Tensor, spec: ImageSpec) -> torch.Tensor:
    img = _area_resize(img, spec.edge)
    frac = spec.crop_fraction
    if frac is not None and 0.0 < frac < 1.0:
        img = _centre_crop(img, max(1, int(img.shape[-2] * frac)), max(1, int(img.shape[-1] * frac)))
    return _area_resize(img, spec.edge)


def transform_image(img: torch.Tensor, spec: ImageSpec) -> torch.Tensor:
    """(3, h, w) uint8 -> (3, *spec.output_size(h, w)) uint8."""
    size = spec.output_size(*img.shape[-2:])
    img = _torch_geometry(img, spec) if spec.mode == "torch" else _albumentations_geometry(img.cpu(), spec)
    return _resize(img, size)


def normalize_pixels(img: torch.Tensor, spec: ImageSpec | None = None) -> torch.Tensor:
    """uint8 -> float32 ``(x / 255 - mean) / std`` per channel (Qwen3-VL: 0.5 / 0.5)."""
    x = img.float() * (1.0 / 255.0)
    if spec is None or (spec.mean == (0.5,) * 3 and spec.std == (0.5,) * 3):
        return (x - 0.5) / 0.5
    mean = torch.tensor(spec.mean, device=x.device)[:, None, None]
    std = torch.tensor(spec.std, device=x.device)[:, None, None]
    return (x - mean) / std


def as_chw_uint8(name: str, value: object) -> torch.Tensor:
    """An HxWx3 (or 3xHxW) image, uint8 or float in [0, 1] (truncated to uint8 as lerobot does)."""
    t = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: expected an image array, got {type(value).__name__}")
    if t.dim() != 3 or 3 not in (t.shape[0], t.shape[-1]) or t.numel() == 0:
        raise InputError(f"{name}: expected an HxWx3 or 3xHxW image, got shape {tuple(t.shape)}")
    if t.shape[-1] == 3:
        t = t.permute(2, 0, 1)
    if t.dtype == torch.uint8:
        return t.contiguous()
    if not t.is_floating_point():
        raise InputError(f"{name}: expected uint8 or float pixels, got {t.dtype}")
    if not bool(torch.isfinite(t).all()):
        raise InputError(f"{name}: contains NaN or inf")
    return (t.float().clamp(0, 1) * 255.0).to(torch.uint8).contiguous()


def formalize(prompt: str, enabled: bool) -> str:
    text = prompt or DEFAULT_PROMPT
    if enabled:
        text = "".join(ch for ch in text.lower() if ch.isalnum() or ch.isspace() or ch == "_")
    return text


class PromptTokenizer:
    """The backbone's ``tokenizer.json`` (HF `tokenizers`, local files only) and the N1.7 chat layout."""

    SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>")

    def __init__(self, path: Path) -> None:
        try:
            import tokenizers  # noqa: F401
        except ModuleNotFoundError as exc:  # pragma: no cover - a declared dependency
            raise CheckpointError("GR00T needs the 'tokenizers' package (pip install tokenizers)") from exc
        if not os.path.lexists(path):  # there but not a regular file: read_tokenizer_json says what it is
            raise CheckpointError(f"{path}: tokenizer.json not found (pass tokenizer=PATH; "
                                  "CLI: --tokenizer PATH)")
        self.path = path
        self.tok = read_tokenizer_json(path, "GR00T tokenizer")
        self.ids = {s: self.tok.token_to_id(s) for s in self.SPECIALS}
        missing = [s for s, i in self.ids.items() if i is None]
        if missing:
            raise CheckpointError(f"{path}: special tokens {missing} missing (not a Qwen3-VL tokenizer)")

    def header(self, n_images: int, per_image: int) -> str:
        img = "<|vision_start|>" + "<|image_pad|>" * per_image + "<|vision_end|>"
        return "<|im_start|>user\n" + img * n_images

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True).ids

    def prompt_ids(self, header: str, header_ids: list[int], prompt: str) -> list[int]:
        """Token ids of ``header + prompt + <|im_end|>\\n``; InputError when the prompt breaks the layout."""
        if any(s in prompt for s in self.SPECIALS):
            raise InputError(f"prompt: contains a special token of the chat template ({list(self.SPECIALS)})")
        ids = self.encode(header + prompt + "<|im_end|>\n")
        if ids[: len(header_ids)] != header_ids:
            raise InputError("prompt: merges with the chat header when tokenized; start it with a letter")
        return ids


@dataclass(frozen=True)
class MinMax:
    """Per-dimension min / max (the checkpoint's statistics, flattened in modality-key order)."""

    low: np.ndarray
    high: np.ndarray

    def normalize(self, x: np.ndarray, clip: bool) -> np.ndarray:
        """float32 arithmetic, as lerobot's torch code."""
        span = self.high - self.low
        safe = np.where(span != 0, span, np.float32(1.0))
        y = np.where(span != 0, np.float32(2.0) * (x - self.low) / safe - np.float32(1.0), np.float32(0.0))
        return (np.clip(y, -1.0, 1.0) if clip else y).astype(np.float32)
