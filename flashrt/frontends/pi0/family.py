"""The Pi0 / Pi0.5 policy family: `FAMILY` (detect -> load) and `Pi0PolicyFrontend`, the
`flashrt.runtime.frontend.PolicyFrontend` that the model-agnostic `Policy` runner drives.

Everything Pi0-specific lives here and in this folder: the observation spellings
(`observation.py`), image preprocessing on the device (`preprocess.py`), the PaliGemma prompt formats
and Pi0.5's discretized state (`tokenizer.py`), the checkpoint's normalization statistics and
relative actions (`normalize.py`, `checkpoint.py`), and the captured step (`frontend.py`).

    check(obs, noise)      observation -> images checked, state normalized, prompt tokenized, the
                           caller's noise checked; the prompt bucket chosen. Nothing written.
    write(bucket, c, seed) images (resized with padding on the device), tokens, state, noise
    replay(bucket)         vision + prefix + every denoise step of that bucket
    read(c)                actions to the host, un-normalized, relative dims made absolute

Batches (`batches=(1, 2, 4)` at load): the same verbs over rows, for a server that serves several
robots with one replay: ``write_rows(bucket, [(c, seed), ...])`` (row i holds the i-th observation,
its prompt padded to the batch's bucket, its own noise), ``replay(bucket, batch_for(n))``,
``read_rows([c, ...])``. Each row's actions equal the observation's alone up to float rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt.errors import CheckpointError, ConfigError, InputError
from flashrt.frontends.pi0.checkpoint import Pi0Checkpoint, detect_layout, load_checkpoint, relative_offset
from flashrt.frontends.pi0.frontend import NUMERICS, Pi0Frontend, batch_buckets, default_buckets
from flashrt.frontends.pi0.observation import check_state, is_finite, split_observation
from flashrt.frontends.pi0.preprocess import CheckedImage, ImagePreprocessor
from flashrt.frontends.pi0.tokenizer import PaliGemmaTokenizer, PromptTokenizer
from flashrt.ops.decoder import decoder_prefer
from flashrt.quant.precision import QUANTIZED_PRECISIONS, compute_dtype, quantized_kind
from flashrt.runtime.device import resolve_device
from flashrt.runtime.frontend import PolicyFamily
from flashrt.runtime.rtc import Guidance, guidance_gains

__all__ = ["FAMILY", "Pi0PolicyFrontend", "Pi0Checked", "load", "detect"]


@dataclass(frozen=True)
class Pi0Checked:
    """One validated observation, ready to write: images, prompt token ids, normalized state, noise,
    raw state."""

    images: Mapping[str, CheckedImage]
    ids: tuple[int, ...]
    state_norm: torch.Tensor
    noise: torch.Tensor | None
    state: torch.Tensor
    guide: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # frozen, weights, gains


class Pi0PolicyFrontend:
    """A loaded Pi0 / Pi0.5 checkpoint behind the policy-frontend verbs (module docstring)."""

    def __init__(self, checkpoint: Pi0Checkpoint, frontend: Pi0Frontend, prompts: PromptTokenizer) -> None:
        self.checkpoint, self.frontend, self.prompts = checkpoint, frontend, prompts
        self.config = frontend.config
        self.images = ImagePreprocessor(checkpoint.cameras, checkpoint.resolution)
        self.device, self.buffers = frontend.device, frontend.buffers
        self.state_dim, self.action_dim = checkpoint.state_dim, checkpoint.action_dim
        self.chunk_size = self.config.chunk_size
        self.n_action_steps = checkpoint.n_action_steps
        self.quantization: dict[str, Any] | None = None  # what flashrt.quant.flow did (int8 / fp8 loads)

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.frontend.buckets

    @property
    def cameras(self) -> tuple[str, ...]:
        return self.images.cameras

    @property
    def batches(self) -> tuple[int, ...]:
        """The batch buckets captured (rows one replay serves); (1,) unless loaded with `batches`."""
        return self.frontend.batches

    @property
    def cannot_batch(self) -> str:
        """Why one replay serves one observation only ("" when it batches)."""
        return "" if self.batches[-1] > 1 else "loaded with batch bucket 1 only (load with batches=(1, 2, 4))"

    def batch_for(self, rows: int) -> int:
        return self.frontend.batch_for(rows)

    # ------------------------------------------------------------------------------ hot path
    supports_guidance = True  # real-time chunking inside the captured step (`flashrt.runtime.rtc`)

    def check(self, obs: Mapping[str, Any], noise: Any = None,
              guide: Guidance | None = None) -> tuple[int, Pi0Checked]:
        o = split_observation(obs, self.checkpoint.rename_map)
        images = self.images.check(o.images)
        state = check_state(o.state, self.state_dim)
        state_norm = self.checkpoint.state_norm.normalize(state)
        ids = self.prompts.ids(o.prompt, state_norm if self.config.variant == "pi05" else None)
        bucket = self.frontend.bucket_for(len(ids))
        checked_noise = self.frontend.check_noise(noise) if noise is not None else None
        self._check_static(ids, state_norm)
        checked_guide = self._check_guide(guide, state) if guide is not None else None
        return bucket, Pi0Checked(images, tuple(ids), state_norm, checked_noise, state, checked_guide)

    def _check_guide(self, guide: Guidance, state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Frozen actions (action space) -> the model's space (relative dims made relative again,
        normalized, zero-padded), the position weights and the per-step gains."""
        frozen = torch.from_numpy(guide.check(self.chunk_size, self.action_dim))
        if self.checkpoint.relative_mask is not None:
            frozen = frozen - relative_offset(self.checkpoint.relative_mask, state, self.action_dim)
        padded = torch.zeros(self.chunk_size, self.config.max_action_dim)
        padded[: frozen.shape[0], : self.action_dim] = self.checkpoint.action_norm.normalize(frozen)
        weights = torch.from_numpy(guide.weights(self.chunk_size))
        return padded, weights, guidance_gains(self.config.num_steps, guide.max_guidance)

    def _check_static(self, ids: list[int], state_norm: torch.Tensor) -> None:
        """The token ids within the vocabulary (plain Python: they are Python ints) and, where the state
        is an input of its own, the normalized state finite (statistics can overflow it)."""
        spec = self.buffers.spec("prefix_tokens")
        if ids and (min(ids) < spec.low or max(ids) > spec.high):
            raise InputError(f"prefix_tokens: token ids outside 0..{spec.high}")
        if self.config.has_state_token and not is_finite(state_norm):
            raise InputError("expert_state: contains NaN or inf")

    def write(self, bucket: int, checked: Pi0Checked, seed: int | None = None) -> None:
        """Images, then tokens, mask and state through the buffers' host staging (pinned on CUDA, one
        non_blocking upload; on the CPU the buffers themselves), noise, guidance. Allocates nothing
        after the first call of a frame layout."""
        self.write_rows(bucket, [(checked, seed)])

    def write_rows(self, bucket: int, rows: Sequence[tuple[Pi0Checked, int | None]]) -> None:
        """`write` of several observations, the i-th into batch row i (each its own images, prompt,
        state and noise; one upload for all). Guidance takes one observation per replay."""
        if len(rows) > 1 and any(checked.guide is not None for checked, _ in rows):
            raise ConfigError("real-time chunking guidance runs one observation per replay")
        bufs = self.buffers
        for row, (checked, _) in enumerate(rows):
            self.images.write(checked.images, bufs["vision_images"][row], bufs["vision_masks"][row], row)
        names = ["prefix_tokens", "prefix_token_masks"] + (["expert_state"] if self.config.has_state_token
                                                           else [])
        hosts = [bufs.host(name) for name in names]
        for row, (checked, _) in enumerate(rows):
            self._write_row(checked, *(h[row] for h in hosts))
        bufs.upload(*names)
        self.frontend.write_noise_rows([(checked.noise, seed) for checked, seed in rows])
        self.frontend.write_guidance(*(rows[0][0].guide or ()))

    def _write_row(self, checked: Pi0Checked, tokens: torch.Tensor, mask: torch.Tensor,
                   state: torch.Tensor | None = None) -> None:
        """One row's prompt ids, mask and state into its host staging rows."""
        tokens, mask, n = tokens.numpy(), mask.numpy(), len(checked.ids)
        tokens[:n], tokens[n:] = checked.ids, self.prompts.tokenizer.pad_id  # numpy views: no tensor made
        mask[:n], mask[n:] = True, False
        if state is not None:
            state[self.state_dim:].zero_()
            state[: self.state_dim].copy_(checked.state_norm)

    def replay(self, bucket: int, batch: int = 1) -> None:
        self.frontend.run(bucket, batch)

    def read(self, checked: Pi0Checked) -> np.ndarray:
        """Actions un-normalized (and made absolute) into a fresh array: the one tensor a call must
        allocate, since the caller keeps it."""
        return self.read_rows([checked])[0]

    def read_rows(self, rows: Sequence[Pi0Checked]) -> list[np.ndarray]:
        """`read` of batch rows 0..n-1 (one download for all)."""
        raw = self.frontend.actions_host()
        return [self._actions(raw[row, :, : self.action_dim], checked) for row, checked in enumerate(rows)]

    def _actions(self, raw: torch.Tensor, checked: Pi0Checked) -> np.ndarray:
        actions = self.checkpoint.action_norm.unnormalize(raw)
        if self.checkpoint.relative_mask is not None:
            actions = actions + relative_offset(self.checkpoint.relative_mask, checked.state, self.action_dim)
        if actions.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr():
            actions = actions.clone()  # IDENTITY statistics: still the buffer (or its twin)
        return actions.numpy().astype(np.float32, copy=False)

    # ------------------------------------------------------------------------------ reporting
    def describe(self) -> dict[str, Any]:
        model = self.frontend.model
        dtype = str(model.dtype).removeprefix("torch.")
        half = model.dtype in (torch.bfloat16, torch.float16)
        mixed = any(p.dtype == torch.float32 for p in model.parameters())
        fp32 = ("lerobot" if mixed else "none") if half else "all"
        return {"family": "pi0", **self.checkpoint.summary(), "device": str(self.device), "dtype": dtype,
                "buckets": list(self.buckets), "batches": list(self.batches),
                "cannot_batch": self.cannot_batch, "backend": self.frontend.graphs.report().get("backend"),
                "quantization": self.quantization, "kernels": model.vlm.rms_norm.form,
                "ops": model.op_choices, "fp32_modules": fp32,
                "numerics": self.frontend.numerics.describe(),
                "kernels_per_replay": self.frontend.kernels_per_replay().total}

    def report(self) -> dict[str, Any]:
        return self.frontend.report()

    def sibling(self, backend: str = "eager", cameras: Sequence[str] | None = None,
                frontend_cls: type[Pi0Frontend] = Pi0Frontend) -> Pi0PolicyFrontend:
        """A second frontend over the SAME weights, tokenizer and statistics: its own static buffers
        and graphs on `backend`, optionally for other cameras (the network is camera-count independent).
        For side-by-side benchmarks; the two must not run concurrently (they share the module)."""
        ck = self.checkpoint if cameras is None else replace(self.checkpoint, cameras=tuple(cameras))
        frontend = frontend_cls(self.frontend.model, len(ck.cameras), self.frontend.buckets, backend,
                                numerics=self.frontend.numerics)
        frontend.capture()
        sibling = Pi0PolicyFrontend(ck, frontend, self.prompts)
        sibling.quantization = self.quantization  # the same (possibly quantized) weights
        return sibling


# ---------------------------------------------------------------------------------- loading
def _check_sizes(ck: Pi0Checkpoint, tokenizer: PaliGemmaTokenizer) -> None:
    c = ck.model_config
    if ck.action_dim > c.max_action_dim or (c.has_state_token and ck.state_dim > c.max_state_dim):
        raise CheckpointError(f"state/action sizes {ck.state_dim}/{ck.action_dim} exceed the model's "
                              f"{c.max_state_dim}/{c.max_action_dim}")
    if tokenizer.vocab_size > c.vlm.vocab_size:
        raise CheckpointError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} pieces but the model "
                              f"embeds only {c.vlm.vocab_size} tokens: wrong tokenizer?")


def load(path: str | Path, device: str | torch.device = "cpu", precision: str | torch.dtype = "float32",
         num_steps: int | None = None, backend: str | None = None, buckets: Sequence[int] | None = None,
         tokenizer: str | Path | None = None, asset_id: str | None = None,
         calibration: Any = None, kernels: str = "auto", fp32_modules: str = "lerobot",
         tf32: bool = False, batches: Sequence[int] | None = None) -> Pi0PolicyFrontend:
    """Load a Pi0 / Pi0.5 checkpoint dir (lerobot 0.6.1 or openpi PyTorch) and capture its graphs.

    ``kernels`` (the "decoder" ops of `flashrt.ops.decoder`): "auto" runs the fused csrc kernels
    (RMSNorm + residual, RoPE into the K/V slots, GeGLU product: one kernel each) on a CUDA device where
    they load (built on first use where a CUDA toolkit is), the ATen references elsewhere; "aten" /
    "fused" force one. Same numbers either way up to float rounding (the CPU runs the references: bit
    for bit).

    ``fp32_modules`` (a half ``precision``, "bfloat16" / "float16"): "lerobot" (default) keeps what
    lerobot 0.6.1's bf16 mode keeps in float32 (SigLIP tower, projector, every (ada)RMSNorm, the action /
    state / time heads; `weights.FP32_PREFIXES`); "none" runs every module in the half dtype.

    ``tf32`` (CUDA): let float32 GEMMs and convolutions run in TF32; off by default, so "float32" is IEEE
    float32. Scoped to the step with the family's pinned SDPA backends (`flashrt.runtime.numerics`).

    ``batches``: the batch buckets captured (default (1,): one observation per replay); e.g. (1, 2, 4)
    for a server that runs several robots' observations as one replay (`Policy.infer_batch`).

    ``precision="int8"`` / ``"fp8"``: the recipe's GEMMs quantized with scales from the calibration
    cache, calibrated and gated on a miss (``calibration``: a recipe name, path, dict or
    `flashrt.quant.flow.Calibration`; `flashrt.frontends.pi0.quantize`)."""
    from flashrt.frontends.pi0.weights import load_pi0

    dev = resolve_device(device)
    batches = batch_buckets(batches)
    dtype = compute_dtype(precision, quantized=QUANTIZED)
    decoder_prefer(kernels)  # an unknown choice fails before anything loads
    numerics = replace(NUMERICS, tf32=tf32)
    if fp32_modules not in FP32_MODULES:
        raise ConfigError(f"fp32_modules={fp32_modules!r}; choose one of {FP32_MODULES}")
    keep_fp32 = fp32_modules == "lerobot" and dtype in (torch.bfloat16, torch.float16)
    kind = quantized_kind(precision)
    if kind is None and calibration is not None:
        raise ConfigError(f"calibration= applies to precision 'int8' or 'fp8', not {precision!r}")
    ck = load_checkpoint(path, tokenizer=tokenizer, asset_id=asset_id)
    if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int)
                                  or num_steps <= 0):
        raise ConfigError(f"num_steps must be a positive int, got {num_steps!r}")
    config = ck.model_config if num_steps is None else ck.model_config.replace(num_steps=num_steps)
    tok = PaliGemmaTokenizer(ck.tokenizer_path)
    _check_sizes(ck, tok)
    model = load_pi0(config, ck.weights, device=dev, dtype=dtype, keep_fp32=keep_fp32, kernels=kernels)
    sizes = tuple(buckets) if buckets else default_buckets(ck.max_prompt_len)
    quantization = None
    if kind is not None:
        from flashrt.frontends.pi0.quantize import calibration_frontend, quantize

        calib = calibration_frontend(model, len(ck.cameras), sizes)
        eager = Pi0PolicyFrontend(ck, calib, PromptTokenizer(tok, ck.prompt_format, calib.max_len))
        quantization = quantize(eager, kind, calibration, path)
    frontend = Pi0Frontend(model, len(ck.cameras), sizes, backend, numerics=numerics, batches=batches)
    frontend.capture()
    policy = Pi0PolicyFrontend(ck, frontend, PromptTokenizer(tok, ck.prompt_format, frontend.max_len))
    policy.quantization = quantization
    return policy


QUANTIZED = QUANTIZED_PRECISIONS
FP32_MODULES = ("lerobot", "none")  # `fp32_modules` of a half-precision load


def detect(path: Path) -> None:
    """None for a lerobot 0.6.1 pi0/pi05 policy dir or an openpi PyTorch dir; CheckpointError saying
    why not otherwise."""
    detect_layout(path)


FAMILY = PolicyFamily(
    name="pi0", detect=detect, load=load,
    options=("tokenizer", "asset_id", "calibration", "kernels", "fp32_modules", "tf32", "batches"),
    doc="Pi0 / Pi0.5 (lerobot 0.6.1 policy dirs, openpi PyTorch dirs): PaliGemma + flow-matching expert")
