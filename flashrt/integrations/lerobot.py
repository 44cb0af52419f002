"""A lerobot drop-in: `FlashRTPolicy`, with lerobot 0.6.1's policy interface over a flashrt policy.

In a lerobot script the policy and its processors come from one checkpoint folder; swap them:

    # policy = make_policy(cfg.policy, ds_meta=...)                       (lerobot)
    # preprocessor, postprocessor = make_pre_post_processors(cfg.policy, pretrained_path=...)
    from flashrt.integrations.lerobot import FlashRTPolicy
    policy = FlashRTPolicy.from_pretrained("path/to/pi05_policy_dir", device="cuda")
    preprocessor, postprocessor = policy.make_pre_post_processors()

and lerobot's loops (`predict_action`, record, eval) run unchanged: `select_action(batch)` returns
(B, action_dim) actions, `predict_action_chunk(batch)` (B, chunk_size, action_dim), `reset()` clears
the queue, `config` has the fields those loops read (type, device, chunk_size, n_action_steps,
input_features, output_features, use_amp, rtc_config).

The flashrt policy reads the checkpoint's own processor files (normalization, tokenization, image
size, relative actions) and does that work inside its captured step, so the processors this class
hands back pass data through unchanged: `batch` is what lerobot's `prepare_observation_for_inference`
builds (images float (B, 3, H, W) in [0, 1], `observation.state` (B, S), `task` str or list of str),
and the actions come back un-normalized. Batch rows run one after another (flashrt serves batch 1).

`select_action` keeps lerobot's queue semantics exactly: when the queue is empty, infer a chunk, queue
its first n_action_steps actions (per batch row), pop one per call. lerobot is not a dependency: this
module imports neither lerobot nor its config classes.

The lerobot plugin (``packages/lerobot_policy_flashrt``: ``--policy.type=flashrt`` in lerobot's own
scripts) wraps this class; `plugin_options` / `plugin_load` turn its config into a loaded drop-in.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt.errors import ConfigError, InputError
from flashrt.io.files import read_json

__all__ = ["FlashRTPolicy", "DropInConfig", "plugin_options", "plugin_load", "INFERENCE_ONLY"]

INFERENCE_ONLY = ("the flashrt policy type serves a trained checkpoint (inference only); train with "
                  "lerobot's own policy of that family")


@dataclass(frozen=True)
class DropInConfig:
    """The fields of a lerobot `PreTrainedConfig` that lerobot's loops read."""

    type: str
    device: str
    chunk_size: int
    n_action_steps: int
    input_features: Mapping[str, Any] = field(default_factory=dict)
    output_features: Mapping[str, Any] = field(default_factory=dict)
    use_amp: bool = False
    rtc_config: Any = None


def _identity(x: Any) -> Any:
    return x


def _row(value: Any, i: int, batch: int) -> Any:
    """Row i of a batched tensor / array / list (a str task is shared by every row)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple):
        return value[i] if len(value) == batch else value[0]
    if isinstance(value, torch.Tensor):
        return value[i].detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return value[i]
    return value


class FlashRTPolicy:
    """lerobot's policy verbs over a loaded flashrt `Policy` (module docstring)."""

    name = "flashrt"

    def __init__(self, policy: Any, config: DropInConfig) -> None:
        self.policy, self.config = policy, config
        self._queue: deque[torch.Tensor] = deque()

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", **load_options: Any) -> FlashRTPolicy:
        """Load the lerobot policy folder `path` with `flashrt.load_policy(path, device, **options)`."""
        from flashrt.runner.policy import load_policy

        policy = load_policy(path, device=device, **load_options)
        return cls(policy, _config(Path(path), policy, device))

    def make_pre_post_processors(self) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
        """Pass-through processors for lerobot's loops: flashrt normalizes inside the policy."""
        return _identity, _identity

    # ------------------------------------------------------------------------------ lerobot verbs
    def reset(self) -> None:
        self._queue.clear()
        self.policy.reset()

    def eval(self) -> FlashRTPolicy:
        return self

    @torch.no_grad()
    def predict_action_chunk(self, batch: Mapping[str, Any], noise: Any = None, **_: Any) -> torch.Tensor:
        """(B, chunk_size, action_dim) float32 un-normalized actions; `noise` (B, chunk, max_action_dim)
        or (chunk, max_action_dim) fixes the randomness like lerobot's `noise=`."""
        size = _batch_size(batch)
        rows = []
        for i in range(size):
            obs = {k: _row(v, i, size) for k, v in batch.items() if k != "robot_type"}
            n = None if noise is None else _row(noise, i, size) if np.ndim(noise) == 3 else noise
            rows.append(torch.from_numpy(self.policy.infer(obs, noise=n)["actions"]))
        return torch.stack(rows).to(self.config.device)

    @torch.no_grad()
    def select_action(self, batch: Mapping[str, Any], noise: Any = None) -> torch.Tensor:
        """(B, action_dim): lerobot's queue — a new chunk when the queue is empty, n_action_steps of it
        queued, one popped per call."""
        if not self._queue:
            actions = self.predict_action_chunk(batch, noise=noise)[:, : self.config.n_action_steps]
            self._queue.extend(actions.transpose(0, 1))
        return self._queue.popleft()


def _batch_size(batch: Mapping[str, Any]) -> int:
    state = batch.get("observation.state")
    if not isinstance(state, torch.Tensor | np.ndarray) or state.ndim != 2:
        raise InputError("observation.state: expected a batched (B, state_dim) tensor, as lerobot's "
                         "prepare_observation_for_inference builds it")
    return int(state.shape[0])


def _config(folder: Path, policy: Any, device: str) -> DropInConfig:
    """The loops' view of the folder's config.json (type, features) and the loaded policy's sizes."""
    path = folder / "config.json"
    raw = read_json(path, "lerobot policy config") if path.is_file() else {}
    features = lambda key: json.loads(json.dumps(raw[key])) if isinstance(raw.get(key), dict) else {}
    return DropInConfig(type=str(raw.get("type", policy.frontend.describe().get("family", "flashrt"))),
                        device=str(policy.frontend.device) if device == "auto" else device,
                        chunk_size=policy.chunk_size, n_action_steps=policy.n_action_steps,
                        input_features=features("input_features"),
                        output_features=features("output_features"))


def plugin_options(config: Any) -> tuple[Path, dict[str, Any]]:
    """(checkpoint folder, `load_policy` options) of the lerobot plugin's ``FlashRTConfig`` (any object
    with its fields: checkpoint, device, precision, tokenizer, embodiment, pretrained_path). A relative
    checkpoint is taken from the folder of the config that names it (``--policy.path``), else from the
    working directory; a hub id comes from the local cache."""
    from flashrt.io.hub import resolve_checkpoint
    from flashrt.runner.policy import cli_options

    checkpoint = str(getattr(config, "checkpoint", "") or "")
    if not checkpoint:
        raise ConfigError("--policy.checkpoint: name the flashrt policy folder (or hub id) to serve")
    base = getattr(config, "pretrained_path", None)
    if base is not None and not Path(checkpoint).is_absolute() and (Path(base) / checkpoint).exists():
        checkpoint = str(Path(base) / checkpoint)
    options = {"device": str(config.device or "cpu"), "precision": str(config.precision),
               **cli_options(config.tokenizer, config.embodiment)}
    return resolve_checkpoint(checkpoint), options


def plugin_load(config: Any) -> FlashRTPolicy:
    """The drop-in the lerobot plugin's policy serves (`plugin_options`)."""
    folder, options = plugin_options(config)
    return FlashRTPolicy.from_pretrained(folder, **options)
