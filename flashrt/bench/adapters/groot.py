"""`groot-n17` benchmark: GR00T N1.7 end to end, raw observation in, un-normalized actions out (batch 1).

One call = the groot frontend's verbs on one observation (uint8 camera frames, a raw state, a prompt),
with the flow-matching noise taken from the trace so every implementation sees the same draw:

    validate     observation checks, image resize / crop / normalize, tokenization, state normalization
    h2d          pixels, tokens, state and noise into the static buffers
    replay       the captured step of the prompt's bucket (vision, Qwen3 layers, VL self-attention, DiT)
    postprocess  actions to the host, un-normalized

RANDOM weights (`flashrt.testing.synthetic.groot`, no checkpoint file): `profile.shapes.preset`
tiny / small / full; `shapes.views` cameras (default 2), `shapes.steps` flow steps, `shapes.buckets`
prompt buckets; `[model]` takes `seed`, `variant` ("n17", or "n16": no VL self-attention) and, for
`--precision int8|fp8`, `recipe` (default calibration/groot.toml): the model is quantized before any
frontend captures it (scales from the calibration cache, keyed by the random weights' digest; a miss
calibrates and gates), and `--vs fp32` builds the same weights in float32, gated by the recipe's bound.

References (`--vs`): any graph backend that runs on the device ("eager", "trace", "onnxrt", "cuda",
...: the same weights behind that graph backend, own buffers). lerobot is compared by
`bench/groot_vs_lerobot.py` (it needs the reference venv and builds its own checkpoint), not here.

FLOPs per call: 2 x multiply-adds of every matmul (vision tokens through the vision tower and mergers,
prompt tokens through the kept Qwen3 layers and the VL self-attention, cross-attention K/V once, the
DiT's 1 + horizon tokens per step); bytes: the weights read once plus the static buffers.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from flashrt.bench.profiles import Profile
from flashrt.bench.registry import ReferenceUnavailable, register_benchmark
from flashrt.errors import ConfigError
from flashrt.frontends.groot.common.preprocess import PromptTokenizer
from flashrt.profile.timers import StageTimer
from flashrt.quant.precision import COMPUTE_PRECISIONS, QUANTIZED_PRECISIONS, compute_dtype, quantized_kind
from flashrt.testing.synthetic import groot as synthetic

_MODEL_KEYS = ("seed", "variant", "recipe")
FLOAT_PRECISIONS = COMPUTE_PRECISIONS  # `--vs fp32`: the same random weights in that precision


class GrootImplementation:
    """One frontend (backend) over the benchmark's model."""

    def __init__(self, frontend: Any, name: str) -> None:
        self.frontend, self.name = frontend, name

    def run(self, inputs: dict[str, Any], timer: StageTimer) -> dict[str, np.ndarray]:
        fe = self.frontend
        with timer.stage("validate"):
            bucket, checked = fe.check(inputs["obs"], inputs["noise"])
        with timer.stage("h2d"):
            fe.write(bucket, checked)
        with timer.stage("replay"):
            fe.replay(bucket)
        with timer.stage("postprocess"):
            actions = fe.read(checked)
        return {"actions": actions}


def check_profile(
    name: str, profile: Profile, checkpoint: str | None, model_keys: tuple[str, ...], timing: str
) -> None:
    """A random-weight benchmark's profile: ``[model]`` keys among ``model_keys``, no checkpoint
    (``timing`` says what times one)."""
    unknown = sorted(set(profile.model) - set(model_keys))
    if unknown:
        raise ConfigError(
            f"{profile.path or profile.name}: [model] keys {unknown} are not {name} options "
            f"{list(model_keys)}"
        )
    if checkpoint:
        raise ConfigError(f"{name} benchmarks random weights; time a checkpoint with {timing}")


def weights_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class RandomGrootBenchmark(GrootImplementation):
    """The bench protocol of the random-weight GR00T benchmarks. A subclass sets ``bench_name``,
    ``profile``, ``device``, ``n_cams``, ``model``, ``_tmp``, calls `_capture` once its model is built,
    and defines `_frontend`, `_observations`, `flops_bytes` and ``LEROBOT`` (where lerobot is timed)."""

    LEROBOT = ""
    bench_name: str
    profile: Profile
    device: str
    model: Any
    _tmp: tempfile.TemporaryDirectory[str]

    def _capture(self, start: float) -> None:
        """The frontend of the profile's backend; cold start = model build since ``start``, capture."""
        loaded = time.perf_counter()
        backend = self.profile.runtime.backend
        GrootImplementation.__init__(self, self._frontend(backend), f"flashrt:{backend}")
        self.cold_start_ms = {"load": (loaded - start) * 1e3, "capture": (time.perf_counter() - loaded) * 1e3}

    def _frontend(self, backend: str | None) -> Any:
        raise NotImplementedError

    def _observations(self, n: int, trace_seed: int) -> list[dict[str, Any]]:
        raise NotImplementedError

    # -------------------------------------------------------------------------------- protocol
    def make_inputs(self, trace_seed: int) -> list[dict[str, Any]]:
        obs = self._observations(self.profile.bench.trace_len, trace_seed)
        noise_shape = self.frontend.buffers.spec("expert_noise").shape
        rng = np.random.default_rng(trace_seed + 1)
        return [{"obs": o, "noise": rng.standard_normal(noise_shape).astype(np.float32)} for o in obs]

    def reference(self, name: str) -> GrootImplementation:
        import torch

        from flashrt.runtime.graphs import backends_for

        here = backends_for(torch.device(self.device).type)
        if name not in here:
            raise ReferenceUnavailable(f"{self.bench_name} compares graph backends {here}; {self.LEROBOT}")
        return GrootImplementation(self._frontend(name), f"flashrt:{name}")

    def memory(self) -> dict[str, int]:
        return {"buffers": self.frontend.buffers.nbytes(), "weights": weights_bytes(self.model)}

    def policy(self) -> Any:
        from flashrt.runner.policy import Policy

        return Policy(self.frontend)

    def close(self) -> None:
        self._tmp.cleanup()


class GrootBenchmark(RandomGrootBenchmark):
    LEROBOT = "lerobot runs in bench/groot_vs_lerobot.py (reference venv)"

    def __init__(self, profile: Profile, checkpoint: str | None, device: str) -> None:
        timing = "bench/groot_vs_lerobot.py or flashrt.load_policy"
        check_profile("groot-n17", profile, checkpoint, _MODEL_KEYS, timing)
        self.bench_name = "groot-n17"
        self.profile, self.device, self.preset = profile, device, profile.shapes.preset
        if self.preset not in synthetic.PRESETS:
            raise ConfigError(f"groot-n17: preset {self.preset!r}; choose one of {sorted(synthetic.PRESETS)}")
        self.n_cams = profile.shapes.views or 2
        self._tmp = tempfile.TemporaryDirectory()
        self.tokenizer = PromptTokenizer(synthetic.write_tokenizer(Path(self._tmp.name)))
        start = time.perf_counter()
        self.model = self._model(profile.precision)
        self.quantization = self._quantize(quantized_kind(profile.precision))
        self._capture(start)

    def _model(self, precision: str) -> Any:
        p = self.profile
        return synthetic.random_model(
            self.preset,
            self.tokenizer,
            self.device,
            compute_dtype(precision, quantized=QUANTIZED_PRECISIONS),
            int(p.model.get("seed", 0)),
            str(p.model.get("variant", "n17")),
            p.shapes.steps or None,
        )

    def _quantize(self, kind: str | None) -> dict[str, Any] | None:
        """Quantize the model through an uncaptured frontend (calibration runs its step eagerly)."""
        if kind is None:
            return None
        from flashrt.frontends.groot.common.quantize import quantize
        from flashrt.io.digest import tensor_digest

        fe = self._frontend("eager", capture=False)
        digest = tensor_digest({k: v.detach().cpu() for k, v in self.model.state_dict().items()})
        calibration = {"recipe": str(self.profile.model.get("recipe", "")), "progress": False}
        return quantize(fe, kind, calibration, None, weights_digest=digest)

    def _frontend(self, backend: str | None, capture: bool = True, model: Any = None) -> Any:
        buckets = tuple(self.profile.shapes.buckets) or None
        return synthetic.frontend(model or self.model, self.tokenizer, self.preset, self.n_cams, backend,
                                  buckets, capture=capture)

    def reference(self, name: str) -> GrootImplementation:
        """A graph backend over the same model, or (a quantized run) the same weights in a float
        precision on the profile's backend."""
        if name in FLOAT_PRECISIONS and self.quantization is not None:
            fe = self._frontend(self.profile.runtime.backend, model=self._model(name))
            return GrootImplementation(fe, f"flashrt:{self.profile.runtime.backend}:{name}")
        return super().reference(name)

    def vs_tolerance(self, name: str) -> tuple[float, float] | None:
        """A quantized run's gate against a float precision or another backend: the recipe's bound
        (`flashrt.quant.flow.vs_bound`)."""
        from flashrt.quant.flow import vs_bound

        p = self.profile
        return vs_bound(self.quantization, name, p.runtime.backend, p.model.get("recipe"), FLOAT_PRECISIONS)

    def quality(self) -> dict[str, Any] | None:
        """The calibration gate's figures of a quantized run (from the report next to its cache entry)."""
        from flashrt.quant.flow import gate_figures

        return gate_figures(self.quantization)

    def _observations(self, n: int, trace_seed: int) -> list[dict[str, Any]]:
        return synthetic.observations(self.preset, self.n_cams, n, trace_seed)

    def flops_bytes(self) -> tuple[float, float]:
        c, fe = self.model.config, self.frontend
        v, t, h = c.vision, c.text, c.head
        patches = self.n_cams * (fe.image_size[0] // v.patch) * (fe.image_size[1] // v.patch)
        merged = patches // (v.merge * v.merge)
        vis = patches * v.depth * (4 * v.width**2 + 2 * v.width * v.mlp_dim)
        vis += merged * (1 + len(v.deepstack)) * (16 * v.width**2 + 4 * v.width * v.out_width)
        qkv = t.width * t.head_dim * (t.heads * 2 + t.kv_heads * 2)
        n = fe.max_len
        text = n * t.layers * (qkv + 3 * t.width * t.mlp_dim)
        vl = n * h.vl_layers * 12 * h.backbone_dim**2
        cross = (h.dit_layers // 2) * n * 2 * h.backbone_dim * h.inner
        tokens = 1 + h.horizon
        dit = h.num_steps * tokens * h.dit_layers * 12 * h.inner**2
        macs = vis + text + vl + cross + dit
        return 2.0 * macs, float(weights_bytes(self.model) + fe.buffers.nbytes())


def make_groot_benchmark(
    profile: Profile, checkpoint: str | None = None, device: str = "cpu"
) -> GrootBenchmark:
    return GrootBenchmark(profile, checkpoint, device)


register_benchmark(
    "groot-n17",
    make_groot_benchmark,
    description="GR00T N1.7 policy (Qwen3-VL + AlternateVLDiT), one action chunk per call",
)
