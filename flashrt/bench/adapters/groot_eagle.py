"""`groot-n16` and `groot-n15` benchmarks: GR00T N1.6 (Isaac-GR00T layout) and N1.5 (lerobot 0.5.1
layout) end to end, raw observation in, un-normalized actions out (batch 1).

One call = the frontend's verbs on one observation (uint8 camera frames, a raw state, a prompt), with
the flow-matching noise taken from the trace so every implementation sees the same draw:

    validate     observation checks, the version's image pipeline (N1.6: letter-box, INTER_AREA resize,
                 crop, Eagle smart resize; N1.5: the Eagle 2.5 one-tile bicubic resize), normalization,
                 tokenization with the chat template, state normalization
    h2d          pixels, tokens, state and noise into the static buffers
    replay       the captured step of the prompt's bucket (SigLIP2 / SigLIP, projector, Qwen3 layers,
                 N1.5's VL self-attention, every DiT step)
    postprocess  actions to the host, un-normalized

RANDOM weights (`flashrt.testing.synthetic.groot_eagle`, no weights file): `profile.shapes.preset`
tiny / small / full; `shapes.views` cameras (default 2), `shapes.steps` flow steps, `shapes.buckets`
prompt buckets; `[model]` takes `seed`.

References (`--vs`): any graph backend that runs on the device ("eager", "trace", "onnxrt", "cuda",
...: the same weights behind that graph backend, own buffers). lerobot 0.5.1's N1.5 is timed by
`bench/groot_n15_vs_lerobot.py` (reference venv); Isaac-GR00T's N1.6 is checked for parity in
tests/frontends/groot, not timed.

FLOPs per call: 2 x multiply-adds of every matmul (patches through the vision tower, image tokens
through the projector, the bucket's tokens through the kept Qwen3 layers and N1.5's VL self-attention,
cross-attention K/V once, the DiT's tokens per step); bytes: the weights read once plus the buffers.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from flashrt.bench.adapters.groot import RandomGrootBenchmark, check_profile, weights_bytes
from flashrt.bench.profiles import Profile
from flashrt.bench.registry import register_benchmark
from flashrt.quant.precision import compute_dtype
from flashrt.testing.synthetic import groot_eagle as synthetic_eagle

_MODEL_KEYS = ("seed",)


class GrootEagleBenchmark(RandomGrootBenchmark):
    LEROBOT = (
        "lerobot 0.5.1's N1.5 runs in bench/groot_n15_vs_lerobot.py (reference venv), parity in "
        "tests/frontends/groot"
    )

    def __init__(self, version: str, profile: Profile, checkpoint: str | None, device: str) -> None:
        name = f"groot-{version}"
        check_profile(name, profile, checkpoint, _MODEL_KEYS, "flashrt.load_policy")
        self.version, self.bench_name, self.profile, self.device = version, name, profile, device
        self.preset = profile.shapes.preset
        synthetic_eagle.preset(version, self.preset)  # ConfigError naming the presets
        self.n_cams = profile.shapes.views or 2
        self._tmp = tempfile.TemporaryDirectory()
        start = time.perf_counter()
        self.built = synthetic_eagle.build(
            version,
            self.preset,
            self.n_cams,
            Path(self._tmp.name),
            device,
            compute_dtype(profile.precision),
            int(profile.model.get("seed", 0)),
            profile.shapes.steps or None,
        )
        self.model = self.built.model
        self._capture(start)

    def _frontend(self, backend: str | None) -> Any:
        return self.built.frontend(backend, tuple(self.profile.shapes.buckets) or None)

    def _observations(self, n: int, trace_seed: int) -> list[dict[str, Any]]:
        return synthetic_eagle.observations(self.built.frame, self.n_cams, n, trace_seed)

    def flops_bytes(self) -> tuple[float, float]:
        c, fe = self.model.config, self.frontend
        e, h = c.eagle, c.head
        rows, cols = fe.image_size
        patches = self.n_cams * (rows // e.patch) * (cols // e.patch)
        vis = patches * e.vision_depth * (4 * e.vision_width**2 + 2 * e.vision_width * e.vision_mlp)
        tokens = patches // 4
        proj = tokens * (4 * e.vision_width * e.text_width + e.text_width**2)
        qkv = e.text_width * e.head_dim * (e.heads * 2 + e.kv_heads * 2)
        n = fe.max_len
        text = n * e.layers * (qkv + 3 * e.text_width * e.text_mlp)
        vl = n * h.vl_layers * 12 * h.backbone_dim**2
        cross = (h.dit_layers // 2) * n * 2 * h.backbone_dim * h.inner
        dit_tokens = 1 + h.future_tokens + h.horizon
        dit = h.num_steps * dit_tokens * h.dit_layers * 12 * h.inner**2
        macs = vis + proj + text + vl + cross + dit
        return 2.0 * macs, float(weights_bytes(self.model) + fe.buffers.nbytes())


def make_groot_n16_benchmark(
    profile: Profile, checkpoint: str | None = None, device: str = "cpu"
) -> GrootEagleBenchmark:
    return GrootEagleBenchmark("n16", profile, checkpoint, device)


def make_groot_n15_benchmark(
    profile: Profile, checkpoint: str | None = None, device: str = "cpu"
) -> GrootEagleBenchmark:
    return GrootEagleBenchmark("n15", profile, checkpoint, device)


register_benchmark(
    "groot-n16",
    make_groot_n16_benchmark,
    description="GR00T N1.6 policy (Eagle 3 VL + AlternateVLDiT), one action chunk per call",
)
register_benchmark(
    "groot-n15",
    make_groot_n15_benchmark,
    description="GR00T N1.5 policy (Eagle 2.5 VL + DiT with future tokens), one action chunk per call",
)
