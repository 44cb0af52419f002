"""GR00T N1.6 frontend: Isaac-GR00T's N1.6 preprocessing, the captured step, the PolicyFrontend verbs.

What Isaac-GR00T's ``Gr00tN1d6Processor`` (eval mode) + the Eagle 3 VL processor do with one
observation, and how it is done here (tests/frontends/groot/n16/test_frontend.py checks every step
against them):

* Image (``use_albumentations``, Isaac-GR00T's default for N1.6): uint8 HxWx3 → letter-box to a square
  (black bars, top/left = half the padding, floored) → OpenCV INTER_AREA resize of the shortest edge to
  ``edge`` (= ``shortest_image_edge``, else the target height; sides Python-rounded) → centre crop of
  ``int(side * crop_fraction)`` → the same shortest-edge resize → the Eagle processor's ``fetch_image``:
  Qwen's ``smart_resize`` with factor 28 and [4, 4096] x 28² pixels, then a PIL bicubic resize when the
  size changes → ``(x - 255 mean) / (255 std)`` in float32 (transformers' fused rescale + normalize;
  mean = std = 0.5 for Eagle-Block2A-2B-v2). Every camera ends at the same square size, so the token
  layout does not depend on the frame size. Needs OpenCV and Pillow (``pip install flashrt[groot]``).
* Prompt: lower-cased and stripped of ``[^\\w\\s]`` when ``formalize_language``. The Eagle chat template
  for one user turn, text first, then the images:
  ``<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n<|im_start|>user\\n`` + prompt +
  for each image k: ``<image k><img>`` + n x ``<IMG_CONTEXT>`` + ``</img>``, then ``<|im_end|>\\n``
  (n = R Q / 28²), tokenized as one string with the backbone's Qwen BPE (`eagle_tokenizer`). The image
  tokens' slots move with the prompt; the model finds them from the token ids inside the graph.
* State: per group, min/max (q01/q99 under ``use_percentiles``) in float64 as Isaac-GR00T keeps its
  statistics: ``2 (x - min) / (max - min) - 1`` (0 where max and min are ``np.isclose``), clipped to
  [-1, 1] when ``clip_outliers``, zero-padded to max_state_dim.
* Actions: `flashrt.frontends.groot.common.actions` (min/max un-normalization, relative → absolute).

Buffers, hot path and ownership as `flashrt.frontends.groot.common.frontend` (the N1.7 frontend this extends).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from flashrt.errors import CheckpointError, ConfigError, InputError
from flashrt.frontends.groot.common import checkpoint as ck
from flashrt.frontends.groot.common.checkpoint import Embodiment
from flashrt.frontends.groot.common.frontend import (
    GrootFrontend,
    LoadOptions,
    Options,
    bucket_set,
    finish,
    load_model,
    read_prompt,
    round_buckets,
)
from flashrt.frontends.groot.common.preprocess import _area_resize, _centre_crop
from flashrt.frontends.groot.n16.model import GrootN16Model, load_n16, n16_config
from flashrt.io.files import TOKENIZER_LIMIT, read_json, read_text, read_tokenizer_json
from flashrt.runtime.graphs import backend_for_device

EAGLE_FACTOR, EAGLE_MIN_PIXELS, EAGLE_MAX_PIXELS = 28, 4 * 28 * 28, 4096 * 28 * 28  # processing_eagle3_vl
EAGLE_MAX_SIDE, EAGLE_MAX_RATIO = 500 * 14, 200
SYSTEM_TURN = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
# Qwen2's pre-tokenizer split (transformers' Qwen2 tokenizer conversion)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
MEDIA_PLACEHOLDER = re.compile(r"<(image|video)-(\d+)>")  # what the Eagle processor expands


# ------------------------------------------------------------------------------------------ images
def eagle_smart_resize(h: int, w: int) -> tuple[int, int]:
    """processing_eagle3_vl's ``smart_resize``: sides rounded to multiples of 28 (at least 28, at most
    7000), then scaled into [4, 4096] x 28² pixels keeping the aspect ratio."""
    if max(h, w) / min(h, w) > EAGLE_MAX_RATIO:
        raise InputError(f"images: aspect ratio {max(h, w) / min(h, w):.0f} is above the processor's 200")
    f = EAGLE_FACTOR
    hb = min(max(f, round(h / f) * f), EAGLE_MAX_SIDE)
    wb = min(max(f, round(w / f) * f), EAGLE_MAX_SIDE)
    if hb * wb > EAGLE_MAX_PIXELS:
        beta = (hb * wb / EAGLE_MAX_PIXELS) ** 0.5
        hb, wb = math.floor(hb / beta / f) * f, math.floor(wb / beta / f) * f
    elif hb * wb < EAGLE_MIN_PIXELS:
        beta = (EAGLE_MIN_PIXELS / (h * w)) ** 0.5
        hb, wb = math.ceil(h * beta / f) * f, math.ceil(w * beta / f) * f
    return hb, wb


@dataclass(frozen=True)
class EagleImageSpec:
    """The N1.6 eval image transform (module docstring) and the Eagle normalization."""

    edge: int
    crop_fraction: float
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1.0 / 255.0
    mode: str = "albumentations"

    @classmethod
    def from_checkpoint(cls, kw: dict[str, Any], bb_dir: Path | None) -> EagleImageSpec:
        if not kw.get("use_albumentations", False):  # Gr00tN1d6Processor's default: torchvision
            raise CheckpointError(
                "processor_config.json: use_albumentations = false (the torchvision image pipeline) is not "
                "supported for GR00T N1.6 yet"
            )
        target, crop = kw.get("image_target_size"), kw.get("image_crop_size")
        frac, edge = kw.get("crop_fraction"), kw.get("shortest_image_edge")
        if (edge is None and target is None) or (frac is None and (crop is None or target is None)):
            raise CheckpointError(
                "processor_config.json: needs shortest_image_edge (or image_target_size) and crop_fraction "
                "(or image_crop_size with image_target_size)"
            )
        frac = float(frac) if frac is not None else int(crop[0]) / float(target[0])
        pre = (
            read_json(bb_dir / "preprocessor_config.json", "Eagle image processor config")
            if (bb_dir is not None and (bb_dir / "preprocessor_config.json").is_file())
            else {}
        )
        if pre.get("do_resize"):
            raise CheckpointError("preprocessor_config.json: do_resize = true is not supported")
        extra = {
            k: tuple(float(x) for x in pre[f"image_{k}"]) for k in ("mean", "std") if pre.get(f"image_{k}")
        }
        return cls(
            int(edge if edge is not None else target[0]),
            frac,
            rescale=float(pre.get("rescale_factor", 1.0 / 255.0)),
            **extra,
        )

    def output_size(self) -> tuple[int, int]:
        """Every frame: letter-boxed square -> edge x edge (the crop is resized back) -> smart_resize."""
        return eagle_smart_resize(self.edge, self.edge)


def _letter_box(img: torch.Tensor) -> torch.Tensor:
    h, w = img.shape[-2:]
    if h == w:
        return img
    ph, pw = max(h, w) - h, max(h, w) - w
    return F.pad(img, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))


def _pil_bicubic(img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    if tuple(img.shape[-2:]) == tuple(size):
        return img
    try:
        from PIL import Image
    except ModuleNotFoundError:
        raise CheckpointError(
            "GR00T N1.6 resizes images with Pillow's bicubic filter, as the Eagle processor: "
            "pip install pillow"
        ) from None
    hwc = Image.fromarray(np.ascontiguousarray(img.permute(1, 2, 0).numpy()))
    out = np.asarray(hwc.resize((size[1], size[0]), Image.Resampling.BICUBIC))
    return torch.from_numpy(out.copy()).permute(2, 0, 1)


def eagle_transform(img: torch.Tensor, spec: EagleImageSpec) -> torch.Tensor:
    """(3, h, w) uint8 -> (3, *spec.output_size()) uint8."""
    img = _area_resize(_letter_box(img.cpu()), spec.edge)
    frac = spec.crop_fraction
    if 0.0 < frac < 1.0:
        img = _centre_crop(img, max(1, int(img.shape[-2] * frac)), max(1, int(img.shape[-1] * frac)))
    img = _area_resize(img, spec.edge)
    return _pil_bicubic(img, eagle_smart_resize(*img.shape[-2:]))


def eagle_normalize(img: torch.Tensor, spec: EagleImageSpec) -> torch.Tensor:
    """uint8 -> float32 ``(x - mean / rescale) / (std / rescale)`` (transformers' fused form)."""
    mean = (torch.tensor(spec.mean) * (1.0 / spec.rescale))[:, None, None]
    std = (torch.tensor(spec.std) * (1.0 / spec.rescale))[:, None, None]
    return (img.float() - mean.to(img.device)) / std.to(img.device)


# ---------------------------------------------------------------------------------------- prompt
def eagle_tokenizer(folder: Path) -> Any:
    """The backbone's tokenizer as `tokenizers` reads it: ``tokenizer.json`` when the folder has one,
    else Qwen2's byte-level BPE from ``vocab.json`` + ``merges.txt`` (NFC, the Qwen2 split, byte-level,
    no prefix space) with the added tokens of ``tokenizer_config.json`` at their own ids — the form
    Eagle-Block2A-2B-v2 ships."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    if os.path.lexists(folder / "tokenizer.json"):  # a non-regular one is refused, not skipped
        return read_tokenizer_json(folder / "tokenizer.json", "GR00T N1.6 tokenizer")
    vocab_path, merges_path = folder / "vocab.json", folder / "merges.txt"
    if not vocab_path.is_file() or not merges_path.is_file():
        raise CheckpointError(
            f"{folder}: no tokenizer.json and no vocab.json + merges.txt (the Eagle backbone's)"
        )
    vocab = read_json(vocab_path, "GR00T N1.6 vocabulary")
    lines = read_text(merges_path, "GR00T N1.6 merges", limit=TOKENIZER_LIMIT).splitlines()
    merges = [tuple(line.split(" ", 1)) for line in lines if line and not line.startswith("#version")]
    tok = Tokenizer(
        models.BPE(
            vocab,
            merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    cfg_path = folder / "tokenizer_config.json"
    added = (
        read_json(cfg_path, "GR00T N1.6 tokenizer config").get("added_tokens_decoder", {})
        if (cfg_path.is_file())
        else {}
    )
    for idx, entry in sorted(((int(k), v) for k, v in added.items()), key=lambda kv: kv[0]):
        special = bool(entry.get("special", False))
        token = AddedToken(
            entry["content"],
            single_word=bool(entry.get("single_word", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            normalized=bool(entry.get("normalized", not special)),
            special=special,
        )
        (tok.add_special_tokens if special else tok.add_tokens)([token])
        if tok.token_to_id(entry["content"]) != idx:
            raise CheckpointError(
                f"{cfg_path}: added token {entry['content']!r} does not land at its id {idx}"
            )
    return tok


class EagleChat:
    """The N1.6 chat layout (module docstring) over `eagle_tokenizer`."""

    SPECIALS = ("<|im_start|>", "<|im_end|>", "<IMG_CONTEXT>", "<img>", "</img>")

    def __init__(self, folder: Path, image_token: int) -> None:
        self.path, self.tok = folder, eagle_tokenizer(folder)
        self.ids = {s: self.tok.token_to_id(s) for s in self.SPECIALS}
        missing = [s for s, i in self.ids.items() if i is None]
        if missing:
            raise CheckpointError(
                f"{folder}: special tokens {missing} missing (not the Eagle 3 VL tokenizer)"
            )
        if self.ids["<IMG_CONTEXT>"] != image_token:
            raise ConfigError(
                f"{folder}: <IMG_CONTEXT> is token {self.ids['<IMG_CONTEXT>']}, the backbone config says "
                f"{image_token}; pass the backbone's own tokenizer"
            )
        self.added = [t.content for t in self.tok.get_added_tokens_decoder().values()]

    def text(self, prompt: str, n_images: int, per_image: int) -> str:
        images = "".join(
            f"<image {k + 1}><img>" + "<IMG_CONTEXT>" * per_image + "</img>" for k in range(n_images)
        )
        return SYSTEM_TURN + "<|im_start|>user\n" + prompt + images + "<|im_end|>\n"

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def prompt_ids(self, prompt: str, n_images: int, per_image: int) -> list[int]:
        if any(s in prompt for s in self.added) or MEDIA_PLACEHOLDER.search(prompt):
            raise InputError(
                "prompt: contains a special token or an <image-k> placeholder of the chat template"
            )
        return self.encode(self.text(prompt, n_images, per_image))


def formalize_n16(prompt: str, enabled: bool) -> str:
    """Isaac-GR00T N1.6: ``re.sub(r"[^\\w\\s]", "", text.lower())`` (no default prompt)."""
    return re.sub(r"[^\w\s]", "", prompt.lower()) if enabled else prompt


@dataclass(frozen=True)
class StateNorm:
    """Min/max in float64, as Isaac-GR00T's StateActionProcessor keeps its statistics."""

    low: np.ndarray
    high: np.ndarray

    def normalize(self, x: np.ndarray, clip: bool) -> np.ndarray:
        out = np.zeros_like(x, dtype=np.float32)
        m = ~np.isclose(self.high, self.low)
        out[m] = (x[m] - self.low[m]) / (self.high[m] - self.low[m])
        out[m] = 2 * out[m] - 1
        return np.clip(out, -1.0, 1.0) if clip else out


def state_norm(side: ck.Sidecars, emb: Embodiment) -> StateNorm:
    cfg = side.kwargs["modality_configs"][emb.tag]
    if cfg.get("state", {}).get("mean_std_embedding_keys") or side.kwargs.get("apply_sincos_state_encoding"):
        raise CheckpointError(
            f"processor_config.json: {emb.tag}: mean/std or sin/cos state encodings are not supported yet"
        )
    lo_name, hi_name = ("q01", "q99") if side.kwargs.get("use_percentiles") else ("min", "max")
    lows, highs = [], []
    for key in cfg["state"]["modality_keys"]:
        entry = side.stats[emb.tag]["state"][key]
        lows += list(entry[lo_name])
        highs += list(entry[hi_name])
    return StateNorm(np.asarray(lows, np.float64), np.asarray(highs, np.float64))


# -------------------------------------------------------------------------------------- frontend
class GrootN16Frontend(GrootFrontend):
    """Static buffers + one graph per prompt bucket around a loaded `GrootN16Model` (batch 1); the
    buffers are the N1.7 frontend's."""

    LAYOUT = "the chat layout"

    def __init__(
        self,
        model: GrootN16Model,
        embodiment: Embodiment,
        cameras: Sequence[str],
        image: EagleImageSpec,
        chat: EagleChat,
        state: StateNorm,
        options: Options,
        buckets: Sequence[int] | None,
        backend: Any,
    ) -> None:
        self.model, self.config = model, model.config
        self.embodiment, self.cameras, self.image, self.chat = embodiment, tuple(cameras), image, chat
        self.state_norm, self.options = state, options
        self.device = model.device
        self._chunking(embodiment)
        self._check_dims(embodiment)
        self.image_size = image.output_size()
        self.per_image = model.tokens_per_image(self.image_size)
        base = len(chat.prompt_ids("", len(self.cameras), self.per_image))
        self.header_len = base
        self.buckets = bucket_set(buckets or round_buckets(base, (16, 32, 64)), base, "chat layout")
        self.max_len = self.buckets[-1]
        self._allocate(backend)

    def _plan(self, bucket: int) -> Any:
        return self.model.plan(bucket, self.image_size, self.embodiment.id)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "version": "n1.6",
            "image_transform": "letterbox+albumentations+eagle",
            "frames_per_camera": 1,
        }

    def _normalize_state(self, raw: np.ndarray) -> np.ndarray:
        return self.state_norm.normalize(raw, self.options.clip_outliers)

    def _prompt_ids(self, obs: Mapping[str, Any]) -> list[int]:
        return self.chat.prompt_ids(self._prompt(obs), len(self.cameras), self.per_image)

    def _image(self, obs: Mapping[str, Any], cam: str) -> torch.Tensor:
        return eagle_normalize(eagle_transform(self._frame(obs, cam), self.image), self.image)

    def _prompt(self, obs: Mapping[str, Any]) -> str:
        return formalize_n16(read_prompt(obs), self.options.formalize_language)


def _require_image_libraries() -> None:
    """OpenCV and Pillow run every N1.6 image (module docstring): refuse at load, not at the first call."""
    import importlib.util

    missing = [
        pip
        for mod, pip in (("cv2", "opencv-python-headless"), ("PIL", "pillow"))
        if importlib.util.find_spec(mod) is None
    ]
    if missing:
        raise CheckpointError(
            "GR00T N1.6 prepares images with OpenCV and Pillow as Isaac-GR00T does: "
            f"pip install {' '.join(missing)}"
        )


def _backbone_dir(folder: Path, bb_dir: Path | None, tokenizer: str | Path | None) -> Path:
    if tokenizer is not None:  # the backbone folder, or a file in it (tokenizer.json, vocab.json)
        return Path(tokenizer).parent if Path(tokenizer).is_file() else Path(tokenizer)
    if bb_dir is None:
        raise CheckpointError(
            f"{folder}: the backbone is the published nvidia/Eagle-Block2A-2B-v2; pass tokenizer=PATH (a "
            "folder with its vocab.json + merges.txt + tokenizer_config.json, as Isaac-GR00T ships them in "
            "gr00t/model/modules/nvidia/Eagle-Block2A-2B-v2)"
        )
    return bb_dir


def load(folder: Path, opts: LoadOptions) -> GrootN16Frontend:
    """A captured GR00T N1.6 frontend for the Isaac-GR00T checkpoint ``folder`` (``opts.frame_size`` is
    unused: N1.6 letter-boxes every frame to one square size)."""
    cameras = opts.cameras
    config, bb_dir = n16_config(folder, ck.read_json(folder / "config.json"), opts.num_steps)
    side = ck.Sidecars.read(folder)
    emb = side.embodiment(opts.embodiment, config.head.num_embodiments)
    if emb.frames != 1:
        raise CheckpointError(
            f"processor_config.json: embodiment {emb.tag!r} reads {emb.frames} video frames per camera; "
            "GR00T N1.6 with frame history is not supported yet"
        )
    cams = tuple(cameras) if cameras is not None else emb.cameras
    if not cams or len(set(cams)) != len(cams) or [c for c in cams if c not in emb.cameras]:
        raise ConfigError(
            f"cameras {list(cams)}: embodiment {emb.tag!r} was trained with {list(emb.cameras)} "
            "(in that order; a subset is allowed)"
        )
    image = EagleImageSpec.from_checkpoint(side.kwargs, bb_dir)
    _require_image_libraries()
    chat = EagleChat(_backbone_dir(folder, bb_dir, opts.tokenizer), config.eagle.image_token)
    model, dev = load_model(load_n16, config, folder, opts)
    options, backend = Options.from_kwargs(side.kwargs), backend_for_device(opts.backend, dev)
    frontend = GrootN16Frontend(
        model, emb, cams, image, chat, state_norm(side, emb), options, opts.buckets, backend
    )
    return finish(frontend, opts, folder)
