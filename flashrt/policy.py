"""Robot policies behind one runner: `load_policy(path)` -> `Policy` with `infer`, `step`, `reset`.

    policy = load_policy("path/to/pi05_checkpoint", device="cuda", tokenizer="tokenizer.model")
    out = policy.infer({"images": {"top": rgb_uint8}, "state": joints, "prompt": "pick up the cube"})
    out["actions"]   # (chunk_size, action_dim) float32, un-normalized with the checkpoint's statistics
    out["timing"]    # {"preprocess_ms", "replay_ms", "postprocess_ms", "total_ms"}

    policy.reset()                     # new episode
    action = policy.step(obs)          # one action per control tick; replans every n_action_steps

Observations come in either spelling:

* openpi style  ``{"images": {camera: image}, "state": array, "prompt": str}``; a camera is named by the
  suffix of its lerobot key (``top`` for ``observation.images.top``);
* lerobot style ``{"observation.images.<camera>": image, "observation.state": array, "task": str}``.

Images: H x W x 3 uint8 or float (3 x H x W or H x W x 3) in [0, 1], any size (resized with padding as
the reference does). A camera left out is masked. The state has the checkpoint's own size; the actions
come back with the checkpoint's own action size. Every check runs before any static buffer is written,
so a bad call (InputError) leaves the policy ready for the next good one.

Families are found through `POLICY_FAMILIES` (detect -> load); Pi0 / Pi0.5 (lerobot 0.6.1 and openpi
PyTorch layouts) is the one registered here.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt.errors import CheckpointError, ConfigError, InputError
from flashrt.frontends.pi0.checkpoint import Pi0Checkpoint, detect_layout, load_checkpoint, relative_offset
from flashrt.frontends.pi0.frontend import Pi0Frontend, default_buckets
from flashrt.frontends.pi0.preprocess import CAMERA_PREFIX, ImagePreprocessor, camera_key, camera_name
from flashrt.frontends.pi0.tokenizer import PaliGemmaTokenizer, PromptTokenizer
from flashrt.profile import StageTimer
from flashrt.runtime.device import resolve_device

PRECISIONS: dict[str, torch.dtype] = {"float32": torch.float32, "fp32": torch.float32,
                                      "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                                      "float16": torch.float16, "fp16": torch.float16}
_FLOAT_KINDS = "f"


@dataclass(frozen=True)
class Observation:
    """One observation in canonical form: camera name -> image, raw state, prompt."""

    images: dict[str, Any]
    state: Any
    prompt: Any


def _rename(key: str, rename_map: Mapping[str, str]) -> str:
    return rename_map.get(key, key)


def split_observation(obs: Mapping[str, Any], rename_map: Mapping[str, str] | None = None) -> Observation:
    """Read an openpi- or lerobot-style observation (see module docstring); keys it does not know are
    ignored. `rename_map` is the checkpoint's lerobot key renaming, applied to lerobot keys."""
    if not isinstance(obs, Mapping):
        raise InputError(f"an observation is a dict, got {type(obs).__name__}")
    renames = rename_map or {}
    obs = {_rename(str(k), renames): v for k, v in obs.items()}
    images = {camera_name(k): v for k, v in obs.items() if k.startswith(CAMERA_PREFIX)}
    nested = obs.get("images", {})
    if not isinstance(nested, Mapping):
        raise InputError(f"obs['images'] must map camera names to images, got {type(nested).__name__}")
    for name, image in nested.items():
        name = camera_name(_rename(camera_key(str(name)), renames))
        if name in images:
            raise InputError(f"camera {name!r} given twice (in 'images' and as a lerobot key)")
        images[name] = image
    return Observation(images, _pick(obs, ("state", "observation.state")), _pick(obs, ("prompt", "task")))


def _pick(obs: Mapping[str, Any], keys: Sequence[str]) -> Any:
    found = [k for k in keys if obs.get(k) is not None]
    if len(found) > 1:
        raise InputError(f"observation gives both {found[0]!r} and {found[1]!r}; give one")
    if not found:
        raise InputError(f"observation has no {' / '.join(repr(k) for k in keys)}")
    return obs[found[0]]


def check_state(value: Any, dim: int) -> torch.Tensor:
    """(dim,) float32 host tensor from a float array of shape (dim,) or (1, dim); finite."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu")
    else:
        arr = np.asarray(value)
        if arr.dtype.kind not in _FLOAT_KINDS:
            raise InputError(f"state: expected a float array, got dtype {arr.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(arr))
    if not t.is_floating_point():
        raise InputError(f"state: expected a float array, got dtype {t.dtype}")
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if tuple(t.shape) != (dim,):
        raise InputError(f"state: expected shape ({dim},) (the checkpoint's state size), got "
                         f"{tuple(t.shape)}")
    t = t.to(torch.float32)
    if not bool(torch.isfinite(t).all()):
        raise InputError("state: contains NaN or inf")
    return t


class Policy:
    """A loaded policy: validated observation -> static buffers -> replay -> un-normalized actions.

    Owns its frontend (buffers, graphs), tokenizer and normalizers; `step` keeps an action queue that
    `reset` clears. Not thread-safe: one call at a time.
    """

    def __init__(self, checkpoint: Pi0Checkpoint, frontend: Pi0Frontend, prompts: PromptTokenizer,
                 n_action_steps: int | None = None) -> None:
        self.checkpoint, self.frontend, self.prompts = checkpoint, frontend, prompts
        self.config = frontend.config
        self.images = ImagePreprocessor(checkpoint.cameras, checkpoint.resolution)
        self.state_dim, self.action_dim = checkpoint.state_dim, checkpoint.action_dim
        self.n_action_steps = int(n_action_steps or checkpoint.n_action_steps)
        if not 0 < self.n_action_steps <= self.config.chunk_size:
            raise ConfigError(f"n_action_steps {self.n_action_steps} must be in 1..{self.config.chunk_size}")
        self._queue: deque[np.ndarray] = deque()
        self.last_timing: dict[str, float] = {}

    @property
    def cameras(self) -> tuple[str, ...]:
        return self.images.cameras

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    # ------------------------------------------------------------------------------ hot path
    def _prepare(self, obs: Mapping[str, Any], noise: Any) -> tuple[dict[str, Any], torch.Tensor, int]:
        """Validate everything; touch no buffer. Returns (checked inputs, raw state, prompt bucket)."""
        o = split_observation(obs, self.checkpoint.rename_map)
        images = self.images.check(o.images)
        state = check_state(o.state, self.state_dim)
        state_norm = self.checkpoint.state_norm.normalize(state)
        ids = self.prompts.ids(o.prompt, state_norm if self.config.variant == "pi05" else None)
        bucket = self.frontend.bucket_for(len(ids))
        checked_noise = self.frontend.check_noise(noise) if noise is not None else None
        inputs = self.frontend.buffers.validate(self._static_inputs(ids, state_norm), partial=True)
        return {"images": images, "inputs": inputs, "noise": checked_noise}, state, bucket

    def _static_inputs(self, ids: list[int], state_norm: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens, mask = self.prompts.padded(ids, self.frontend.max_len)
        inputs = {"prefix_tokens": tokens[None], "prefix_token_masks": mask[None]}
        if self.config.has_state_token:
            padded = torch.zeros(1, self.config.max_state_dim)
            padded[0, : self.state_dim] = state_norm
            inputs["expert_state"] = padded
        return inputs

    def _write(self, checked: dict[str, Any], seed: int | None) -> None:
        bufs = self.frontend.buffers
        self.images.write(checked["images"], bufs["vision_images"][0], bufs["vision_masks"][0])
        bufs.write(checked["inputs"])
        self.frontend.write_noise(checked["noise"], seed)

    def _finish(self, state: torch.Tensor) -> np.ndarray:
        actions = self.checkpoint.action_norm.unnormalize(self.frontend.actions()[:, : self.action_dim])
        if self.checkpoint.relative_mask is not None:
            actions = actions + relative_offset(self.checkpoint.relative_mask, state, self.action_dim)
        return actions.numpy().astype(np.float32, copy=False)

    def infer(self, obs: Mapping[str, Any], noise: Any = None, seed: int | None = None,
              timer: StageTimer | None = None) -> dict[str, Any]:
        """One observation -> a whole chunk: {"actions": (chunk_size, action_dim) float32, "timing",
        "bucket"}. `noise` (chunk_size, max_action_dim) or `seed` fix the flow-matching noise.

        `timer` (a `flashrt.profile.StageTimer`, optional) receives the stages of this call: "validate"
        (observation checks, normalization, tokens; nothing written), "h2d" (static buffers written),
        "replay" (the captured step) and "postprocess" (actions to the host, un-normalized)."""
        start = time.perf_counter()
        timer = timer if timer is not None else StageTimer(self.frontend.device, nvtx=False)
        first = len(timer)
        with timer.stage("validate"):
            checked, state, bucket = self._prepare(obs, noise)
        with timer.stage("h2d"):
            self._write(checked, seed)
        with timer.stage("replay"):
            self.frontend.run(bucket)
        with timer.stage("postprocess"):
            actions = self._finish(state)
        ms = {r.stage: r.ms for r in timer.records(first)}
        timing = {"preprocess_ms": ms["validate"] + ms["h2d"], "replay_ms": ms["replay"],
                  "postprocess_ms": ms["postprocess"], "total_ms": (time.perf_counter() - start) * 1e3}
        self.last_timing = timing
        return {"actions": actions, "timing": timing, "bucket": bucket}

    def step(self, obs: Mapping[str, Any], noise: Any = None, seed: int | None = None) -> np.ndarray:
        """One action (action_dim,) per control tick; a new chunk is inferred every n_action_steps."""
        if not self._queue:
            chunk = self.infer(obs, noise=noise, seed=seed)["actions"]
            self._queue.extend(chunk[: self.n_action_steps])
        return self._queue.popleft()

    def reset(self) -> None:
        """Start a new episode: forget the queued actions."""
        self._queue.clear()

    @property
    def queued(self) -> int:
        """Actions left before the next replan."""
        return len(self._queue)

    def info(self) -> dict[str, Any]:
        dtype = str(self.frontend.model.dtype).removeprefix("torch.")
        return {**self.checkpoint.summary(), "n_action_steps": self.n_action_steps,
                "device": str(self.frontend.device), "dtype": dtype, "graphs": self.frontend.report()}


# ---------------------------------------------------------------------------------- loading
def _dtype(precision: str | torch.dtype) -> torch.dtype:
    if isinstance(precision, torch.dtype):
        return precision
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} is not supported for policies; "
                          f"use one of {sorted(PRECISIONS)}")
    return PRECISIONS[precision]


def _check_sizes(ck: Pi0Checkpoint, tokenizer: PaliGemmaTokenizer) -> None:
    c = ck.model_config
    if ck.action_dim > c.max_action_dim or (c.has_state_token and ck.state_dim > c.max_state_dim):
        raise CheckpointError(f"state/action sizes {ck.state_dim}/{ck.action_dim} exceed the model's "
                              f"{c.max_state_dim}/{c.max_action_dim}")
    if tokenizer.vocab_size > c.vlm.vocab_size:
        raise CheckpointError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} pieces but the model "
                              f"embeds only {c.vlm.vocab_size} tokens: wrong tokenizer?")


def load_pi0_policy(path: str | Path, device: str | torch.device = "cpu",
                    precision: str | torch.dtype = "float32", num_steps: int | None = None,
                    tokenizer: str | Path | None = None, backend: str | None = None,
                    buckets: Sequence[int] | None = None, n_action_steps: int | None = None,
                    asset_id: str | None = None) -> Policy:
    """Load a Pi0 / Pi0.5 checkpoint dir (lerobot 0.6.1 or openpi PyTorch) and capture its graphs."""
    from flashrt.frontends.pi0.weights import load_pi0

    dev = resolve_device(device)
    ck = load_checkpoint(path, tokenizer=tokenizer, asset_id=asset_id)
    config = ck.model_config if num_steps is None else ck.model_config.replace(num_steps=int(num_steps))
    tok = PaliGemmaTokenizer(ck.tokenizer_path)
    _check_sizes(ck, tok)
    model = load_pi0(config, ck.weights, device=dev, dtype=_dtype(precision))
    sizes = tuple(buckets) if buckets else default_buckets(ck.max_prompt_len)
    backend = backend or ("cuda" if dev.type == "cuda" else "eager")
    frontend = Pi0Frontend(model, len(ck.cameras), sizes, backend)
    frontend.capture()
    prompts = PromptTokenizer(tok, ck.prompt_format, frontend.max_len)
    return Policy(ck, frontend, prompts, n_action_steps)


def _is_pi0(path: Path) -> bool:
    try:
        detect_layout(path)
    except CheckpointError:
        return False
    return True


POLICY_FAMILIES: dict[str, tuple[Callable[[Path], bool], Callable[..., Policy]]] = {
    "pi0": (_is_pi0, load_pi0_policy),
}


def load_policy(path: str | Path, device: str | torch.device = "cpu",
                precision: str | torch.dtype = "float32", num_steps: int | None = None,
                tokenizer: str | Path | None = None, backend: str | None = None,
                buckets: Sequence[int] | None = None, **options: Any) -> Policy:
    """Load a policy checkpoint directory (the family is detected) and capture its graphs.

    device     "cpu", "cuda", "cuda:N" or "auto"
    precision  "float32" (default), "bfloat16", "float16" (or a torch.dtype)
    num_steps  denoising steps (default: the checkpoint's)
    tokenizer  path of PaliGemma's tokenizer.model (or a dir holding it); default: the checkpoint dir
    backend    graph backend "eager" | "trace" | "cuda" (default: cuda on a GPU, eager on the CPU)
    buckets    prompt-length buckets (default: 16, 32, ... up to the checkpoint's prompt limit)
    options    n_action_steps (replan period of `step`), asset_id (openpi dirs with several assets)
    """
    folder = Path(path)
    for detect, load in POLICY_FAMILIES.values():
        if detect(folder):
            return load(folder, device=device, precision=precision, num_steps=num_steps, tokenizer=tokenizer,
                        backend=backend, buckets=buckets, **options)
    detect_layout(folder)  # raises the Pi0 loader's explanation of what it expected
    raise CheckpointError(f"{folder}: no registered policy family recognises it ({sorted(POLICY_FAMILIES)})")
