"""GR00T N1.7 frontend: declared buffers, one captured graph per prompt bucket, the PolicyFrontend verbs.

Buffers (allocated once at the largest bucket; a smaller bucket's graph reads the first L columns):
``vision_pixels`` (I, 3, R, Q) normalized camera images, ``prefix_tokens`` (1, L) chat-template token
ids, ``prefix_token_mask`` (1, L) valid tokens, ``expert_state`` (1, 1, S) normalized padded state,
``expert_noise`` (1, T, A) flow-matching noise, ``expert_actions`` (1, T, A) the normalized chunk.

Hot path (`flashrt.runtime.frontend`): ``check`` validates and preprocesses the observation on the host
(image transforms, tokenization, state normalization; nothing written), ``write`` copies into the
buffers (noise from the caller, a seed, or the frontend's generator), ``replay`` runs the captured step
(vision, Qwen3 layers, VL self-attention, every flow-matching step), ``read`` un-normalizes the chunk.

Ownership: the frontend owns its buffers, graphs and generator; the model's weights must keep their
storage while the graphs live. One call at a time.

Shape legend: I cameras, R x Q image target size, L bucket, S max_state_dim, T horizon, A max_action_dim.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from flashrt import ops
from flashrt.errors import ConfigError, InputError
from flashrt.frontends.groot.common.checkpoint import Embodiment
from flashrt.frontends.groot.common.preprocess import (
    ImageSpec,
    PromptTokenizer,
    as_chw_uint8,
    formalize,
    normalize_pixels,
    transform_image,
)
from flashrt.io import open_checkpoint
from flashrt.ops.decoder import decoder_prefer
from flashrt.quant.precision import QUANTIZED_PRECISIONS, compute_dtype, quantized_kind
from flashrt.runtime.buffers import Buffers, BufferSpec, check_value
from flashrt.runtime.device import resolve_device
from flashrt.runtime.graphs import GraphSet

PROMPT_KEYS = ("prompt", "task")
STATE_KEYS = ("state", "observation.state")


@dataclass(frozen=True)
class Checked:
    """A validated observation, preprocessed on the host; nothing written yet."""

    pixels: torch.Tensor  # (I, 3, R, Q)
    tokens: list[int]
    state: np.ndarray  # (S,) normalized, padded
    raw_state: np.ndarray  # (state_dim,) as given: the reference of relative actions
    noise: torch.Tensor | None  # (1, T, A)


@dataclass(frozen=True)
class Options:
    formalize_language: bool = True
    clip_outliers: bool = True

    @classmethod
    def from_kwargs(cls, kw: Mapping[str, Any]) -> Options:
        """From processor_config.json's kwargs (both on by default)."""
        return cls(bool(kw.get("formalize_language", True)), bool(kw.get("clip_outliers", True)))


@dataclass(frozen=True)
class LoadOptions:
    """What `flashrt.frontends.groot.family.load` passes on to the N1.7 / N1.6 / N1.5 loaders."""

    device: str | torch.device = "cpu"
    precision: str | torch.dtype = "float32"
    num_steps: int | None = None
    backend: str | None = None
    buckets: Sequence[int] | None = None
    embodiment: str | int | None = None
    cameras: Sequence[str] | None = None
    tokenizer: str | Path | None = None
    frame_size: Sequence[int] | None = None
    calibration: Any = None  # int8 / fp8: `flashrt.quant.flow.Calibration` (or a recipe name, dict)
    kernels: str = "auto"  # the form of the "decoder" ops (`flashrt.ops.decoder.decoder_prefer`)


def load_model(
    loader: Callable[..., Any], config: Any, weights: Path, options: LoadOptions
) -> tuple[Any, torch.device]:
    """``loader(config, checkpoint, device, dtype)`` over the checkpoint at ``weights``, on the options'
    device and precision (int8 / fp8: float32, quantized later by `finish`), the forms of its ops chosen
    by the one `flashrt.ops.select` pass (`select_prefer`); returns the model and that device."""
    dev = resolve_device(options.device)
    dtype = compute_dtype(options.precision, quantized=QUANTIZED_PRECISIONS)
    prefer = select_prefer(options.kernels)
    with open_checkpoint(weights) as checkpoint:
        model = loader(config, checkpoint, dev, dtype)
    ops.select(model, dev, dtype, prefer)
    return model, dev


def select_prefer(kernels: str) -> dict[str, str]:
    """What GR00T's `flashrt.ops.select` pass forces: the "decoder" ops (the text layers' norms, RoPE and
    SwiGLU products) by ``kernels`` ("auto": the fused csrc kernels on a CUDA device where they build,
    as for Pi0), and the references of the "mlp" ops (N1.5's SigLIP fc1 + GELU: no oneDNN form, as
    before: its parity is measured on the reference)."""
    return {**decoder_prefer(kernels), "mlp": "aten"}


def finish(frontend: GrootFrontend, options: LoadOptions, folder: str | Path) -> GrootFrontend:
    """The last step of every GR00T loader: quantize the model (``precision`` "int8" / "fp8": the
    calibration cache's scales, calibrated and gated on a miss; `flashrt.frontends.groot.common.quantize`)
    before its graphs are captured, then capture them."""
    kind = quantized_kind(options.precision)
    frontend.quantization = None
    if kind is not None:
        from flashrt.frontends.groot.common.quantize import quantize

        frontend.quantization = quantize(frontend, kind, options.calibration, folder)
    frontend.capture()
    return frontend


def mrope_positions(ids: Sequence[int], image_id: int, grid: tuple[int, int], length: int) -> torch.Tensor:
    """(3, length) M-RoPE ids of a layout: text tokens advance all three rows together; a run of image
    tokens (one image, gh x gw merged) sits at t = p, h = p + row, w = p + col, then p += max(gh, gw);
    positions after ``ids`` continue as text."""
    gh, gw = grid
    pos, p, i = [], 0, 0
    while i < len(ids):
        if ids[i] == image_id:
            rows = torch.arange(gh).repeat_interleave(gw)
            cols = torch.arange(gw).repeat(gh)
            pos.append(torch.stack([torch.full((gh * gw,), p), p + rows, p + cols]))
            p, i = p + max(gh, gw), i + gh * gw
        else:
            pos.append(torch.full((3, 1), p))
            p, i = p + 1, i + 1
    tail = length - sum(t.shape[1] for t in pos)
    pos.append(torch.arange(p, p + max(tail, 0)).expand(3, -1))
    return torch.cat(pos, dim=1)[:, :length]


def read_state(obs: Mapping[str, Any], dim: int) -> np.ndarray:
    """The raw state (dim,) float32 under one of `STATE_KEYS`, checked."""
    value = next((obs[k] for k in STATE_KEYS if k in obs), None)
    if value is None:
        raise InputError(f"state: missing (one of {list(STATE_KEYS)})")
    arr = np.asarray(value.cpu() if isinstance(value, torch.Tensor) else value)
    if (
        arr.dtype == object
        or not np.issubdtype(arr.dtype, np.number)
        or arr.shape not in ((dim,), (1, dim))
    ):
        raise InputError(f"state: expected {dim} numbers, got shape {arr.shape} dtype {arr.dtype}")
    arr = arr.reshape(dim).astype(np.float32)
    if not np.isfinite(arr).all():
        raise InputError("state: contains NaN or inf")
    return arr


def read_prompt(obs: Mapping[str, Any], keys: Sequence[str] = PROMPT_KEYS, batched: bool = False) -> str:
    """The prompt under the first of ``keys`` present ("" when none), checked; ``batched`` also takes
    lerobot's one-element list of tasks."""
    value = next((obs[k] for k in keys if k in obs), "")
    if batched and isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise InputError(f"prompt: expected a string, got {type(value).__name__}")
    return value


def round_buckets(base: int, extras: Sequence[int]) -> tuple[int, ...]:
    """Default prompt buckets: ``base + extra`` tokens rounded up to multiples of 8."""
    return tuple(-(-(base + extra) // 8) * 8 for extra in extras)


def bucket_set(buckets: Sequence[int], header_len: int, header: str) -> tuple[int, ...]:
    """Sorted distinct buckets, each longer than the ``header_len``-token ``header``."""
    out = tuple(sorted({int(b) for b in buckets}))
    if out[0] <= header_len:
        raise ConfigError(f"prompt buckets {out} must exceed the {header_len}-token {header}")
    return out


def _check_token_ids(tokenizer: PromptTokenizer, ids: Any) -> None:
    """The tokenizer must be the backbone's: its vision tokens have the ids the model's config names."""
    pairs = {
        "<|image_pad|>": ids.image,
        "<|vision_start|>": ids.vision_start,
        "<|vision_end|>": ids.vision_end,
    }
    wrong = {t: (tokenizer.ids[t], want) for t, want in pairs.items() if tokenizer.ids[t] != want}
    if wrong:
        raise ConfigError(
            f"{tokenizer.path}: token ids {wrong} (tokenizer, backbone config) disagree; pass the "
            "backbone's own tokenizer.json"
        )


class GrootFrontend:
    """Static buffers + one graph per prompt bucket around a loaded `GrootN17Model` (batch 1).

    The N1.6 / N1.5 frontends extend it through the hooks `_plan` / `_step_args` (the captured call),
    `_normalize_state`, `_prompt_ids`, `_camera_key` and `_image`."""

    LAYOUT = "the image header"  # what the prompt's tokens sit behind, for messages
    batches = (1,)  # one observation per replay (`Policy.infer_batch` runs them in turn)
    cannot_batch = ("GR00T's captured step is built for one observation: its camera buffers, M-RoPE plan "
                    "and token layout have no batch dimension")

    def __init__(
        self,
        model: nn.Module,
        embodiment: Embodiment,
        cameras: Sequence[str],
        image: ImageSpec,
        tokenizer: PromptTokenizer,
        options: Options,
        buckets: Sequence[int] | None,
        backend: Any,
        frame_size: tuple[int, int] | None = None,
    ) -> None:
        self.model, self.config = model, model.config
        self.embodiment, self.cameras, self.image, self.tokenizer = (
            embodiment,
            tuple(cameras),
            image,
            tokenizer,
        )
        self.options = options
        self.device = model.embed.weight.device
        self._chunking(embodiment)
        self.buckets = self._layout(tokenizer, buckets, frame_size)
        self.max_len = self.buckets[-1]
        self._check_dims(embodiment)
        self._positions = mrope_positions(self.header_ids, self.config.tokens.image, self._grid, self.max_len)
        self._allocate(backend)

    def _chunking(self, embodiment: Embodiment) -> None:
        """chunk_size, n_action_steps, action_dim: lerobot returns min(horizon, len(action delta_indices))
        actions and replans after the embodiment's execution horizon."""
        horizon = self.config.head.horizon
        self.chunk_size = min(horizon, embodiment.horizon or horizon)
        self.n_action_steps = min(self.chunk_size, embodiment.replan_period or self.chunk_size)
        self.action_dim = embodiment.action_dim

    def _check_dims(self, embodiment: Embodiment) -> None:
        head = self.config.head
        if embodiment.state_dim > head.max_state_dim or embodiment.action_dim > head.max_action_dim:
            raise ConfigError(f"embodiment {embodiment.tag!r}: state/action dims exceed max_state/action_dim")

    def _allocate(self, backend: Any) -> None:
        """Buffers at the largest bucket, the graph set over `buckets`, the noise generator."""
        self.buffers = Buffers(self._specs(), self.device)
        self.backend = backend
        self.graphs = GraphSet(backend, self._build, self.buckets, buffers=self.buffers)
        self._generator: torch.Generator | None = None  # made on first draw (none exists on meta)

    def _layout(
        self, tokenizer: PromptTokenizer, buckets: Sequence[int] | None, frame_size: tuple[int, int] | None
    ) -> tuple[int, ...]:
        """The fixed token layout: image size, chat header, image-token slots; returns the buckets."""
        image = self.image
        # the pixel size every camera ends at (albumentations keeps the frame's aspect ratio: frames of
        # another size than `frame_size` would give another token layout and are refused in `check`)
        self._frame_size = tuple(frame_size or (image.edge, image.edge))
        self.image_size = image.output_size(*self._frame_size)
        _check_token_ids(tokenizer, self.config.tokens)
        # lerobot left-pads a video horizon of T frames with the current one: every camera's image is fed
        # T times, timestep-major (t0: cameras, t1: cameras, ...); the vision tower runs once per camera
        per_image = self.model.tokens_per_image(self.image_size)
        self.header = tokenizer.header(len(self.cameras) * self.embodiment.frames, per_image)
        self.header_ids = tokenizer.encode(self.header)
        merge = self.config.vision.merge * self.config.vision.patch
        self._grid = (self.image_size[0] // merge, self.image_size[1] // merge)
        image_id = self.config.tokens.image
        self._image_slots = torch.tensor([i for i, t in enumerate(self.header_ids) if t == image_id])
        default = round_buckets(len(self.header_ids) + 16, (0, 16, 48))
        return bucket_set(buckets or default, len(self.header_ids), "header")

    def _specs(self) -> list[BufferSpec]:
        h, (r, q), n = self.config.head, self.image_size, len(self.cameras)
        return [
            BufferSpec(
                "vision_pixels",
                (n, 3, r, q),
                self.model.dtype,
                low=-1.0,
                high=1.0,
                doc="normalized camera images",
            ),
            BufferSpec("prefix_tokens", (1, self.max_len), torch.long, doc="chat-template token ids"),
            BufferSpec("prefix_token_mask", (1, self.max_len), torch.bool, doc="valid prompt tokens"),
            BufferSpec("expert_state", (1, 1, h.max_state_dim), torch.float32, doc="normalized padded state"),
            BufferSpec("expert_noise", (1, h.horizon, h.max_action_dim), torch.float32, doc="N(0, 1) noise"),
            BufferSpec(
                "expert_actions",
                (1, h.horizon, h.max_action_dim),
                torch.float32,
                role="output",
                doc="normalized action chunk",
            ),
        ]

    # ------------------------------------------------------------------------------ capture
    def raw_step(self, bucket: int) -> Callable[[], None]:
        """The no-argument step one graph of ``bucket`` captures (e.g. to count its kernels on a meta
        frontend, `flashrt.bench.kernels`)."""
        return self._build(bucket)

    def kernel_stages(self) -> dict[str, list[torch.nn.Module]]:
        """The stages a kernel count splits the step into: ``vision``, ``text`` (the kept Qwen3 layers),
        ``vl`` (the head's VL self-attention), ``dit`` (the DiT blocks, every flow step); the rest
        (embedding, masks, encoders, casts, updates) counts as "other"."""
        head = self.model.head
        return {"vision": [self.model.vision], "text": list(self.model.layers), "vl": list(head.vl_blocks),
                "dit": list(head.blocks)}

    def _build(self, bucket: int) -> Callable[[], None]:
        sample = self.model.sample_actions
        args, kwargs = self._step_args(bucket)

        def step() -> None:
            with torch.inference_mode():
                sample(*args, **kwargs)

        return step

    def _io(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """The buffers one bucket's step reads and writes: pixels, tokens, mask, state, noise, actions."""
        b = self.buffers
        return (
            b["vision_pixels"],
            b["prefix_tokens"][:, :bucket],
            b["prefix_token_mask"][:, :bucket],
            b["expert_state"],
            b["expert_noise"],
            b["expert_actions"],
        )

    def _step_args(self, bucket: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional and keyword arguments of ``model.sample_actions`` in one bucket's step."""
        return self._io(bucket), {"plan": self._plan(bucket)}

    def _plan(self, bucket: int) -> Any:
        return self.model.plan(
            self._positions,
            self._image_slots,
            self.image_size,
            bucket,
            self.embodiment.id,
            self.embodiment.frames,
        )

    def capture(self) -> dict[str, Any]:
        self.graphs.capture_all()
        return self.report()

    @property
    def frame_shape(self) -> tuple[int, int]:
        """(rows, cols) of camera frames this frontend takes as loaded (synthetic calibration samples):
        N1.7's loaded frame size (its albumentations transform keeps the aspect ratio), else the size
        every frame is transformed to (any frame size works there)."""
        return getattr(self, "_frame_size", None) or tuple(self.image_size)

    @property
    def state_size(self) -> int:
        """The raw state's length (the embodiment's)."""
        return self.embodiment.state_dim

    def report(self) -> dict[str, Any]:
        return {**self.graphs.report(), "buffers_bytes": self.buffers.nbytes()}

    def describe(self) -> dict[str, Any]:
        return {
            "family": "groot",
            "version": "n1.7",
            "embodiment": self.embodiment.tag,
            "embodiment_id": self.embodiment.id,
            "cameras": list(self.cameras),
            "image_size": list(self.image_size),
            "image_transform": self.image.mode,
            "frames_per_camera": self.embodiment.frames,
            "buckets": list(self.buckets),
            "batches": list(self.batches),
            "cannot_batch": self.cannot_batch,
            "backend": getattr(self.backend, "name", type(self.backend).__name__),
            "dtype": str(self.model.dtype),
            "kernels": next(iter(ops.choices(self.model).get("rms_norm", {"aten": 0}))),
            "ops": ops.choices(self.model),
            "num_steps": self.config.head.num_steps,
            "chunk_size": self.chunk_size,
            "action_dim": self.action_dim,
            "buffers_bytes": self.buffers.nbytes(),
        }

    # ------------------------------------------------------------------------------ hot path
    def check(self, obs: Mapping[str, Any], noise: Any = None) -> tuple[int, Checked]:
        if not isinstance(obs, Mapping):
            raise InputError(f"observation: expected a mapping, got {type(obs).__name__}")
        pixels = torch.stack([self._image(obs, cam) for cam in self.cameras])
        raw_state = self._state(obs)
        state = np.zeros(self.config.head.max_state_dim, np.float32)
        state[: raw_state.shape[0]] = self._normalize_state(raw_state)
        ids = self._prompt_ids(obs)
        bucket = self.graphs.select(len(ids))
        if bucket is None:
            raise InputError(
                f"prompt: {len(ids)} tokens with {self.LAYOUT} exceed the largest bucket "
                f"{self.max_len}; buckets: {list(self.buckets)}"
            )
        return bucket, Checked(pixels, ids, state, raw_state, None if noise is None else self._noise(noise))

    def _normalize_state(self, raw: np.ndarray) -> np.ndarray:
        return self.embodiment.state.normalize(raw, self.options.clip_outliers)

    def _prompt_ids(self, obs: Mapping[str, Any]) -> list[int]:
        return self.tokenizer.prompt_ids(self.header, self.header_ids, self._prompt(obs))

    def _camera_key(self, cam: str) -> str:
        """The flat observation key of camera ``cam`` (next to ``obs["images"][cam]``)."""
        return f"observation.images.{cam}"

    def _frame(self, obs: Mapping[str, Any], cam: str) -> torch.Tensor:
        """Camera ``cam``'s frame as a (3, h, w) uint8 tensor, checked."""
        images = obs.get("images") if isinstance(obs.get("images"), Mapping) else {}
        value = images.get(cam, obs.get(self._camera_key(cam)))
        if value is None:
            raise InputError(f"images: camera {cam!r} missing; this policy reads {list(self.cameras)}")
        return as_chw_uint8(f"images[{cam!r}]", value)

    def _image(self, obs: Mapping[str, Any], cam: str) -> torch.Tensor:
        img = self._frame(obs, cam)
        if self.image.output_size(*img.shape[-2:]) != self.image_size:
            raise InputError(
                f"images[{cam!r}]: a {img.shape[-2]}x{img.shape[-1]} frame becomes "
                f"{self.image.output_size(*img.shape[-2:])} pixels under this checkpoint's "
                f"{self.image.mode} transform, not the loaded {self.image_size}; load the policy "
                "with frame_size=(rows, cols) of your cameras"
            )
        return normalize_pixels(transform_image(img, self.image), self.image)

    def _state(self, obs: Mapping[str, Any]) -> np.ndarray:
        """The raw state (state_dim,) float32, checked."""
        return read_state(obs, self.embodiment.state_dim)

    def _prompt(self, obs: Mapping[str, Any]) -> str:
        return formalize(read_prompt(obs), self.options.formalize_language)

    def _noise(self, noise: Any) -> torch.Tensor:
        spec = self.buffers.spec("expert_noise")
        t = noise if isinstance(noise, torch.Tensor) else torch.as_tensor(np.asarray(noise))
        if t.dim() == len(spec.shape) - 1:
            t = t[None]
        if not t.is_floating_point():
            raise InputError(f"noise: expected a float array of shape {spec.shape[1:]}, got dtype {t.dtype}")
        return check_value(spec, t.to(torch.float32))

    def write(self, bucket: int, checked: Checked, seed: int | None = None) -> None:
        tokens = torch.zeros(1, self.max_len, dtype=torch.long)
        tokens[0, : len(checked.tokens)] = torch.tensor(checked.tokens)
        mask = torch.arange(self.max_len)[None] < len(checked.tokens)
        self.buffers.write(
            {
                "vision_pixels": checked.pixels.to(self.model.dtype),
                "prefix_tokens": tokens,
                "prefix_token_mask": mask,
                "expert_state": torch.from_numpy(checked.state)[None, None],
            }
        )
        target = self.buffers["expert_noise"]
        if checked.noise is not None:
            target.copy_(checked.noise)
            return
        if seed is not None:  # drawn on the CPU generator and copied in: the same noise on every device
            target.copy_(torch.randn(target.shape, generator=torch.Generator().manual_seed(int(seed))))
            return
        if self._generator is None:
            self._generator = torch.Generator(self.device)
            self._generator.seed()
        target.copy_(torch.randn(target.shape, generator=self._generator, device=self.device))

    def replay(self, bucket: int) -> None:
        self.graphs.replay(bucket)

    def read(self, checked: Checked) -> np.ndarray:
        norm = self.buffers["expert_actions"][0, : self.chunk_size].to("cpu", copy=True).numpy()
        return self.embodiment.actions.decode(norm, checked.raw_state)
