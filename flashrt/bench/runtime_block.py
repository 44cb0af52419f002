"""`runtime-block`: one real transformer block benchmarked as captured replay over static buffers.

The block is a Gemma layer (`flashrt.nn.gemma.gemma_layer`: RMSNorm -> fused qkv -> RoPE -> attention over
a static K/V cache holding a prefix -> output projection -> RMSNorm -> GeGLU MLP, residuals), the layer Pi0
runs in its VLM prefix and action expert. Per call the L new tokens write their K/V behind a prefix of
P cached tokens and attend to all P + L, as a Pi0 expert step does.

Shapes: B batch, L new tokens, P cached prefix tokens, S = P + L, W width, M mlp_dim, H query heads,
KV key/value heads, D head_dim.

Hot path (`run`): validate -> h2d (copy into the static `x`) -> replay (graph from the profile's
backend: eager | trace | cuda) -> d2h (copy of `y`) -> postprocess (float32). References for
`--vs`: "eager" (the same layer called directly, allocating, no static buffers), "compile"
(that call under torch.compile) and any graph backend name ("trace", "cuda", "eager-backend"),
the static path captured on that backend. Weights are random (seeded): the bench measures the
runtime, not a checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from flashrt.bench.profiles import Profile
from flashrt.bench.registry import ReferenceUnavailable, register_benchmark
from flashrt.errors import ConfigError
from flashrt.io.loading import reset_derived
from flashrt.nn.attention import StaticKV
from flashrt.nn.gemma import gemma_layer
from flashrt.nn.rope import rope_cos_sin
from flashrt.profile.timers import StageTimer
from flashrt.runtime.buffers import Buffers, BufferSpec

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class BlockConfig:
    """Sizes of the benchmarked layer (see module doc for the letters)."""

    width: int
    mlp_dim: int
    heads: int
    kv_heads: int
    head_dim: int
    tokens: int
    prefix: int
    batch: int = 1
    seed: int = 0

    @property
    def kv_len(self) -> int:
        return self.prefix + self.tokens


PRESETS = {
    "tiny": BlockConfig(width=64, mlp_dim=256, heads=4, kv_heads=1, head_dim=16, tokens=8, prefix=32),
    "small": BlockConfig(width=512, mlp_dim=2048, heads=8, kv_heads=1, head_dim=64, tokens=16, prefix=256),
    # Pi0's action expert layer (gemma 300m): 50 actions + state token behind a 3-view prefix.
    "expert": BlockConfig(width=1024, mlp_dim=4096, heads=8, kv_heads=1, head_dim=256, tokens=51,
                          prefix=816),
    # Pi0's VLM layer (gemma 2b) over a 3-view + prompt prefix.
    "full": BlockConfig(width=2048, mlp_dim=16384, heads=8, kv_heads=1, head_dim=256, tokens=51,
                        prefix=816),
}
_MODEL_KEYS = ("tokens", "prefix", "seed")


def block_config(profile: Profile) -> BlockConfig:
    """The preset named by `profile.shapes.preset`, with batch and `[model]` overrides applied."""
    if profile.shapes.preset not in PRESETS:
        raise ConfigError(f"{profile.path or profile.name}: runtime-block has no preset "
                          f"{profile.shapes.preset!r}; presets: {sorted(PRESETS)}")
    unknown = sorted(set(profile.model) - set(_MODEL_KEYS))
    if unknown:
        raise ConfigError(f"{profile.path or profile.name}: [model] keys {unknown} are not runtime-block "
                          f"options {list(_MODEL_KEYS)}")
    return replace(PRESETS[profile.shapes.preset], batch=profile.shapes.batch, **profile.model)


def _compute_dtype(profile: Profile) -> torch.dtype:
    if profile.precision not in _DTYPES:
        raise ConfigError(f"{profile.path or profile.name}: runtime-block runs {sorted(_DTYPES)}, not "
                          f"{profile.precision!r} (quantized GEMMs belong to the frontends)")
    return _DTYPES[profile.precision]


class _Model:
    """The layer, its static K/V prefix and RoPE tables: shared by every implementation."""

    def __init__(self, cfg: BlockConfig, device: str, dtype: torch.dtype):
        gen = torch.Generator().manual_seed(cfg.seed)
        layer = gemma_layer(cfg.width, cfg.mlp_dim, cfg.heads, cfg.kv_heads, cfg.head_dim)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.layer = layer.to(device=device, dtype=dtype).eval()
        reset_derived(self.layer, device)  # the norms' 1 + w tables of the drawn weights
        shape = (1, cfg.batch, cfg.kv_heads, cfg.kv_len, cfg.head_dim)
        self.prefix_k = torch.randn(shape, generator=gen).to(device, dtype)
        self.prefix_v = torch.randn(shape, generator=gen).to(device, dtype)
        positions = torch.arange(cfg.prefix, cfg.kv_len, device=device).expand(cfg.batch, -1)
        self.rope = rope_cos_sin(positions, cfg.head_dim, dtype=dtype)
        self.bias = torch.zeros(cfg.batch, 1, 1, cfg.kv_len, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, kv: StaticKV) -> torch.Tensor:
        """x (B, L, W) -> (B, L, W); writes the K/V of x at slots [P, S) of `kv`."""
        return self.layer(x, self.rope, kv, 0, self.cfg.prefix, self.bias)

    def fresh_kv(self) -> StaticKV:
        return StaticKV(self.prefix_k.clone(), self.prefix_v.clone())

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.layer.parameters())


def _specs(cfg: BlockConfig, dtype: torch.dtype) -> list[BufferSpec]:
    kv = (1, cfg.batch, cfg.kv_heads, cfg.kv_len, cfg.head_dim)
    return [BufferSpec("x", (cfg.batch, cfg.tokens, cfg.width), dtype, "input", accepts=(torch.float32,),
                       doc="hidden states of the new tokens"),
            BufferSpec("y", (cfg.batch, cfg.tokens, cfg.width), dtype, "output", doc="layer output"),
            BufferSpec("kv_k", kv, dtype, "state", doc="keys: prefix [0, P) + new tokens [P, S)"),
            BufferSpec("kv_v", kv, dtype, "state", doc="values, same layout")]


class StaticBlock:
    """The layer captured over static buffers on one graph backend (the measured implementation)."""

    def __init__(self, model: _Model, backend: str):
        from flashrt.runtime.graphs import get_backend

        self.name, self.model, self.cold_start_ms = f"flashrt:{backend}", model, {}
        start = time.perf_counter()
        self.buffers = Buffers(_specs(model.cfg, model.dtype), model.device)
        self.buffers["kv_k"].copy_(model.prefix_k)
        self.buffers["kv_v"].copy_(model.prefix_v)
        self.kv = StaticKV(self.buffers["kv_k"], self.buffers["kv_v"])
        self.cold_start_ms["buffers"] = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        self.graph = get_backend(backend).capture(self._forward, self.buffers)
        self.cold_start_ms["capture"] = (time.perf_counter() - start) * 1e3

    def _forward(self) -> None:
        self.buffers["y"].copy_(self.model.forward(self.buffers["x"], self.kv))

    def run(self, inputs: dict[str, Any], timer: StageTimer) -> dict[str, torch.Tensor]:
        with timer.stage("validate"):
            checked = self.buffers.validate(inputs)
        with timer.stage("h2d"):  # the copying half of buffers.populate, timed on its own
            self.buffers.write(checked)
        with timer.stage("replay"):
            self.graph.replay()
        with timer.stage("d2h"):
            y = self.buffers["y"].to("cpu", copy=True)
        with timer.stage("postprocess"):
            return {"y": y.float()}


class EagerBlock:
    """The same layer called directly on each input (allocating; no static buffers, no capture)."""

    def __init__(self, model: _Model, compiled: bool = False):
        self.name = "compile" if compiled else "eager"
        self.model, self.kv = model, model.fresh_kv()
        self._fn = torch.compile(self._call, dynamic=False) if compiled else self._call

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward(x, self.kv)

    def run(self, inputs: dict[str, Any], timer: StageTimer) -> dict[str, torch.Tensor]:
        with timer.stage("h2d"):
            x = torch.as_tensor(inputs["x"]).to(self.model.device, self.model.dtype)
        with timer.stage("forward"), torch.no_grad():
            y = self._fn(x)
        with timer.stage("d2h"):
            return {"y": y.float().cpu()}


class RuntimeBlockBenchmark:
    """Adapter of the `Benchmark` protocol (flashrt.bench.registry) for one transformer block."""

    def __init__(self, profile: Profile, device: str):
        self.profile, self.device = profile, device
        self.cfg = block_config(profile)
        dtype = _compute_dtype(profile)
        start = time.perf_counter()
        self.model = _Model(self.cfg, device, dtype)
        load_ms = (time.perf_counter() - start) * 1e3
        self.backend = profile.runtime.backend
        self.impl = StaticBlock(self.model, self.backend)
        self.name = self.impl.name
        self.cold_start_ms = {"load": load_ms, **self.impl.cold_start_ms}

    def make_inputs(self, trace_seed: int) -> list[dict[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(trace_seed)
        shape = (self.cfg.batch, self.cfg.tokens, self.cfg.width)
        return [{"x": torch.randn(shape, generator=gen)} for _ in range(self.profile.bench.trace_len)]

    def run(self, inputs: dict[str, Any], timer: StageTimer) -> dict[str, torch.Tensor]:
        return self.impl.run(inputs, timer)

    def reference(self, name: str) -> Any:
        from flashrt.runtime.graphs import backend_names

        if name in ("eager", "compile"):
            return EagerBlock(self.model, compiled=name == "compile")
        backend = name.removesuffix("-backend")
        if backend in backend_names():
            return StaticBlock(self.model, backend)
        raise ReferenceUnavailable(f"runtime-block has no reference {name!r}; it offers eager, compile "
                                   f"and the graph backends {backend_names()}")

    def flops_bytes(self) -> tuple[float, float]:
        c = self.cfg
        tokens = c.batch * c.tokens
        proj = c.width * (c.heads + 2 * c.kv_heads) * c.head_dim + c.heads * c.head_dim * c.width
        mlp = 3 * c.width * c.mlp_dim
        attn = 2 * c.heads * c.head_dim * c.kv_len
        flops = 2.0 * tokens * (proj + mlp + attn)
        elem = self.model.layer.o.weight.element_size()
        kv_bytes = 2 * c.batch * c.kv_heads * c.kv_len * c.head_dim * elem
        act_bytes = 2 * tokens * c.width * elem
        return flops, float(self.model.weight_bytes() + kv_bytes + act_bytes)

    def memory(self) -> dict[str, int]:
        return {"buffers": self.impl.buffers.nbytes(), "weights": self.model.weight_bytes()}

    def policy(self) -> ChunkedBlockPolicy:
        return ChunkedBlockPolicy(self)


class ChunkedBlockPolicy:
    """A synthetic chunked policy for `flashrt loop`: every `chunk_size` steps it runs the block on the
    observation and queues L actions (the first 8 channels of each output token); other steps pop one."""

    def __init__(self, bench: RuntimeBlockBenchmark, action_dim: int = 8):
        self.bench, self.action_dim = bench, action_dim
        self.chunk_size = bench.cfg.tokens
        self.timer = StageTimer(bench.device, nvtx=False)
        self.queue: list[torch.Tensor] = []
        self.replanned = False

    def reset(self) -> None:
        self.queue.clear()

    def step(self, obs: dict[str, Any]) -> torch.Tensor:
        self.replanned = not self.queue
        if self.replanned:
            y = self.bench.run(obs, self.timer)["y"][0, :, : self.action_dim]
            self.queue = list(y)
            self.timer.reset()
        return self.queue.pop(0)


def make_benchmark(profile: Profile, checkpoint: str | None, device: str) -> RuntimeBlockBenchmark:
    """Factory registered as `runtime-block` (a checkpoint is not used: weights are seeded)."""
    if checkpoint:
        raise ConfigError("runtime-block builds seeded random weights; it takes no checkpoint")
    return RuntimeBlockBenchmark(profile, device)


register_benchmark("runtime-block", make_benchmark,
                   description="one Gemma decoder layer (attention + GeGLU + RMSNorm + RoPE, static K/V)")
