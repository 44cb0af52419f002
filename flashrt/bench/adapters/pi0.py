"""`pi0` / `pi05` benchmarks: the Pi0 / Pi0.5 policy end to end, raw observation in, actions out.

One call (batch 1) = `Policy.infer` on one observation: uint8 camera frames, the raw joint state and a
prompt in; the un-normalized (H, A) action chunk out, with the flow-matching noise taken from the trace
so every implementation sees the same draw. Timed stages (`flashrt.bench.registry.STAGES` names):

    validate     observation checks, state normalization, prompt tokenization (nothing written yet)
    h2d          frames, tokens, state and noise into the static buffers; frames are resized with
                 padding on the device
    replay       the captured step of the prompt's bucket (vision + prefix + Euler steps)
    postprocess  actions to the host, un-normalized

Weights. Without `--checkpoint`, a RANDOM-weight checkpoint in the lerobot 0.6.1 policy-dir layout
(config.json, model.safetensors, processor JSONs + statistics, the tiny PaliGemma-convention tokenizer
of `flashrt.demo`) is written to a temporary folder and loaded with `load_policy`, like a downloaded
one. Sizes come from `profile.shapes.preset` (`PRESETS`):

    tiny    flashrt.demo's embedded sizes (Gemma widths 64 / 32, 2 layers, 56 px), 48 x 64 frames
    small   the CPU benchmark config: Gemma width 256, 4 layers, expert 128, SigLIP 128 x 4
            layers at 224 px, 10 Euler steps, chunk 50; 480 x 640 frames
    full    the real sizes: SigLIP So400m/14 at 224 px, Gemma 2B + Gemma 300M expert, the 257,152-token
            embedding; drawn on the bench device and stored in bf16
    expert  = full (the preset name of the generic cuda-bf16 profile)

`shapes.views` sets the camera count (default 2), `shapes.chunk` / `shapes.steps` the chunk size and
Euler steps, `shapes.buckets` the prompt-length buckets (default: the checkpoint's ladder); `[model]`
takes `seed`. With `--checkpoint DIR` a real lerobot / openpi checkpoint is loaded instead (its variant
must be the benchmark's; `views` and `chunk` then come from it); `--tokenizer PATH` (`[model] tokenizer`)
names PaliGemma's tokenizer.model when the checkpoint folder and the hub cache lack it.

References (`--vs`, `quality.reference`):

    eager    the same weights behind the eager backend (own static buffers, no capture)
    trace / cuda / eager-backend   the same weights behind that graph backend
    compile  the step of every bucket under torch.compile (eager backend; compiled on first use)
    lerobot  lerobot 0.6.1 PI0Policy / PI05Policy and its processor pipelines, built from the same
             policy dir (only where lerobot imports: the reference venv, with bench/ and tests/ of a
             checkout next to this package)

Shape letters: C cameras, H chunk size, A the checkpoint's action size, Am max_action_dim, R x W raw
frame rows x columns.
"""

from __future__ import annotations

import tempfile
import time
import types
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt import ops
from flashrt.bench.profiles import Profile
from flashrt.bench.registry import ReferenceUnavailable, register_benchmark
from flashrt.errors import ConfigError
from flashrt.frontends.pi0.frontend import Pi0Frontend
from flashrt.frontends.pi0.model import bytes_per_step, flops_per_step
from flashrt.profile.timers import StageTimer
from flashrt.quant.precision import COMPUTE_PRECISIONS
from flashrt.testing.synthetic.pi0 import TINY, SyntheticSizes, SyntheticSpec, write_checkpoint

VARIANTS = ("pi0", "pi05")
CAMERAS = ("top", "wrist", "side")
PROMPTS = ("pick up the red cube", "put the block in the box", "open the drawer", "pick up the cube")
OBS_KEYS = ("images", "state", "prompt")
TOKENIZER_MAX = {"pi0": 48, "pi05": 200}  # lerobot 0.6.1 defaults (tokenizer_max_length)
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "int8", "fp8": "fp8"}
FLOAT_PRECISIONS = COMPUTE_PRECISIONS  # `--vs fp32`: the same checkpoint loaded in that precision
# recipe: the calibration recipe of an int8 / fp8 run (calibration/); tokenizer: PaliGemma's tokenizer.model
# for a --checkpoint that lacks it (`flashrt bench --tokenizer PATH` sets it)
_MODEL_KEYS = ("seed", "recipe", "tokenizer")


# ------------------------------------------------------------------------------------------ presets
@dataclass(frozen=True)
class BenchPreset:
    """A random-weight benchmark checkpoint: model sizes, cameras, raw frame size, storage.

    vocab 0 keeps the tokenizer's own size (a few hundred rows); the full preset keeps PaliGemma's."""

    sizes: SyntheticSizes
    cameras: int = 2
    frame: tuple[int, int] = (480, 640)
    vocab: int = 0
    storage: torch.dtype = torch.float32


SMALL = SyntheticSizes(vision_width=128, vision_depth=4, vision_mlp=512, image_size=224, vlm_width=256,
                  vlm_mlp=1024, expert_width=128, expert_mlp=512, depth=4, head_dim=32, chunk_size=50,
                  n_action_steps=50, num_steps=10)
FULL = SyntheticSizes(vision_width=1152, vision_depth=27, vision_mlp=4304, image_size=224, vlm_width=2048,
                 vlm_mlp=16_384, expert_width=1024, expert_mlp=4096, depth=18, head_dim=256, chunk_size=50,
                 n_action_steps=50, num_steps=10)
PRESETS: dict[str, BenchPreset] = {
    "tiny": BenchPreset(TINY, frame=(48, 64)),
    "small": BenchPreset(SMALL),
    "full": BenchPreset(FULL, vocab=257_152, storage=torch.bfloat16),
}
PRESETS["expert"] = PRESETS["full"]


def checkpoint_spec(variant: str, profile: Profile) -> SyntheticSpec:
    """The random checkpoint a profile asks for (preset, views, chunk, steps, [model] seed)."""
    where = profile.path or profile.name
    if profile.shapes.preset not in PRESETS:
        raise ConfigError(f"{where}: {variant} has no preset {profile.shapes.preset!r}; "
                          f"presets: {sorted(PRESETS)}")
    preset, s = PRESETS[profile.shapes.preset], profile.shapes
    views = s.views or preset.cameras
    if views > len(CAMERAS):
        raise ConfigError(f"{where}: shapes.views = {views}; the benchmark checkpoint has at most "
                          f"{len(CAMERAS)} cameras")
    chunk = s.chunk or preset.sizes.chunk_size
    sizes = replace(preset.sizes, chunk_size=chunk, n_action_steps=min(preset.sizes.n_action_steps, chunk),
                    num_steps=s.steps or preset.sizes.num_steps, max_tokens=TOKENIZER_MAX[variant])
    return SyntheticSpec(variant, sizes, CAMERAS[:views], preset.vocab, preset.storage,
                          int(profile.model.get("seed", 0)))


# ------------------------------------------------------------------------------------------ hot path
def staged_infer(policy: Any, inputs: dict[str, Any], timer: StageTimer) -> tuple[dict[str, np.ndarray], int]:
    """`Policy.infer(obs, noise=inputs["noise"], timer=timer)`: its stages (validate, h2d, replay,
    postprocess; see the module doc) go into `timer`. Returns ({"actions": (H, A) float32}, the prompt
    bucket replayed)."""
    out = policy.infer({k: inputs[k] for k in OBS_KEYS}, noise=inputs["noise"], timer=timer)
    return {"actions": out["actions"]}, out["bucket"]


def observations(policy: Any, n: int, seed: int, frame: tuple[int, int] = (480, 640)) -> list[dict[str, Any]]:
    """`n` observations for `policy`: C uint8 (R, W, 3) frames, a state near the statistics' center, a
    prompt, and the flow-matching noise (1, H, Am) float32; deterministic in `seed`."""
    rng, c = np.random.default_rng(seed), policy.config
    return [{"images": {cam: rng.integers(0, 256, (*frame, 3), dtype=np.uint8) for cam in policy.cameras},
             "state": rng.normal(0.0, 0.5, policy.state_dim).astype(np.float32),
             "prompt": PROMPTS[i % len(PROMPTS)],
             "noise": rng.normal(0.0, 1.0, (1, c.chunk_size, c.max_action_dim)).astype(np.float32)}
            for i in range(n)]


class PolicyRunner:
    """One implementation of the benchmark: a loaded `Policy` run through `staged_infer`; counts the
    prompt buckets it replays (for the FLOP / byte accounting)."""

    def __init__(self, name: str, policy: Any):
        self.name, self.policy = name, policy
        self.buckets: Counter[int] = Counter()

    def run(self, inputs: dict[str, Any], timer: StageTimer) -> dict[str, np.ndarray]:
        out, bucket = staged_infer(self.policy, inputs, timer)
        self.buckets[bucket] += 1
        return out


class CompiledStepFrontend(Pi0Frontend):
    """A `Pi0Frontend` whose per-bucket step runs under torch.compile (eager backend: nothing captured;
    each bucket compiles on its first replay) with the kernel choices compile can trace: the plain ATen
    MLPs (oneDNN's fused pointwise ops are opaque to it), switched on the shared model only while the
    compiled step runs."""

    def _build(self, bucket: int) -> Any:
        compiled = torch.compile(self.raw_step(bucket), dynamic=False)

        def step() -> None:
            with torch.no_grad(), ops.using(self.model, {"mlp": "aten"}):
                compiled()
        return step


def sibling_policy(policy: Any, backend: str = "eager", frontend_cls: type = Pi0Frontend,
                   cameras: tuple[str, ...] | None = None) -> Any:
    """A second `Policy` over the SAME weights (model, tokenizer, normalizers): its own static buffers and
    graphs on `backend`, optionally for other cameras (the network is camera-count independent)."""
    from flashrt.runner.policy import Policy

    frontend = policy.frontend.sibling(backend, cameras, frontend_cls)
    return Policy(frontend, policy.n_action_steps)


class LoopPolicy:
    """`flashrt loop`'s view of a Policy: `step(obs)` with the trace's noise, `replanned` set after each
    step, `chunk_size` = the replan period (n_action_steps)."""

    def __init__(self, policy: Any):
        self.policy, self.chunk_size, self.replanned = policy, policy.n_action_steps, False

    def step(self, obs: dict[str, Any]) -> np.ndarray:
        self.replanned = self.policy.queued == 0
        return self.policy.step({k: obs[k] for k in OBS_KEYS}, noise=obs.get("noise"))

    def reset(self) -> None:
        self.policy.reset()


# ------------------------------------------------------------------------------------------ lerobot
_LEROBOT_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}
_UNPATCHED: dict[str, tuple[Any, Any, Any]] = {}


def _lerobot_gen() -> Any:
    """lerobot's Pi0 / Pi0.5 at any size (`flashrt.bench.reference.lerobot_pi0`, shipped in the package):
    lerobot's modules, the size patch `shrink`, the offline tokenizer loader, `lerobot_batch`."""
    from flashrt.bench.reference import lerobot_pi0

    try:
        lerobot_pi0.pi0_modeling, lerobot_pi0.pi05_modeling, lerobot_pi0.tokenizer_processor  # noqa: B018
    except ImportError as exc:
        raise ReferenceUnavailable(f"lerobot 0.6.1 is not importable here ({exc}); run under the reference "
                                   "environment (docs: benchmarks)") from None
    return lerobot_pi0


def _shrink(gen: Any, modeling: Any, config: Any) -> None:
    """Make lerobot build the sizes of `config` (it hard-codes Gemma 2B / 300M and So400m); undoes an
    earlier patch of the same module first, so successive sizes do not stack."""
    names = ("get_gemma_config", "PaliGemmaForConditionalGenerationWithPiGemma", "PiGemmaForCausalLM")
    saved = _UNPATCHED.setdefault(modeling.__name__, tuple(getattr(modeling, n) for n in names))
    for name, value in zip(names, saved):
        setattr(modeling, name, value)
    gemma = lambda g: dict(width=g.width, depth=g.depth, mlp_dim=g.mlp_dim, num_heads=g.num_heads,
                           num_kv_heads=g.num_kv_heads, head_dim=g.head_dim)
    v = config.vision
    vision = dict(hidden_size=v.width, intermediate_size=v.mlp_dim, num_hidden_layers=v.depth,
                  num_attention_heads=v.num_heads, patch_size=v.patch)
    gen.shrink(modeling, config.vlm.vocab_size, gemma(config.vlm), gemma(config.expert), vision)


class LerobotRunner:
    """lerobot 0.6.1 PI0Policy / PI05Policy with its processor pipelines, built from the same policy dir
    (config.json read by lerobot, model.safetensors loaded strictly). Stages: preprocess (uint8 -> float
    CHW / 255, the preprocessor pipeline), forward (`predict_action_chunk` with the trace's noise),
    postprocess (the postprocessor: un-normalize, to the host)."""

    name = "lerobot"

    def __init__(self, folder: Path, config: Any, device: str, precision: str = "float32"):
        if precision not in _LEROBOT_DTYPES:
            raise ReferenceUnavailable(f"lerobot runs float32 or bfloat16, not {precision}")
        self.gen, self.device = _lerobot_gen(), device
        modeling = self.gen.pi0_modeling if config.variant == "pi0" else self.gen.pi05_modeling
        _shrink(self.gen, modeling, config)
        tokenizer = self.gen.load_hf_tokenizer(folder / "tokenizer.model")
        self.gen.tokenizer_processor.AutoTokenizer = types.SimpleNamespace(
            from_pretrained=lambda *a, **k: tokenizer)
        self.policy, cfg = self._policy(folder, modeling, config.variant, precision)
        from lerobot.policies.factory import make_pre_post_processors

        self.pre, self.post = make_pre_post_processors(
            cfg, pretrained_path=str(folder), preprocessor_overrides={"device_processor": {"device": device}})

    def _policy(self, folder: Path, modeling: Any, variant: str, precision: str) -> tuple[Any, Any]:
        from lerobot.configs.policies import PreTrainedConfig
        from safetensors.torch import load_file

        cfg = PreTrainedConfig.from_pretrained(folder)
        cfg.device, cfg.dtype = self.device, _LEROBOT_DTYPES[precision]
        policy = (modeling.PI0Policy if variant == "pi0" else modeling.PI05Policy)(cfg)
        policy.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
        return policy.to(self.device).eval(), cfg

    def run(self, inputs: dict[str, Any], timer: StageTimer) -> dict[str, np.ndarray]:
        with timer.stage("preprocess"):
            batch = self.pre(self.gen.lerobot_batch(inputs))
        noise = torch.from_numpy(np.asarray(inputs["noise"])).to(self.device)
        with timer.stage("forward"), torch.no_grad():
            actions = self.policy.predict_action_chunk(batch, noise=noise)
        with timer.stage("postprocess"):
            actions = self.post(actions)
            return {"actions": actions[0].float().cpu().numpy()}


# ------------------------------------------------------------------------------------------ the adapter
def _precision(profile: Profile) -> str:
    if profile.precision not in PRECISIONS:
        raise ConfigError(f"{profile.path or profile.name}: the Pi0 benchmark runs {sorted(PRECISIONS)}, not "
                          f"{profile.precision!r}")
    return PRECISIONS[profile.precision]


def _check_model_keys(profile: Profile) -> None:
    unknown = sorted(set(profile.model) - set(_MODEL_KEYS))
    if unknown:
        raise ConfigError(f"{profile.path or profile.name}: [model] keys {unknown} are not Pi0 benchmark "
                          f"options {list(_MODEL_KEYS)}")


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


class Pi0Benchmark:
    """Adapter of the `Benchmark` protocol (flashrt.bench.registry) for one Pi0 / Pi0.5 variant."""

    def __init__(self, variant: str, profile: Profile, checkpoint: str | None, device: str):
        _check_model_keys(profile)
        self.variant, self.profile, self.device = variant, profile, device
        self.cold_start_ms: dict[str, float] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.spec = checkpoint_spec(variant, profile) if not checkpoint else None
        self.folder = Path(checkpoint) if checkpoint else self._write_random()
        self.loaded = self._load(_precision(profile))
        self.impl = PolicyRunner(f"flashrt:{profile.runtime.backend}", self.loaded)
        self.name = self.impl.name

    def _write_random(self) -> Path:
        start = time.perf_counter()
        self._tmp = tempfile.TemporaryDirectory(prefix=f"flashrt-bench-{self.variant}-")
        folder = write_checkpoint(Path(self._tmp.name), self.spec, self.device)
        self.cold_start_ms["write_checkpoint"] = _ms_since(start)
        return folder

    def _load(self, precision: str, record: bool = True) -> Any:
        from flashrt.runner.policy import load_policy

        start, s = time.perf_counter(), self.profile.shapes
        policy = load_policy(self.folder, device=self.device, precision=precision, num_steps=s.steps or None,
                             backend=self.profile.runtime.backend, buckets=s.buckets or None,
                             **self._load_options(precision))
        if not record:
            return policy
        total, captured = _ms_since(start), policy.frontend.report()["capture_s"]
        self.cold_start_ms |= {"load": total - 1e3 * sum(captured.values()),
                               "capture": 1e3 * sum(captured.values())}
        q = policy.frontend.quantization
        if q is not None:  # calibration (a cache miss) or reading the cache entry (a hit) is part of load
            self.cold_start_ms["calibration" if q["cache"] == "calibrated" else "calibration_cache_hit"] = \
                1e3 * q["seconds"]
        if policy.config.variant != self.variant:
            raise ConfigError(f"{self.folder} holds a {policy.config.variant} checkpoint; this is the "
                              f"{self.variant} benchmark")
        return policy

    def _load_options(self, precision: str) -> dict[str, Any]:
        """load_policy's family options: the calibration of an int8 / fp8 run, the `--tokenizer`."""
        model, options = self.profile.model, {}
        if precision in ("int8", "fp8"):
            options["calibration"] = {"recipe": str(model.get("recipe", "")), "progress": False}
        if "tokenizer" in model:
            options["tokenizer"] = str(model["tokenizer"])
        return options

    @property
    def frame(self) -> tuple[int, int]:
        return PRESETS[self.profile.shapes.preset].frame if self.spec else PRESETS["full"].frame

    def make_inputs(self, trace_seed: int) -> list[dict[str, Any]]:
        return observations(self.loaded, self.profile.bench.trace_len, trace_seed, self.frame)

    def run(self, inputs: dict[str, Any], timer: StageTimer) -> dict[str, np.ndarray]:
        return self.impl.run(inputs, timer)

    def reference(self, name: str) -> Any:
        from flashrt.runtime.graphs import backend_names

        if name == "compile":
            return PolicyRunner("compile", sibling_policy(self.loaded, "eager", CompiledStepFrontend))
        if name in FLOAT_PRECISIONS:
            return PolicyRunner(name, self._load(PRECISIONS[name], record=False))
        if name == "lerobot":
            if self.loaded.checkpoint.layout != "lerobot":
                raise ReferenceUnavailable(f"lerobot reads lerobot policy dirs; {self.folder} is "
                                           f"{self.loaded.checkpoint.layout}")
            return LerobotRunner(self.folder, self.loaded.config, self.device, _precision(self.profile))
        backend = name.removesuffix("-backend")
        if backend in backend_names():
            return PolicyRunner(name, sibling_policy(self.loaded, backend))
        raise ReferenceUnavailable(f"{self.variant} has no reference {name!r}; it offers eager, compile, "
                                   f"lerobot and the graph backends {backend_names()}")

    def vs_tolerance(self, name: str) -> tuple[float, float] | None:
        """A quantized run's gate against a float precision or another backend: the recipe's bound
        (`flashrt.quant.flow.vs_bound`; the cosine and per-layer bounds were checked when the scales were
        calibrated)."""
        from flashrt.quant.flow import vs_bound

        return vs_bound(self.loaded.frontend.quantization, name, self.profile.runtime.backend,
                        self.profile.model.get("recipe"), FLOAT_PRECISIONS)

    def quality(self) -> dict[str, Any] | None:
        """The calibration gate's figures of a quantized run (from the report next to its cache entry)."""
        from flashrt.quant.flow import gate_figures

        return gate_figures(self.loaded.frontend.quantization)

    def flops_bytes(self) -> tuple[float, float]:
        """Network FLOPs and minimum DRAM bytes per call, averaged over the buckets the calls replayed."""
        cfg, n_cams = self.loaded.config, len(self.loaded.cameras)
        buckets = self.impl.buckets or Counter({self.loaded.frontend.frontend.max_len: 1})
        wb = self.loaded.frontend.frontend.model.dtype.itemsize
        calls = sum(buckets.values())
        flops = sum(n * flops_per_step(cfg, n_cams, b)["total"] for b, n in buckets.items()) / calls
        nbytes = sum(n * bytes_per_step(cfg, n_cams, b, weight_bytes=wb)["total"] for b, n in buckets.items())
        return float(flops), float(nbytes / calls)

    def kernels_per_replay(self) -> dict[str, Any]:
        """Kernels one replay of the largest bucket launches on a GPU (a meta count, flashrt.profile)."""
        return self.loaded.frontend.frontend.kernels_per_replay().to_dict()

    def memory(self) -> dict[str, int]:
        model = self.loaded.frontend.frontend.model
        return {"buffers": self.loaded.frontend.buffers.nbytes(),
                "weights": sum(p.numel() * p.element_size() for p in model.parameters())}

    def policy(self) -> LoopPolicy:
        return LoopPolicy(self.loaded)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def make_pi0_benchmark(profile: Profile, checkpoint: str | None, device: str) -> Pi0Benchmark:
    """Factory registered as `pi0`."""
    return Pi0Benchmark("pi0", profile, checkpoint, device)


def make_pi05_benchmark(profile: Profile, checkpoint: str | None, device: str) -> Pi0Benchmark:
    """Factory registered as `pi05`."""
    return Pi0Benchmark("pi05", profile, checkpoint, device)


register_benchmark("pi0", make_pi0_benchmark,
                   description="Pi0 policy end to end (frames, state, prompt -> action chunk)")
register_benchmark("pi05", make_pi05_benchmark,
                   description="Pi0.5 policy end to end (frames, state, prompt -> action chunk)")
