"""Pi0 / Pi0.5: PaliGemma prefix (SigLIP + projector + Gemma 2B) and a Gemma 300M flow-matching expert.

Public API (what the Pi0 policy frontend (`family.py`) and the bench adapter code against)::

    from flashrt.frontends.pi0.config import Pi0Config, preset, config_from_state_dict_shapes
    from flashrt.frontends.pi0.model import (Pi0Model, kv_buffer_specs, io_buffer_specs, make_step,
                                             flops_per_step, bytes_per_step)
    from flashrt.frontends.pi0.weights import load_pi0, pi0_weight_map, detect_variant

    ckpt = open_checkpoint(dir)
    cfg = config_from_state_dict_shapes({k: ckpt.shape(k) for k in ckpt}, detect_variant(ckpt),
                                        chunk_size=50, num_steps=10)        # + variant names from config.json
    model = load_pi0(cfg, ckpt, device="cpu", dtype=torch.float32)         # strict, meta build, eval mode
    # lerobot's bf16 recipe (vision, projector, norms, heads stay fp32): dtype=torch.bfloat16, keep_fp32=True
    flops = flops_per_step(cfg, n_cams, prompt_len)      # {vision, prefix, expert, total, attention}
    traffic = bytes_per_step(cfg, n_cams, prompt_len, weight_bytes=2)   # {weights, kv, total}

    # one call, eager (allocates its own K/V):
    actions = model.sample_actions(images, img_masks, tokens, token_masks, state, noise)

    # graph capture: declare static buffers, capture ONE graph for the whole step
    bufs = Buffers([*io_buffer_specs(cfg, batch, n_cams, prompt_len),
                    *kv_buffer_specs(cfg, batch, cfg.prefix_len(n_cams, prompt_len), dtype)], device)
    graph = get_backend("cuda").capture(make_step(model, bufs), bufs)
    bufs.populate({...}); graph.replay(); actions = bufs.read("expert_actions")

Inputs of `Pi0Model.sample_actions` (the frontend prepares them; names are the `io_buffer_specs` ones):

    images       vision_images       (B, C, 3, R, R) float, pixels already in [-1, 1]; missing camera: -1
    img_masks    vision_masks        (B, C) bool, False for a missing camera (its tokens are ignored)
    tokens       prefix_tokens       (B, L) int64 prompt ids (Pi0.5: state already tokenized in them)
    token_masks  prefix_token_masks  (B, L) bool, False on padding
    state        expert_state        (B, max_state_dim) float32 (Pi0 only; None for Pi0.5), padded
    noise        expert_noise        (B, chunk_size, max_action_dim) float32 ~ N(0, 1)
    out          expert_actions      (B, chunk_size, max_action_dim) float32, written in place
    kv           prefix_k/prefix_v   `StaticKV` or (k, v), each (N, B, KV, T, D) in the model dtype,
                                     T = prefix_len + suffix_len; see `kv_buffer_specs`

Shape letters: B batch, C cameras, R image side, L prompt tokens, P = C * (R/14)² + L prefix tokens,
A max_action_dim, S max_state_dim, H chunk_size, W/We VLM/expert width, N depth (shared), KV kv heads,
D head_dim, T static K/V length, n num_steps.

One step = embed prefix → prefill (VLM writes its K/V at slots [0, P)) → Pi0 state token through the
expert once (its K/V at slot P; it never sees the actions, so it is the same for every Euler step) →
n Euler steps with dt = -1/n from t = 1, each running only the H action tokens through the expert
against the cached K/V. Everything is static-shape tensor work: masks are key-padding biases from
``cumsum``/``where`` over the masks, positions are ``cumsum(valid) - 1`` (no ``.item()``, no branches on
values), so the whole step captures as one graph. Work that does not depend on the observation is
done at load in `reset_derived`: the sinusoidal time embeddings of the fixed schedule, Pi0's time half
of ``action_time_mlp_in``, and Pi0.5's time MLP plus every adaRMS modulation (n × (2N + 1) × 3We).

Numerics follow lerobot 0.6.1 ``PI0Pytorch`` / ``PI05Pytorch.sample_actions``; the parity tests
(fixtures from lerobot) hold max |Δaction| ≤ 1e-4 in float32 (measured ≤ 5e-7 on the tiny fixtures,
5e-6 with real widths at depth 2). Batch rows are independent; outputs are float32 in any model dtype.

`reset_derived` also picks the forms of the model's ops, once (`Pi0Model.select_ops`, the one
`flashrt.ops.select` pass), and on the CPU the weight layouts (`cpu_layouts`): column-major weights
for the expert's few-row GEMMs; oneDNN GEMMs with the tanh-GELU fused for the VLM and the vision tower
(the "mlp" ops' CPU form). Both equal the plain ATen path within float32 rounding
(``flashrt.ops.select(model, "cpu", prefer={"mlp": "aten"})`` restores it; the parity tests run both).
The Gemmas' norms, RoPE and GeGLU products are the "decoder" ops of `flashrt.ops.decoder` (the fused
form: one ``flashrt::`` op each, the csrc CUDA kernels on a GPU; ``Pi0Model(config, kernels=...)``,
the family's ``kernels`` option, "auto" by default); `meta_twin` and `Pi0Frontend.kernels_per_replay`
count what a replay launches.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from flashrt import ops
from flashrt.frontends.pi0.config import GemmaSpec, Pi0Config
from flashrt.io import loading as load
from flashrt.nn.attention import StaticKV, key_padding_bias
from flashrt.nn.gemma import Gemma
from flashrt.nn.rope import rope_cos_sin, rope_inv_freq
from flashrt.nn.siglip import Siglip
from flashrt.ops.decoder import decoder_prefer
from flashrt.runtime.buffers import BufferSpec
from flashrt.runtime.rtc import guided_velocity

KV = StaticKV | tuple[torch.Tensor, torch.Tensor]
Guide = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # frozen, weights, gains, times


def _gemma(spec: GemmaSpec, vocab: int = 0, cond_dim: int | None = None) -> Gemma:
    return Gemma(spec.width, spec.depth, spec.mlp_dim, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                 vocab_size=vocab, eps=spec.eps, cond_dim=cond_dim)


def sinusoidal_time_embedding(times: torch.Tensor, dim: int, min_period: float,
                              max_period: float) -> torch.Tensor:
    """(n,) times -> (n, dim) float32 ``[sin | cos](2π t / period)``, periods geometric in [min, max].

    Computed in float64 like the reference (openpi ``create_sinusoidal_pos_embedding``).
    """
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=times.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (1.0 / period * 2 * math.pi)[None, :] * times[:, None]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).float()


def euler_times(num_steps: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(n,) float32 flow-matching times 1, 1 - 1/n, ..., 1/n (Python double, then float32, as upstream)."""
    dt = -1.0 / num_steps
    return torch.tensor([1.0 + s * dt for s in range(num_steps)], dtype=torch.float32, device=device)


class Pi0Model(nn.Module):
    """Pi0 / Pi0.5 network. The constructor only allocates parameters: load with `load_pi0` (meta build,
    strict map, then ``reset_derived``); after assigning weights by hand, call
    ``flashrt.io.reset_derived(model, device)`` so the schedule tables and embedding scale follow."""

    def __init__(self, config: Pi0Config, kernels: str = "auto") -> None:
        super().__init__()
        c = self.config = config
        self.op_prefer = decoder_prefer(kernels)  # what `select_ops` forces (`flashrt.ops.decoder`)
        self.op_choices: ops.Choices = {}
        v, we = c.vision, c.expert.width
        self.vision = Siglip(v.width, v.depth, v.mlp_dim, v.num_heads, v.patch, v.image_size, v.eps)
        self.projector = nn.Linear(v.width, c.vlm.width)
        self.vlm = _gemma(c.vlm, vocab=c.vlm.vocab_size)
        self.expert = _gemma(c.expert, cond_dim=None if c.has_state_token else we)
        self.action_in = nn.Linear(c.max_action_dim, we)
        self.action_out = nn.Linear(we, c.max_action_dim)
        if c.has_state_token:
            self.state_in = nn.Linear(c.max_state_dim, we)
            self.action_time_in = nn.Linear(2 * we, we)
            self.action_time_out = nn.Linear(we, we)
        else:
            self.time_in = nn.Linear(we, we)
            self.time_out = nn.Linear(we, we)
        self._register_schedule(self.schedule_shapes(c.num_steps))

    # ------------------------------------------------------------------ schedule (derived at load)

    def schedule_shapes(self, num_steps: int) -> dict[str, tuple[int, ...]]:
        we, n = self.config.expert.width, num_steps
        if self.config.has_state_token:
            return {"time_bias": (n, we)}
        norms = 2 * self.config.expert.depth + 1
        return {"time_mods": (n, norms, 3, we), "time_gates": (n, norms, we)}

    def _register_schedule(self, shapes: dict[str, tuple[int, ...]]) -> None:
        shapes = {**shapes, **{f"{n}_inv_freq": (s.head_dim // 2,) for n, s in self._rope_specs().items()}}
        for name, shape in shapes.items():
            self.register_buffer(name, torch.zeros(shape), persistent=False)

    def _rope_specs(self) -> dict[str, GemmaSpec]:
        return {"vlm": self.config.vlm, "expert": self.config.expert}

    def reset_derived(self) -> None:
        """Recompute the schedule tables from the loaded weights (call again after changing them) and
        the RoPE inverse frequencies of both Gemmas (``vlm_inv_freq``, ``expert_inv_freq``: on the
        model's device, the values a call would compute); on the CPU the weight layouts (`cpu_layouts`);
        then the forms of the ops (`select_ops`)."""
        for name, table in self.schedule(self.config.num_steps).items():
            setattr(self, name, table)
        device = self.action_in.weight.device
        for name, spec in self._rope_specs().items():
            setattr(self, f"{name}_inv_freq", rope_inv_freq(spec.head_dim, spec.rope_theta, device))
        if self.action_in.weight.device.type == "cpu":
            cpu_layouts(self)
        self.select_ops()

    def select_ops(self, device: torch.device | str | None = None) -> ops.Choices:
        """The one `flashrt.ops.select` pass for ``device`` (default: the weights') and the model's dtype
        with ``op_prefer``; again after its weights change (quantized GEMM weights take no oneDNN form).
        -> ``op_choices``."""
        dtype = self.vlm.layers[0].qkv.weight.dtype
        device = self.action_in.weight.device if device is None else device
        self.op_choices = ops.select(self, device, dtype, self.op_prefer)
        return self.op_choices

    @torch.no_grad()
    def schedule(self, num_steps: int) -> dict[str, torch.Tensor]:
        """Per-step tables that depend only on the time: Pi0 ``time_bias`` (n, We) = time half of
        action_time_mlp_in + its bias; Pi0.5 ``time_mods`` (n, 2N + 1, 3, We) float32 adaRMS
        modulations and their gate rows ``time_gates`` (n, 2N + 1, We) in the model dtype (cast once
        here, not per call)."""
        we = self.config.expert.width
        device = self.action_in.weight.device
        temb = sinusoidal_time_embedding(euler_times(num_steps, device), we, self.config.min_period,
                                         self.config.max_period).to(self.action_in.weight.dtype)
        if self.config.has_state_token:
            w = self.action_time_in.weight
            return {"time_bias": F.linear(temb, w[:, we:], self.action_time_in.bias)}
        cond = F.silu(self.time_out(F.silu(self.time_in(temb))))
        mods = self.expert.modulation(cond)
        return {"time_mods": mods, "time_gates": _cast(mods[..., 2, :], self.dtype)}

    # ------------------------------------------------------------------ stages

    @property
    def dtype(self) -> torch.dtype:
        return self.vlm.layers[0].qkv.weight.dtype

    def embed_prefix(self, images: torch.Tensor, img_masks: torch.Tensor, tokens: torch.Tensor,
                     token_masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> prefix embeddings (B, P, W) in the model dtype, validity (B, P) bool."""
        b, n_cams = images.shape[:2]
        feats = self.projector(self.vision(images.flatten(0, 1)))  # (B*C, Nt, W)
        n_tok = feats.shape[1]
        img = feats.unflatten(0, (b, n_cams)).flatten(1, 2)  # (B, C*Nt, W)
        emb = torch.cat([img.to(self.dtype), self.vlm.embed_tokens(tokens).to(self.dtype)], dim=1)
        img_valid = img_masks.bool()[:, :, None].expand(b, n_cams, n_tok).reshape(b, n_cams * n_tok)
        return emb, torch.cat([img_valid, token_masks.bool()], dim=1)

    def prefill(self, emb: torch.Tensor, valid: torch.Tensor, kv: StaticKV) -> torch.Tensor:
        """VLM K/V of the prefix into slots [0, P); -> key bias (B, 1, 1, T) for every later stage."""
        bias = key_padding_bias(valid, self.dtype, always_valid=kv.length - valid.shape[1])
        positions = torch.cumsum(valid, dim=1) - 1
        spec = self.config.vlm
        rope = rope_cos_sin(positions, spec.head_dim, spec.rope_theta, self.dtype, self.vlm_inv_freq)
        self.vlm(emb, rope, kv, 0, bias, kv_only_last=True)
        return bias

    def suffix_rope(self, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE half tables (B, suffix_len, 1, D/2) of the expert tokens; positions continue the prefix."""
        n_valid = valid.sum(dim=1, keepdim=True)  # (B, 1)
        positions = n_valid + torch.arange(self.config.suffix_len, device=valid.device)
        spec = self.config.expert
        return rope_cos_sin(positions, spec.head_dim, spec.rope_theta, self.dtype, self.expert_inv_freq)

    def encode_state(self, state: torch.Tensor, rope: tuple, kv: StaticKV, start: int,
                     bias: torch.Tensor) -> None:
        """Pi0: the state token through the expert once; its K/V go to slot ``start`` (= P)."""
        x = self.state_in(_cast(state, self.state_in.weight.dtype))[:, None, :]  # (B, 1, We)
        x = _cast(x, self.dtype)
        self.expert(x, (rope[0][:, :1], rope[1][:, :1]), kv, start, bias, kv_only_last=True)

    def velocity(self, x_t: torch.Tensor, step: int, tables: dict[str, torch.Tensor], rope: tuple,
                 kv: StaticKV, start: int, bias: torch.Tensor) -> torch.Tensor:
        """One expert pass: x_t (B, H, A) float32 at schedule index ``step`` -> v_t (B, H, A) float32. The
        heads run in their weights' dtype (float32 in lerobot's bf16 recipe), the expert in the model's."""
        we = self.config.expert.width
        h = self.action_in(_cast(x_t, self.action_in.weight.dtype))  # (B, H, We)
        mods = gates = None
        if self.config.has_state_token:  # action half of action_time_mlp_in + the precomputed time half
            h = F.linear(h, self.action_time_in.weight[:, :we], tables["time_bias"][step])
            h = self.action_time_out(F.silu(h, inplace=True))
        else:
            mods, gates = tables["time_mods"][step], tables["time_gates"][step]
        y = self.expert(_cast(h, self.dtype), rope, kv, start, bias, mods=mods, gates=gates)
        return _cast(self.action_out(_cast(y, self.action_out.weight.dtype)), torch.float32)

    # ------------------------------------------------------------------ the whole step

    @torch.no_grad()
    def sample_actions(self, images: torch.Tensor, img_masks: torch.Tensor, tokens: torch.Tensor,
                       token_masks: torch.Tensor, state: torch.Tensor | None = None,
                       noise: torch.Tensor | None = None, *, kv: KV | None = None,
                       out: torch.Tensor | None = None, num_steps: int | None = None,
                       guide: Guide | None = None) -> torch.Tensor:
        """Prefix once, then ``num_steps`` Euler steps of the expert -> actions (B, H, A) float32.

        ``kv`` None allocates a temporary cache (eager use); ``out`` receives the result in place.
        ``num_steps`` other than ``config.num_steps`` recomputes the schedule tables (outside graphs).
        ``guide`` (real-time chunking, `flashrt.runtime.rtc`): (frozen (B, H, A), weights (B, H, 1),
        gains (n,), times (n,)) float32 tensors; every velocity is guided toward ``frozen`` (weights 0:
        the unguided result bit for bit).
        """
        c = self.config
        if noise is None:
            raise ValueError("noise is required: randomness enters through the noise buffer")
        if c.has_state_token and state is None:
            raise ValueError("Pi0 needs the state (B, max_state_dim)")
        emb, valid = self.embed_prefix(images, img_masks, tokens, token_masks)
        kv = self._as_kv(kv, valid.shape[0], valid.shape[1])
        bias = self.prefill(emb, valid, kv)
        rope = self.suffix_rope(valid)
        start = valid.shape[1]
        if c.has_state_token:
            self.encode_state(state, rope, kv, start, bias)
            rope, start = (rope[0][:, 1:], rope[1][:, 1:]), start + 1
        x = self._integrate(noise, num_steps or c.num_steps, rope, kv, start, bias, guide)
        return x if out is None else out.copy_(x)

    def _integrate(self, noise: torch.Tensor, num_steps: int, rope: tuple, kv: StaticKV, start: int,
                   bias: torch.Tensor, guide: Guide | None = None) -> torch.Tensor:
        tables = self._tables(num_steps)
        dt = -1.0 / num_steps
        x = _cast(noise, torch.float32)
        for step in range(num_steps):
            v = self.velocity(x, step, tables, rope, kv, start, bias)
            if guide is not None:
                frozen, weights, gains, times = guide
                v = guided_velocity(v, x, times[step], frozen, weights, gains[step])
            x = torch.add(x, v, alpha=dt)  # x + dt v
        return x

    def _tables(self, num_steps: int) -> dict[str, torch.Tensor]:
        if num_steps == self.config.num_steps:
            return {name: getattr(self, name) for name in self.schedule_shapes(num_steps)}
        return self.schedule(num_steps)

    def _as_kv(self, kv: KV | None, batch: int, prefix_len: int) -> StaticKV:
        if kv is None:
            shape = kv_shape(self.config, batch, prefix_len)
            device = self.action_in.weight.device
            return StaticKV(torch.zeros(shape, dtype=self.dtype, device=device),
                            torch.zeros(shape, dtype=self.dtype, device=device))
        kv = kv if isinstance(kv, StaticKV) else StaticKV(*kv)
        want = kv_shape(self.config, batch, prefix_len)
        if tuple(kv.k.shape) != want:
            raise ValueError(f"K/V buffers have shape {tuple(kv.k.shape)}, this call needs {want} "
                             f"(batch {batch}, prefix {prefix_len}); see kv_buffer_specs")
        return kv


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def column_major_linears(module: nn.Module) -> None:
    """Store every ``nn.Linear`` weight (out, in) column-major: same shape and values, strides (1, out).

    ``F.linear`` then hands oneMKL the (in, out) matrix untransposed, which is the faster GEMM for the
    expert's few-row activations on the CPU (docs/benchmarks/pi0.md) and bit-identical.
    Only float32 weights (oneMKL's GEMM; other dtypes go through oneDNN, which wants them row-major).
    Idempotent; call before capturing graphs (the weights move to new storage)."""
    for sub in module.modules():
        w = sub.weight if isinstance(sub, nn.Linear) else None
        if w is not None and w.dtype == torch.float32 and not w.t().is_contiguous():
            sub.weight.data = w.data.t().contiguous().t()


def meta_twin(model: Pi0Model) -> Pi0Model:
    """A shape-only copy on the meta device (no memory, no compute): the same config and per-tensor
    dtypes, derived tables recomputed on meta, the same form of the "decoder" ops as ``model``, the
    reference GEMM/GELU forms (the CUDA path; the CPU's oneDNN forms do not run on meta); a quantized GEMM
    weight becomes a plain one of its dtype (one GEMM kernel). What `flashrt.profile.kernels` counts a
    step of (`Pi0Frontend.kernels_per_replay`)."""
    slots = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in model.state_dict().items()}
    for name, sub in model.named_modules():   # quantized weights are plain attributes, not parameters
        w = sub.__dict__.get("weight") if isinstance(sub, nn.Linear) else None
        if w is not None:
            slots[f"{name}.weight"] = torch.empty(w.shape, dtype=w.dtype, device="meta")
    decoder_form = model.vlm.rms_norm.form
    return load.meta_twin(lambda: Pi0Model(model.config, kernels=decoder_form), slots=slots)


def kernel_stages(model: Pi0Model) -> dict[str, list[nn.Module]]:
    """The stages a kernel count splits a step into (`flashrt.profile.kernels`): ``vision`` (SigLIP and
    the projector), ``prefix`` (the VLM's prefill), ``expert`` (the expert and its action/state/time
    heads, over every denoise step); the rest (masks, RoPE tables, embedding, casts, Euler updates)
    counts as "other"."""
    heads = [m for name, m in model.named_children() if name not in ("vision", "projector", "vlm", "expert")]
    return {"vision": [model.vision, model.projector], "prefix": [model.vlm],
            "expert": [model.expert, *heads]}


def cpu_layouts(model: Pi0Model) -> None:
    """CPU weight layouts, equal to the plain ones within float32 rounding: the expert and the
    action/state/time heads (tens of rows per GEMM) column-major (`column_major_linears`); the vision
    tower and the VLM (hundreds of rows) stay row-major, for oneDNN's fused GEMM + GELU forms (the "mlp"
    ops, `flashrt.nn.gemma.GEGLU`, `flashrt.nn.siglip.FC1_GELU`). Idempotent; runs at load
    (``reset_derived``), before any graph is captured."""
    heads = [m for name, m in model.named_children() if name not in ("vision", "projector", "vlm")]
    for module in heads:
        column_major_linears(module)


# ---------------------------------------------------------------------- static buffers for capture

def kv_shape(config: Pi0Config, batch: int, prefix_len: int) -> tuple[int, ...]:
    """(N, B, KV, T, D) with T = prefix_len + suffix_len."""
    s = config.vlm
    return (s.depth, batch, s.num_kv_heads, prefix_len + config.suffix_len, s.head_dim)


def kv_buffer_specs(config: Pi0Config, batch: int, prefix_len: int,
                    dtype: torch.dtype = torch.float32) -> tuple[BufferSpec, BufferSpec]:
    """``prefix_k``, ``prefix_v``: the per-layer K/V cache (role "state"), in the model dtype."""
    shape = kv_shape(config, batch, prefix_len)
    doc = ("per-layer {} cache (N, B, KV, T, D): slots [0, P) prefix (written once per step), then the "
           "expert's tokens (pi0 state token once, action tokens every denoise step)")
    return (BufferSpec("prefix_k", shape, dtype, role="state", doc=doc.format("key")),
            BufferSpec("prefix_v", shape, dtype, role="state", doc=doc.format("value")))


def io_buffer_specs(config: Pi0Config, batch: int, n_cams: int, prompt_len: int) -> tuple[BufferSpec, ...]:
    """Canonical input/output buffers of one `sample_actions` call (names as in the module docstring)."""
    c, r = config, config.vision.image_size
    specs = [
        BufferSpec("vision_images", (batch, n_cams, 3, r, r), torch.float32, low=-1.0, high=1.0,
                   doc="camera images, pixels in [-1, 1]"),
        BufferSpec("vision_masks", (batch, n_cams), torch.bool, doc="False for a missing camera"),
        BufferSpec("prefix_tokens", (batch, prompt_len), torch.int64, low=0, high=c.vlm.vocab_size - 1,
                   doc="prompt token ids"),
        BufferSpec("prefix_token_masks", (batch, prompt_len), torch.bool, doc="False on padding"),
        BufferSpec("expert_noise", (batch, c.chunk_size, c.max_action_dim), torch.float32,
                   doc="flow-matching noise at t=1"),
        BufferSpec("expert_actions", (batch, c.chunk_size, c.max_action_dim), torch.float32, role="output",
                   doc="denoised actions (padded action dim)"),
    ]
    if c.has_state_token:
        specs.insert(4, BufferSpec("expert_state", (batch, c.max_state_dim), torch.float32,
                                   doc="normalized, zero-padded robot state"))
    return tuple(specs)


def rtc_buffer_specs(config: Pi0Config, batch: int) -> tuple[BufferSpec, ...]:
    """Real-time chunking inputs of the step (`flashrt.runtime.rtc`); all zero = unguided."""
    c, n = config, config.num_steps
    return (BufferSpec("expert_rtc_frozen", (batch, c.chunk_size, c.max_action_dim), torch.float32,
                       doc="frozen actions (normalized, zero-padded) the chunk is guided toward"),
            BufferSpec("expert_rtc_weights", (batch, c.chunk_size, 1), torch.float32, low=0.0, high=1.0,
                       doc="per-position guidance weight (0: unguided)"),
            BufferSpec("expert_rtc_gains", (n,), torch.float32, low=0.0, doc="guidance gain per Euler step"),
            BufferSpec("expert_rtc_times", (n,), torch.float32, low=0.0, high=1.0,
                       doc="flow time of each Euler step"))


def make_step(model: Pi0Model, buffers) -> Callable[[], None]:
    """The no-argument step for `backend.capture`: reads the io buffers, writes ``expert_actions``."""
    names = ("vision_images", "vision_masks", "prefix_tokens", "prefix_token_masks")
    inputs = [buffers[n] for n in names]
    state = buffers["expert_state"] if model.config.has_state_token else None
    kv = StaticKV(buffers["prefix_k"], buffers["prefix_v"])
    noise, out = buffers["expert_noise"], buffers["expert_actions"]

    def step() -> None:
        model.sample_actions(*inputs, state, noise, kv=kv, out=out)

    return step


# ---------------------------------------------------------------------- FLOPs / bytes accounting

def _layer_linear(s: GemmaSpec, n_q: int, kv_only: bool = False) -> int:
    """Projection FLOPs of one decoder layer for n_q tokens (only k|v for a kv-only last layer)."""
    if kv_only:
        return 2 * n_q * s.width * 2 * s.kv_dim
    return 2 * n_q * (s.width * (s.q_dim + 2 * s.kv_dim) + s.q_dim * s.width + 3 * s.width * s.mlp_dim)


def _gemma_flops(s: GemmaSpec, n_q: int, n_k: int, kv_only_last: bool) -> tuple[int, int]:
    """(linear, attention) FLOPs of a decoder stack: n_q queries over n_k keys in every full layer."""
    full = s.depth - int(kv_only_last)
    linear = full * _layer_linear(s, n_q) + (_layer_linear(s, n_q, kv_only=True) if kv_only_last else 0)
    return linear, full * 4 * n_q * n_k * s.q_dim


def _vision_flops(config: Pi0Config) -> tuple[int, int]:
    """(linear incl. patch conv and projector, attention) FLOPs of one image."""
    v, t = config.vision, config.vision.num_tokens
    layer = 2 * t * (4 * v.width * v.width + 2 * v.width * v.mlp_dim)
    linear = 2 * t * 3 * v.patch**2 * v.width + v.depth * layer + 2 * t * v.width * config.vlm.width
    return linear, v.depth * 4 * t * t * v.width


def _expert_flops(c: Pi0Config, p: int, n: int) -> tuple[int, int]:
    we, h, t = c.expert.width, c.chunk_size, p + c.suffix_len
    lin, att = _gemma_flops(c.expert, h, t, kv_only_last=False)
    lin += 2 * h * c.max_action_dim * we * 2 + (4 * h * we * we if c.has_state_token else 0)  # in/out (+time)
    lin, att = n * lin, n * att
    if c.has_state_token:  # the state token's single pass
        s_lin, s_att = _gemma_flops(c.expert, 1, p + 1, kv_only_last=True)
        lin, att = lin + s_lin + 2 * c.max_state_dim * we, att + s_att
    return lin, att


def flops_per_step(config: Pi0Config, n_cams: int, prompt_len: int, num_steps: int | None = None,
                   batch: int = 1) -> dict[str, int]:
    """Matmul FLOPs of one `sample_actions` call as executed (prefix skips its last layer's attention
    and MLP): per stage ``vision``, ``prefix``, ``expert`` and ``total``; ``attention`` is the part of
    ``total`` spent in q·k and p·v products (it does not read weights, unlike the rest)."""
    c, n = config, num_steps or config.num_steps
    p = c.prefix_len(n_cams, prompt_len)
    v_lin, v_att = _vision_flops(c)
    stages = {"vision": (n_cams * v_lin, n_cams * v_att),
              "prefix": _gemma_flops(c.vlm, p, p, kv_only_last=True),
              "expert": _expert_flops(c, p, n)}
    out = {k: batch * (lin + att) for k, (lin, att) in stages.items()}
    out["total"] = sum(out.values())
    out["attention"] = batch * sum(att for _, att in stages.values())
    return out


def _gemma_matrices(s: GemmaSpec) -> int:
    """Weight-matrix parameters of one decoder layer (q, k, v, o, gate, up, down)."""
    return s.width * (2 * s.q_dim + 2 * s.kv_dim + 3 * s.mlp_dim)


def param_counts(config: Pi0Config) -> dict[str, int]:
    """Weight-matrix parameters per stage, as the hot path reads them (norms, biases, Pi0.5's adaRMS
    denses and time MLP excluded: they are tiny or folded into the precomputed schedule)."""
    c, v, we, a = config, config.vision, config.expert.width, config.max_action_dim
    vision = (3 * v.patch**2 * v.width + v.num_tokens * v.width + v.width * c.vlm.width
              + v.depth * (4 * v.width * v.width + 2 * v.width * v.mlp_dim))
    heads = 2 * a * we + (2 * we * we if c.has_state_token else 0)  # action in/out (+ pi0 action-time MLP)
    return {"vision": vision, "vlm": c.vlm.depth * _gemma_matrices(c.vlm),
            "vlm_embed": c.vlm.vocab_size * c.vlm.width,
            "expert": c.expert.depth * _gemma_matrices(c.expert) + heads}


def bytes_per_step(config: Pi0Config, n_cams: int, prompt_len: int, num_steps: int | None = None,
                   batch: int = 1, weight_bytes: int = 4, kv_bytes: int | None = None) -> dict[str, int]:
    """Minimum DRAM traffic of one call: weights (vision + VLM once, expert once per Euler step + the
    Pi0 state pass), embedding rows gathered, and K/V cache writes and reads. Activations excluded."""
    c, n = config, num_steps or config.num_steps
    kv_bytes = kv_bytes or weight_bytes
    pc = param_counts(c)
    expert_passes = n + int(c.has_state_token)
    weights = (pc["vision"] + pc["vlm"] + expert_passes * pc["expert"]) * weight_bytes
    embed = batch * prompt_len * c.vlm.width * weight_bytes
    p = c.prefix_len(n_cams, prompt_len)
    t = p + c.suffix_len
    slot = 2 * c.vlm.depth * batch * c.vlm.kv_dim * kv_bytes  # K and V of one token, all layers
    kv = slot * (t + n * t)  # every slot written once (actions n times, bounded by t) + read per step
    return {"weights": weights + embed, "kv": kv, "total": weights + embed + kv}
