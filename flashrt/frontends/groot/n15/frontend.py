"""GR00T N1.5 frontend: lerobot 0.5.1's groot policy folder, its preprocessing, the captured step.

The folder flashrt loads is what lerobot 0.5.1 writes for a fine-tuned N1.5 policy: ``config.json``
(``GrootConfig``, type "groot": input/output features, ``max_state_dim`` / ``max_action_dim``,
``n_action_steps``, ``embodiment_tag``, ``base_model_path``), ``model.safetensors`` (``_groot_model.``
keys) and the processor pipelines ``policy_preprocessor.json`` / ``policy_postprocessor.json`` with their
statistics files. ``base_model_path`` (absolute or relative to the policy folder) names the GR00T N1.5
folder (``config.json`` of model_type ``gr00t_n1_5``). The Eagle processor assets (lerobot's
``$HF_LEROBOT_HOME/lerobot/eagle2hg-processor-groot-n1p5``: the Eagle config.json, vocab.json +
merges.txt + tokenizer_config.json, chat_template.json, preprocessor_config.json, processor_config.json)
come from ``tokenizer=PATH``, else ``<base>/backbone/``, else that lerobot cache.

What lerobot 0.5.1's pipeline (``processor_groot.py``, then ``GrootPolicy.predict_action_chunk`` and the
postprocessor) does with one observation, and how it is done here (tests/frontends/groot/n15/test_frontend.py
checks every step against it):

* Cameras: the policy's ``observation.images.*`` features in sorted key order. A float frame in [0, 1] is
  truncated to uint8 (``(x.clamp(0, 1) * 255).to(uint8)``); uint8 frames are taken as they are.
* Image (the Eagle 2.5 fast image processor with one tile, no thumbnail): torchvision's bicubic
  antialiased resize of the uint8 image to the tile (``crop_size`` height, else ``size``) — torch's native
  uint8 kernel, skipped when the size matches — then to ``size``, then ``(x - 255 mean) / (255 std)`` in
  float32. Every camera ends at the SigLIP input size, so the token layout never depends on the frames.
* Prompt: ``task`` (or ``prompt``), "Perform the task." when empty, written as ``str([task])`` (a Python
  list literal) after the images: the checkpoint's own chat template rendered (jinja2, as transformers
  renders it) for one user turn of I images + that text with the generation prompt, each ``<image-k>``
  placeholder expanded to ``<image k><img>`` + tokens_per_tile x ``<IMG_CONTEXT>`` + ``</img>``, tokenized
  as one string with the checkpoint's Qwen BPE (vocab.json + merges.txt). The images precede the prompt,
  so their token slots are fixed at load.
* State: ``2 (x - min) / (max - min) - 1`` in float32 with the preprocessor's ``observation.state``
  min/max (0 where max == min; no clipping; the identity without statistics), zero-padded to
  max_state_dim.
* Actions: the model's chunk (horizon x max_action_dim) sliced to the policy's action size, each step
  un-normalized by the postprocessor's rule ``(y + 1) / 2 (max - min) + min`` (min where max == min).
* Embodiment: the preprocessor's ``embodiment_tag`` by default; ``embodiment=`` a tag of its
  ``embodiment_mapping`` or an id below max_num_embodiments (lerobot maps an unknown tag to 0 silently;
  here it is a ConfigError naming the tags).

Differences kept on purpose: lerobot stacks the cameras (they must share one size; here each is resized
on its own), and its postprocessor on a whole chunk keeps only the last step (here every step is
un-normalized); ``step()`` executes the first ``n_action_steps`` actions of a chunk (lerobot's
``deque(maxlen=n_action_steps).extend`` keeps the last ones when n_action_steps < horizon).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt.errors import CheckpointError, ConfigError, InputError
from flashrt.frontends.groot.common.checkpoint import read_json
from flashrt.frontends.groot.common.frontend import (
    Checked,
    GrootFrontend,
    LoadOptions,
    bucket_set,
    finish,
    load_model,
    read_prompt,
    read_state,
    round_buckets,
)
from flashrt.frontends.groot.common.preprocess import DEFAULT_PROMPT, MinMax, _resize
from flashrt.frontends.groot.n15.model import N15_MODEL_TYPE, GrootN15Model, load_n15, n15_config
from flashrt.frontends.groot.n16.frontend import MEDIA_PLACEHOLDER, eagle_normalize, eagle_tokenizer
from flashrt.io.files import CONFIG_LIMIT, read_bytes_capped, resolve_inside
from flashrt.runtime.graphs import backend_for_device

ASSETS_REPO = "lerobot/eagle2hg-processor-groot-n1p5"  # GrootConfig.tokenizer_assets_repo's default
PACK_STEP, UNPACK_STEP = "groot_pack_inputs_v3", "groot_action_unpack_unnormalize_v1"
EMBODIMENT_MAPPING = {  # GrootPackInputsStep's default (Isaac-GR00T's EMBODIMENT_TAG_MAPPING subset)
    "new_embodiment": 31,
    "oxe_droid": 17,
    "agibot_genie1": 26,
    "gr1": 24,
    "so100": 2,
    "unitree_g1": 3,
}
PROMPT_KEYS = ("task", "prompt")
SENTINEL = "\x00flashrt-prompt\x00"


# ------------------------------------------------------------------------------------ folder
@dataclass(frozen=True)
class PolicyFolder:
    """A lerobot 0.5.1 groot policy folder and the N1.5 folder its base_model_path names."""

    folder: Path
    base: Path
    config: dict[str, Any]


def n15_layout(folder: Path) -> PolicyFolder | None:
    """The N1.5 `PolicyFolder` of ``folder``; None when it is no N1.5 checkpoint; CheckpointError for a
    bare N1.5 folder or a policy whose base_model_path is not local."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        return None
    cfg = read_json(cfg_path)
    if cfg.get("model_type") == N15_MODEL_TYPE:
        raise CheckpointError(
            f"{folder}: a bare GR00T N1.5 model folder; load the lerobot 0.5.1 groot policy folder "
            "(GrootPolicy.save_pretrained + its policy_preprocessor/postprocessor) whose base_model_path "
            "names it: the features, statistics and embodiment are there"
        )
    if cfg.get("type") != "groot" or not cfg.get("base_model_path"):
        return None
    base = Path(str(cfg["base_model_path"]))
    base = base if base.is_absolute() else folder / base
    if not (base / "config.json").is_file():
        return None  # N1.7's layout() words the error
    if read_json(base / "config.json").get("model_type") != N15_MODEL_TYPE:
        return None
    if not (folder / "model.safetensors").is_file():
        raise CheckpointError(f"{folder}: no model.safetensors (the fine-tuned policy weights)")
    return PolicyFolder(folder, base, cfg)


def _lerobot_cache(repo: str) -> Path:
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return Path(os.environ.get("HF_LEROBOT_HOME", hf_home / "lerobot")) / repo


def assets_dir(where: PolicyFolder, tokenizer: str | Path | None) -> Path:
    if tokenizer is not None:
        path = Path(tokenizer)
        path = path.parent if path.is_file() else path
        candidates = [path]
    else:
        repo = str(where.config.get("tokenizer_assets_repo") or ASSETS_REPO)
        candidates = [where.base / "backbone", where.folder / "backbone", _lerobot_cache(repo)]
    for path in candidates:
        if (path / "config.json").is_file() and (path / "vocab.json").is_file():
            return path
    raise CheckpointError(
        f"{where.folder}: no Eagle processor folder (config.json + vocab.json + merges.txt + "
        f"tokenizer_config.json + chat_template.json + preprocessor/processor_config.json) in "
        f"{[str(c) for c in candidates]}; pass tokenizer=PATH (lerobot keeps it in "
        f"$HF_LEROBOT_HOME/{ASSETS_REPO})"
    )


def _pipeline_step(folder: Path, pipeline: str, name: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The config and state tensors of step ``name`` of lerobot's saved ``pipeline``."""
    path = folder / f"{pipeline}.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {pipeline}.json (lerobot's saved processor pipeline)")
    steps = [s for s in read_json(path).get("steps", []) if s.get("registry_name") == name]
    if len(steps) != 1:
        raise CheckpointError(f"{path}: expected one {name!r} step (lerobot 0.5.1's groot pipeline)")
    state: dict[str, np.ndarray] = {}
    if steps[0].get("state_file"):
        state = _read_state(folder, steps[0]["state_file"], f"{path}: {name} state_file")
    return dict(steps[0].get("config") or {}), state


def _read_state(folder: Path, name: Any, field: str) -> dict[str, np.ndarray]:
    """The statistics a pipeline step names: a file inside ``folder`` (`resolve_inside`), read as a
    regular file (never a FIFO or a device); a corrupt one is a CheckpointError naming it."""
    from safetensors.numpy import load as load_bytes

    state_path = resolve_inside(folder, name, field)
    if not os.path.lexists(state_path):
        raise CheckpointError(f"{field}: state file {state_path.name} missing")
    data = read_bytes_capped(state_path, "GR00T normalization statistics", limit=CONFIG_LIMIT)
    try:
        return load_bytes(data)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own Rust-side error types
        raise CheckpointError(f"GR00T normalization statistics {state_path} are not a safetensors file "
                              f"({exc})") from None


def _minmax(state: dict[str, np.ndarray], key: str, dim: int, where: str) -> MinMax | None:
    lo, hi = state.get(f"{key}.min"), state.get(f"{key}.max")
    if lo is None or hi is None:
        return None
    lo, hi = lo.astype(np.float32).reshape(-1), hi.astype(np.float32).reshape(-1)
    if lo.shape != (dim,) or hi.shape != (dim,):
        raise CheckpointError(f"{where}: {key} statistics have {lo.shape[0]} entries, the policy {dim}")
    return MinMax(lo, hi)


def _feature_dim(cfg: dict[str, Any], group: str, key: str, where: str) -> int:
    try:
        return int(cfg[group][key]["shape"][0])
    except (KeyError, IndexError, TypeError):
        raise CheckpointError(f"{where}: {group}[{key!r}].shape missing") from None


# ------------------------------------------------------------------------------------ images
@dataclass(frozen=True)
class EagleTile:
    """The Eagle 2.5 image processor with one tile (lerobot's min = max dynamic tiles = 1, no thumbnail)."""

    tile: int
    size: tuple[int, int]
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1.0 / 255.0
    mode: str = "eagle2.5-tile"

    @classmethod
    def read(cls, folder: Path) -> EagleTile:
        path = folder / "preprocessor_config.json"
        pre = read_json(path) if path.is_file() else {}
        size, crop = pre.get("size") or {"height": 448, "width": 448}, pre.get("crop_size") or {}
        if "height" not in size:
            size = {"height": size["shortest_edge"], "width": size["shortest_edge"]}
        refused = [
            k
            for k, ok in (
                ("do_center_crop", not pre.get("do_center_crop")),
                ("do_rescale", pre.get("do_rescale", True)),
                ("do_normalize", pre.get("do_normalize", True)),
                ("do_resize", pre.get("do_resize", True)),
                ("resample", int(pre.get("resample", 3)) == 3),
            )
            if not ok
        ]
        if refused:
            raise CheckpointError(f"{path}: {refused} differ from the Eagle processor's bicubic pipeline")
        extra = {
            k: tuple(float(x) for x in pre[f"image_{k}"]) for k in ("mean", "std") if pre.get(f"image_{k}")
        }
        return cls(
            int(crop.get("height") or size["height"]),
            (int(size["height"]), int(size["width"])),
            rescale=float(pre.get("rescale_factor", 1.0 / 255.0)),
            **extra,
        )

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        """(3, h, w) uint8 -> (3, *size) float32."""
        return eagle_normalize(_resize(_resize(img, (self.tile, self.tile)), self.size), self)


# ------------------------------------------------------------------------------------ prompt
class EagleChat15:
    """The checkpoint's chat template for I images then the prompt, placeholders expanded (module doc)."""

    def __init__(self, folder: Path, image_token: int, n_images: int, per_tile: int) -> None:
        self.tok = eagle_tokenizer(folder)
        proc_path = folder / "processor_config.json"
        proc = read_json(proc_path) if proc_path.is_file() else {}
        self.image_token = str(proc.get("image_token", "<IMG_CONTEXT>"))
        start, end = str(proc.get("image_start_token", "<img>")), str(proc.get("image_end_token", "</img>"))
        if self.tok.token_to_id(self.image_token) != image_token:
            raise ConfigError(
                f"{folder}: {self.image_token} is token {self.tok.token_to_id(self.image_token)}, the "
                f"backbone config says {image_token}; pass the checkpoint's own Eagle processor folder"
            )
        if int(proc.get("tokens_per_tile", 256)) != per_tile:
            raise CheckpointError(
                f"{proc_path}: tokens_per_tile {proc.get('tokens_per_tile', 256)} is not the vision "
                f"tower's {per_tile} tokens per image"
            )
        placeholder = re.compile(rf"<({proc.get('image_placeholder', 'image')})-(\d+)>")
        text = self._render(folder, n_images)
        if text.count(SENTINEL) != 1:
            raise CheckpointError(f"{folder}: the chat template does not write the user text once")

        def expand(match: re.Match[str]) -> str:
            k = int(match.group(2))
            return f"<image {k}>{start}" + self.image_token * per_tile + end

        self.before, self.after = (placeholder.sub(expand, part) for part in text.split(SENTINEL))
        self.header_ids = self.encode(self.before)
        self.slots = [i for i, t in enumerate(self.header_ids) if t == image_token]
        if len(self.slots) != n_images * per_tile or image_token in self.encode(self.after):
            raise CheckpointError(
                f"{folder}: the chat template does not put the {n_images} images before the prompt"
            )
        self.added = [t.content for t in self.tok.get_added_tokens_decoder().values()]

    @staticmethod
    def _render(folder: Path, n_images: int) -> str:
        path = folder / "chat_template.json"
        if path.is_file():
            template = read_json(path).get("chat_template")
        else:
            cfg_path = folder / "tokenizer_config.json"
            template = read_json(cfg_path).get("chat_template") if cfg_path.is_file() else None
        if not isinstance(template, str):
            raise CheckpointError(f"{folder}: no chat template (chat_template.json)")
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        content = [{"type": "image", "image": None}] * n_images + [{"type": "text", "text": SENTINEL}]
        try:
            return env.from_string(template).render(
                messages=[{"role": "user", "content": content}], add_generation_prompt=True
            )
        except Exception as exc:  # a template error: the file's fault
            raise CheckpointError(f"{folder}: the chat template fails to render: {exc}") from None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def prompt_ids(self, prompt: str) -> list[int]:
        if any(s in prompt for s in self.added) or MEDIA_PLACEHOLDER.search(prompt):
            raise InputError("prompt: contains a special token or an <image-k> placeholder of the template")
        ids = self.encode(self.before + str([prompt]) + self.after)
        if ids[: len(self.header_ids)] != self.header_ids:
            raise InputError("prompt: merges with the chat header when tokenized")
        return ids


# -------------------------------------------------------------------------------------- frontend
@dataclass(frozen=True)
class N15Embodiment:
    tag: str
    id: int
    frames: int = 1


class GrootN15Frontend(GrootFrontend):
    """Static buffers + one graph per prompt bucket around a loaded `GrootN15Model` (batch 1); the
    buffers are the N1.7 frontend's."""

    LAYOUT = "the chat layout"

    @property
    def state_size(self) -> int:
        return self.state_dim

    def __init__(
        self,
        model: GrootN15Model,
        embodiment: N15Embodiment,
        cameras: Sequence[str],
        image: EagleTile,
        chat: EagleChat15,
        state: MinMax | None,
        actions: MinMax | None,
        dims: tuple[int, int, int],  # state_dim, action_dim, n_action_steps
        formalize: bool,
        buckets: Sequence[int] | None,
        backend: Any,
    ) -> None:
        self.model, self.config = model, model.config
        self.embodiment, self.cameras, self.image, self.chat = embodiment, tuple(cameras), image, chat
        self.state_norm, self.action_norm, self.formalize = state, actions, formalize
        self.device = model.backbone.embed.weight.device
        head = self.config.head
        self.state_dim, self.action_dim, steps = dims
        if self.state_dim > head.max_state_dim or self.action_dim > head.max_action_dim:
            raise ConfigError(
                "the policy's state/action sizes exceed the model's max_state_dim/max_action_dim"
            )
        self.chunk_size = head.horizon
        self.n_action_steps = max(1, min(self.chunk_size, steps))
        self.image_size = image.size
        self.header_len = len(chat.header_ids)
        self._slots = torch.tensor(chat.slots, device=self.device)
        base = self.header_len + len(chat.encode(str([DEFAULT_PROMPT]) + chat.after))
        default = round_buckets(base, (8, 24, 56))
        self.buckets = bucket_set(buckets or default, self.header_len, "image header")
        self.max_len = self.buckets[-1]
        self._allocate(backend)

    def _step_args(self, bucket: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        pixels, tokens, mask, state, noise, actions = self._io(bucket)
        tables = self.model.tables(bucket)
        return (pixels, tokens, mask, self._slots, state, noise, actions, tables, self.embodiment.id), {}

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "version": "n1.5",
            "n_action_steps": self.n_action_steps,
        }

    def _normalize_state(self, raw: np.ndarray) -> np.ndarray:
        norm = self.state_norm
        return raw if norm is None else norm.normalize(raw, clip=False)

    def _prompt_ids(self, obs: Mapping[str, Any]) -> list[int]:
        return self.chat.prompt_ids(self._prompt(obs))

    def _camera_key(self, cam: str) -> str:
        return "observation.image" if cam == "" else f"observation.images.{cam}"

    def _image(self, obs: Mapping[str, Any], cam: str) -> torch.Tensor:
        return self.image(self._frame(obs, cam).cpu())

    def _state(self, obs: Mapping[str, Any]) -> np.ndarray:
        return read_state(obs, self.state_dim)

    def _prompt(self, obs: Mapping[str, Any]) -> str:
        text = read_prompt(obs, PROMPT_KEYS, batched=True) or DEFAULT_PROMPT
        if self.formalize:  # GrootPackInputsStep(formalize_language=True)
            text = "".join(ch for ch in text.lower() if ch.isalnum() or ch.isspace())
        return text

    def read(self, checked: Checked) -> np.ndarray:
        y = (
            self.buffers["expert_actions"][0, : self.chunk_size, : self.action_dim]
            .to("cpu", copy=True)
            .numpy()
        )
        norm = self.action_norm
        if norm is None:
            return y
        span = norm.high - norm.low
        safe = np.where(span != 0, span, np.float32(1.0))
        out = (y + np.float32(1.0)) * np.float32(0.5) * safe + norm.low
        return np.where(span != 0, out, norm.low).astype(np.float32)


def _embodiment(pack: dict[str, Any], choice: str | int | None, num: int) -> N15Embodiment:
    mapping = {str(k): int(v) for k, v in (pack.get("embodiment_mapping") or EMBODIMENT_MAPPING).items()}
    if choice is None:
        choice = str(pack.get("embodiment_tag") or "new_embodiment")
    if isinstance(choice, int) and not isinstance(choice, bool):
        if not 0 <= choice < num:
            raise ConfigError(f"embodiment id {choice}: the model has {num} (0..{num - 1})")
        tags = [t for t, i in mapping.items() if i == choice]
        return N15Embodiment(tags[0] if tags else f"id{choice}", choice)
    if choice not in mapping:
        known = ", ".join(f"{t} (id {i})" for t, i in mapping.items())
        raise ConfigError(
            f"embodiment {choice!r} is not in the policy's embodiment_mapping; choose one of: {known}"
        )
    if not 0 <= mapping[choice] < num:
        raise CheckpointError(
            f"embodiment {choice!r} has id {mapping[choice]}, not below max_num_embodiments {num}"
        )
    return N15Embodiment(str(choice), mapping[choice])


def _cameras(cfg: dict[str, Any], chosen: Sequence[str] | None, where: str) -> tuple[str, ...]:
    keys = sorted(
        k for k, f in (cfg.get("input_features") or {}).items() if (f or {}).get("type") == "VISUAL"
    )
    names = tuple("" if k == "observation.image" else k.removeprefix("observation.images.") for k in keys)
    if not names:
        raise CheckpointError(f"{where}: no VISUAL input feature (lerobot's groot needs at least one camera)")
    if chosen is None:
        return names
    cams = tuple(chosen)
    if not cams or len(set(cams)) != len(cams) or [c for c in cams if c not in names]:
        raise ConfigError(f"cameras {list(cams)}: the policy reads {list(names)} (a subset is allowed)")
    return tuple(sorted(cams))


def load(where: PolicyFolder, opts: LoadOptions | None = None, **changes: Any) -> GrootN15Frontend:
    """A captured GR00T N1.5 frontend for the lerobot 0.5.1 policy folder ``where`` (module docstring):
    ``opts`` (default `LoadOptions`) with ``changes`` (its fields by name); ``frame_size`` is unused
    (every frame is resized to SigLIP's square)."""
    opts = replace(opts or LoadOptions(), **changes)
    folder, cfg = where.folder, where.config
    assets = assets_dir(where, opts.tokenizer)
    config = n15_config(where.base, assets, opts.num_steps)
    pack, pre_state = _pipeline_step(folder, "policy_preprocessor", PACK_STEP)
    _, post_state = _pipeline_step(folder, "policy_postprocessor", UNPACK_STEP)
    name = str(folder / "config.json")
    state_dim = _feature_dim(cfg, "input_features", "observation.state", name)
    action_dim = _feature_dim(cfg, "output_features", "action", name)
    norm = pack.get("normalize_min_max", True)
    state = _minmax(pre_state, "observation.state", state_dim, name) if norm else None
    actions = _minmax(post_state, "action", action_dim, name) if norm else None
    emb = _embodiment(pack, opts.embodiment, config.head.num_embodiments)
    cams = _cameras(cfg, opts.cameras, name)
    image = EagleTile.read(assets)
    if image.size != (config.eagle.image_size,) * 2:
        raise CheckpointError(
            f"{assets}: the image processor's size {image.size} is not SigLIP's {config.eagle.image_size}"
        )
    chat = EagleChat15(assets, config.eagle.image_token, len(cams), config.eagle.tokens_per_image)
    model, dev = load_model(load_n15, config, folder, opts)
    frontend = GrootN15Frontend(
        model,
        emb,
        cams,
        image,
        chat,
        state,
        actions,
        (state_dim, action_dim, int(cfg.get("n_action_steps") or config.head.horizon)),
        bool(pack.get("formalize_language", False)),
        opts.buckets,
        backend_for_device(opts.backend, dev),
    )
    return finish(frontend, opts, folder)
