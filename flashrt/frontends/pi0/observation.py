"""Pi0 / Pi0.5 observations: the two spellings users send, read into one canonical form.

* openpi style  ``{"images": {camera: image}, "state": array, "prompt": str}``; a camera is named by the
  suffix of its lerobot key (``top`` for ``observation.images.top``);
* lerobot style ``{"observation.images.<camera>": image, "observation.state": array, "task": str}``.

Keys neither spelling knows are ignored (robots send more than the policy reads). The checkpoint's
lerobot ``rename_map`` is applied to lerobot keys first, as lerobot's own preprocessor does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashrt.errors import InputError
from flashrt.frontends.pi0.preprocess import CAMERA_PREFIX, camera_key, camera_name

__all__ = ["Observation", "split_observation", "check_state", "is_finite"]


@dataclass(frozen=True)
class Observation:
    """One observation in canonical form: camera name -> image, raw state, prompt."""

    images: dict[str, Any]
    state: Any
    prompt: Any


def _rename(key: str, rename_map: Mapping[str, str]) -> str:
    return rename_map.get(key, key)


def split_observation(obs: Any, rename_map: Mapping[str, str] | None = None) -> Observation:
    """Read an openpi- or lerobot-style observation (module docstring)."""
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
        if arr.dtype.kind != "f":
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
    if not is_finite(t):
        raise InputError("state: contains NaN or inf")
    return t


def is_finite(t: torch.Tensor) -> bool:
    """Every value finite, from one reduction (aminmax: NaN propagates, an inf is an end; two scalars
    allocated where ``isfinite(t).all()`` makes a mask and four more); True for an empty tensor."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())
