"""`tts-orpheus` benchmark: one streamed utterance per call through the Orpheus-style chain (batch 1).

One call = ``tts.stream(text, seed=...)`` consumed to the end: the LM (captured prefill + one decode
step replayed per token, Orpheus' sampling: temperature 0.6, top-p 0.8, repetition penalty 1.3, on the
device), 7-code frames, the SNAC 24 kHz stream decoder (exact overlap windows), as the chain of
`flashrt.frontends.orpheus.tts` (a one-row `SlotDecoder` here: one stream; `bench/orpheus_streams.py`
runs many).
Timed stages of a call (`StageTimer`):

    ttfa    from the call to the first audio chunk on the host (validation, prompt, prefill, the
            first frames, the first SNAC window): the time to first audio
    rest    the remaining chunks until the end of the utterance

RTF = call time / audio duration; tokens/s = generated tokens / call time (`bench/tts_orpheus.py`
prints them with the chain's per-stage service times). The first utterance after capture (warm-up:
allocator, oneDNN primitives) is timed apart: ``cold_start_ms["first_ttfa"]``, ``["first_call"]``.

Sizes (`profile.shapes.preset`), RANDOM seeded weights (latency does not depend on their values):

    tiny    LM 64 wide x 2 layers (4 heads, 2 kv), SNAC "tiny" (64 codes), the miniature token layout
            of tests/fixtures/tts (720 ids): for tests
    small   LM 512 wide x 4 layers (8 heads, 2 kv, head_dim 64, mlp 1536), SNAC 24 kHz as released
    full    LM at Orpheus-3B size (Llama-3.2-3B), SNAC 24 kHz (for a GPU)
    cpu     LM 256 wide x 4 layers over the miniature layout (720 ids), SNAC 24 kHz as released: speech
            faster than real time on a small CPU, beside a policy (`flashrt bench act-and-talk`)

small and full use Orpheus' real vocabulary (156,940 ids: 128,256 text + specials + 7 x 4096 codes,
tied head) and token layout; all use Llama-3 RoPE scaling. Random weights never emit valid frames by
themselves, so decoding is constrained to the code valid at each place of a frame (`frame_constraint`:
a device mask inside the captured step); an utterance is exactly
``shapes.chunk`` frames (default 24, about 2 s of audio). ``[model]`` takes ``seed``.

References (`--vs`, `quality.reference`): "eager" / "trace" / "cuda" (the same weights behind that
graph backend, own buffers and chain). Outputs are the audio (1, N) float32.

FLOPs per call: the LM's matmuls per token (`CausalLM.flops_per_token`) x tokens (the SNAC decoder is
not counted); bytes: the LM weights read once per token.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from flashrt.bench.profiles import Profile
from flashrt.bench.registry import ReferenceUnavailable, register_benchmark
from flashrt.errors import ConfigError
from flashrt.frontends.lm import CausalLM, LMConfig
from flashrt.frontends.lm.config import PRESETS as LM_PRESETS
from flashrt.frontends.orpheus.layout import ByteTokenizer, OrpheusLayout
from flashrt.frontends.orpheus.tts import ORPHEUS_SAMPLING, OrpheusTTS, frame_constraint
from flashrt.frontends.vocoders import get_family
from flashrt.io.loading import reset_derived
from flashrt.nn.llama import Llama
from flashrt.profile.timers import StageTimer
from flashrt.quant.precision import compute_dtype
from flashrt.runner.vocoder import Vocoder
from flashrt.runtime.slots import SlotDecoder
from flashrt.testing.synthetic.vocoders import random_module

_MODEL_KEYS = ("seed",)
DEFAULT_FRAMES = 24
TEXTS = ("Hello there, how are you today?", "The quick brown fox jumps over the lazy dog.",
         "Streaming speech, one frame at a time.", "Set up once, replay forever.")
_ORPHEUS_VOCAB = 156940

_MINIATURE = OrpheusLayout(base_vocab=258, bos_token_id=256, eot_token_id=257, codebook_size=64)
SIZES: dict[str, tuple[LMConfig, str, OrpheusLayout]] = {
    "tiny": (LMConfig(vocab_size=720, tied=True, rope=LM_PRESETS["orpheus-3b"].rope, rope_theta=500000.0),
             "tiny", _MINIATURE),
    "small": (LMConfig(vocab_size=_ORPHEUS_VOCAB, width=512, depth=4, mlp=1536, heads=8, kv_heads=2,
                       head_dim=64, eps=1e-5, tied=True, rope=LM_PRESETS["orpheus-3b"].rope,
                       rope_theta=500000.0, max_positions=4096), "24khz", OrpheusLayout()),
    "full": (LM_PRESETS["orpheus-3b"], "24khz", OrpheusLayout()),
    "cpu": (LMConfig(vocab_size=720, width=256, depth=4, mlp=768, heads=4, kv_heads=2, head_dim=64, eps=1e-5,
                     tied=True, rope=LM_PRESETS["orpheus-3b"].rope, rope_theta=500000.0, max_positions=4096),
            "24khz", _MINIATURE),
}


def random_lm(cfg: LMConfig, seed: int, device: str, dtype: torch.dtype, cache_len: int,
              batch: int = 1) -> CausalLM:
    """A `CausalLM` with seeded random weights: gains 1, matrices N(0, 1/fan_in), embedding N(0, 1)."""
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where they live (3B weights on a GPU)
    with torch.device("meta"):
        module = Llama(cfg.layer, cfg.depth, cfg.vocab_size, cfg.tied)
    tensors = {}
    for name, p in module.state_dict().items():
        if p.dim() == 1:
            tensors[name] = torch.ones(p.shape, device=device, dtype=dtype)
        else:
            scale = 1.0 if name.startswith("embed") else p.shape[1] ** -0.5
            tensors[name] = (torch.randn(p.shape, generator=g, device=device) * scale).to(dtype)
    module.load_state_dict(tensors, assign=True)
    reset_derived(module, device)  # the norms' float32 gains
    return CausalLM(cfg, module.eval().requires_grad_(False), device=device, dtype=dtype, cache_len=cache_len,
                    batch=batch)


def random_snac(preset: str, codebook: int, seed: int, device: str, dtype: torch.dtype,
                backend: str | None) -> Vocoder:
    family = get_family("snac")
    cfg = replace(family.presets[preset], codebook_size=codebook, noise=False)
    module = random_module(family, cfg, seed, device, dtype)
    return Vocoder(family, cfg, module, device=device, backend=backend, dtype=dtype, stream_chunk=4).capture()


class OrpheusBenchmark:
    """Adapter of the `Benchmark` protocol (flashrt.bench.registry) for the Orpheus-style chain."""

    def __init__(self, profile: Profile, checkpoint: str | None, device: str):
        unknown = sorted(set(profile.model) - set(_MODEL_KEYS))
        if unknown:
            raise ConfigError(f"{profile.path or profile.name}: [model] keys {unknown} are not tts-orpheus "
                              f"options {list(_MODEL_KEYS)}")
        if checkpoint:
            raise ConfigError("tts-orpheus benchmarks random weights; time a real model with `flashrt say`")
        if profile.shapes.preset not in SIZES:
            raise ConfigError(f"tts-orpheus: preset {profile.shapes.preset!r}; choose one of {sorted(SIZES)}")
        self.profile, self.device = profile, device
        self.seed, self.dtype = int(profile.model.get("seed", 0)), compute_dtype(profile.precision)
        self.frames = profile.shapes.chunk or DEFAULT_FRAMES
        self.cold_start_ms: dict[str, float] = {}
        self.tts = self._build(profile.runtime.backend)
        self.name = f"flashrt:{self.tts.decoder.backend.name}"
        self._warm_up()

    def _build(self, backend: str | None) -> OrpheusTTS:
        lm_cfg, snac_preset, layout = SIZES[self.profile.shapes.preset]
        start = time.perf_counter()
        lm = random_lm(lm_cfg, self.seed, self.device, self.dtype, cache_len=64 + 7 * self.frames + 8)
        voc = random_snac(snac_preset, layout.codebook_size, self.seed + 1, self.device, self.dtype, backend)
        loaded = time.perf_counter()
        decoder = SlotDecoder(lm, (32, 64), (lm.batch,), max_new_tokens=7 * self.frames, backend=backend,
                              constraint=frame_constraint(layout)).capture()
        captured = time.perf_counter()
        self.cold_start_ms |= {"load": (loaded - start) * 1e3, "capture": (captured - loaded) * 1e3}
        return OrpheusTTS(decoder, voc, layout, ByteTokenizer(layout.bos_token_id), sample_rate=24000,
                          sampling=ORPHEUS_SAMPLING)

    def _warm_up(self) -> None:
        start = time.perf_counter()
        stream = self.tts.stream(TEXTS[0], voice="tara", seed=0)
        next(stream)
        self.cold_start_ms["first_ttfa"] = (time.perf_counter() - start) * 1e3
        list(stream)
        self.cold_start_ms["first_call"] = (time.perf_counter() - start) * 1e3

    # -------------------------------------------------------------------------------- protocol
    def make_inputs(self, trace_seed: int) -> list[dict[str, Any]]:
        n = self.profile.bench.trace_len
        return [{"text": TEXTS[(trace_seed + i) % len(TEXTS)], "voice": "tara", "seed": trace_seed + i}
                for i in range(n)]

    def run(self, inputs: dict[str, Any], timer: StageTimer) -> dict[str, torch.Tensor]:
        return run_utterance(self.tts, inputs, timer)

    def reference(self, name: str) -> Any:
        from flashrt.runtime.graphs import backends_for

        if name not in backends_for(torch.device(self.device).type):
            raise ReferenceUnavailable(f"tts-orpheus compares graph backends only "
                                       f"({backends_for(torch.device(self.device).type)}), not {name!r}")
        return _Runner(f"flashrt:{name}", twin(self.tts, name))

    def flops_bytes(self) -> tuple[float, float]:
        lm = self.tts.decoder.model
        tokens = 7 * self.frames
        weights = sum(p.numel() * p.element_size() for p in lm.module.parameters())
        return float(lm.flops_per_token() * tokens), float(weights * tokens)

    def memory(self) -> dict[str, int]:
        lm = self.tts.decoder.model
        return {"lm_weights": sum(p.numel() * p.element_size() for p in lm.module.parameters()),
                "kv_cache": lm.buffers.nbytes(), "step_buffers": self.tts.decoder.io.buffers.nbytes()}

    def chain_stats(self) -> dict[str, Any]:
        return self.tts.report()

    def close(self) -> None:
        self.tts.close()


def twin(main: OrpheusTTS, backend: str) -> OrpheusTTS:
    """A second chain over ``main``'s LM and SNAC weights: own cache, buffers, graphs on ``backend``."""
    lm, d, voc = main.decoder.model, main.decoder, main.vocoder
    lm2 = CausalLM(lm.cfg, lm.module, device=lm.device, dtype=lm.dtype, cache_len=lm.cache_len,
                   batch=lm.batch)
    decoder = SlotDecoder(lm2, d.buckets, d.batch_buckets, d.max_new_tokens, backend=backend,
                          constraint=d.constraint).capture()
    voc2 = Vocoder(voc.family, voc.config, voc.module, device=voc.device, backend=backend, dtype=voc.dtype,
                   stream_chunk=voc.stream_chunk).capture()
    return OrpheusTTS(decoder, voc2, main.layout, main.tokenizer, sample_rate=main.sample_rate,
                      sampling=main.sampling)


class _Runner:
    def __init__(self, name: str, tts: OrpheusTTS):
        self.name, self.tts = name, tts

    def run(self, inputs: dict[str, Any], timer: StageTimer) -> dict[str, torch.Tensor]:
        return run_utterance(self.tts, inputs, timer)


def run_utterance(tts: OrpheusTTS, inputs: dict[str, Any], timer: StageTimer) -> dict[str, torch.Tensor]:
    """One streamed utterance: stage "ttfa" to the first chunk, "rest" to the end; the audio (1, N)."""
    with timer.stage("ttfa"):
        stream = tts.stream(inputs["text"], voice=inputs["voice"], seed=inputs["seed"])
        chunks = [next(stream)]
    with timer.stage("rest"):
        chunks += list(stream)
    return {"audio": torch.from_numpy(np.concatenate(chunks))[None]}


register_benchmark("tts-orpheus", OrpheusBenchmark,
                   description="Orpheus-style TTS chain (LM -> 7-code frames -> SNAC 24 kHz stream), "
                               "random weights, one streamed utterance per call")
