"""`pi0_fast` benchmark: the Pi0-FAST policy end to end, raw observation in, actions out.

One call (batch 1) = `Policy.infer` on one observation: uint8 camera frames, the raw joint state and a
prompt in; the un-normalized (n_action_steps, A) chunk out. Timed stages (`flashrt.bench.registry`):

    validate     observation checks, state normalization + discretization, prompt tokenization
    h2d          frames into the static buffers (resized with padding on the device)
    replay       the prompt bucket's prefill graph, then the decode graph replayed per token until "|"
                 or max_decoding_steps
    postprocess  the FAST detokenizer (BPE decode, inverse DCT), un-normalization

Weights. Pi0-FAST decodes greedily, and random weights emit arbitrary ids that no FAST tokenizer
decodes, so the default checkpoint is the parity fixture of a checkout,
``tests/fixtures/pi0_fast/cam2/policy`` (lerobot 0.6.1 pi0_fast dir, 2 cameras, Gemma width 64, 2
layers, SigLIP 28 px, 1,024-token vocabulary, up to 24 decode steps; its lm_head is shaped so the random
model emits FAST tokens, see tests/fixtures/README.md) with the fixture's tokenizer; the trace is that
fixture's observations (early end markers and full-length decodes). ``--checkpoint DIR`` loads another
pi0_fast dir (``[model] tokenizer = PATH`` when tokenizer.model is not inside it).

References (`--vs`): ``lerobot`` (lerobot 0.6.1 PI0FastPolicy + its processor pipelines, from the same
dir: its sizes patched in as the fixture generator does, its two hub tokenizers replaced by the local
files; only where lerobot imports, i.e. the reference venv), or a graph backend name (a second policy
on that backend).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import shutil
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashrt.bench.profiles import Profile
from flashrt.bench.registry import ReferenceUnavailable, register_benchmark
from flashrt.errors import ConfigError
from flashrt.profile.timers import StageTimer

FIXTURE = Path("tests") / "fixtures" / "pi0_fast"
OBS_KEYS = ("images", "state", "prompt")
_MODEL_KEYS = ("tokenizer", "action_tokenizer")


def fixture_observations(folder: Path, n: int) -> list[dict[str, Any]]:
    """The fixture case's observations (raw frames, state, prompt), cycled to `n`."""
    from safetensors.torch import load_file

    info = json.loads((folder / "io.json").read_text())
    io = load_file(str(folder / "io.safetensors"))
    obs = [{"images": {c: io[f"obs{i}.image.{c}"].numpy() for c in o["cameras"]},
            "state": io[f"obs{i}.state"].numpy(), "prompt": o["prompt"]}
           for i, o in enumerate(info["observations"])]
    return [obs[i % len(obs)] for i in range(n)]


class PolicyRunner:
    """A loaded Pi0-FAST `Policy` timed through `Policy.infer`'s stages."""

    def __init__(self, name: str, policy: Any):
        self.name, self.policy = name, policy

    def run(self, inputs: dict[str, Any], timer: StageTimer) -> dict[str, np.ndarray]:
        return {"actions": self.policy.infer({k: inputs[k] for k in OBS_KEYS}, timer=timer)["actions"]}


class LerobotFastRunner:
    """lerobot 0.6.1 PI0FastPolicy with its processor pipelines, built from the same policy dir.
    Stages: preprocess (uint8 -> float CHW / 255, the preprocessor), forward (`predict_action_chunk`:
    greedy KV-cache decode + detokenization), postprocess (un-normalize)."""

    name = "lerobot"

    def __init__(self, folder: Path, loaded: Any, tokenizer: Path):
        from flashrt.bench.adapters.pi0 import _lerobot_gen

        with contextlib.suppress(ImportError):  # sentencepiece's proto first: the generator shares it
            importlib.import_module("sentencepiece.sentencepiece_model_pb2")
        gen = self.gen = _lerobot_gen()
        try:
            import lerobot.policies.pi0_fast.modeling_pi0_fast as modeling
            from lerobot.policies.factory import make_pre_post_processors
            from lerobot.policies.molmoact2.molmoact2_hf_model.action_tokenizer import (
                UniversalActionProcessor,
            )
        except ImportError as exc:
            raise ReferenceUnavailable(f"lerobot 0.6.1 is not importable here ({exc})") from None
        front = loaded.frontend
        _shrink(modeling, front.model.net.config)
        with tempfile.TemporaryDirectory() as tmp:  # transformers reads every tokenizer file of a folder
            shutil.copy(tokenizer, Path(tmp) / "tokenizer.model")
            text = gen.load_hf_tokenizer(Path(tmp) / "tokenizer.model")
        fast = _fast_processor(UniversalActionProcessor, front.checkpoint.fast_path)
        for module in (modeling, gen.tokenizer_processor):
            module.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: text)
            module.AutoProcessor = types.SimpleNamespace(from_pretrained=lambda *a, **k: fast)
        self.policy, cfg = _lerobot_policy(modeling, folder)
        self.pre, self.post = make_pre_post_processors(cfg, pretrained_path=str(folder))

    def run(self, inputs: dict[str, Any], timer: StageTimer) -> dict[str, np.ndarray]:
        with timer.stage("preprocess"):
            batch = self.pre(self.gen.lerobot_batch(inputs))
        with timer.stage("forward"), torch.no_grad():
            actions = self.policy.predict_action_chunk(batch)
        with timer.stage("postprocess"):
            return {"actions": self.post(actions)[0].float().cpu().numpy()}


def _fast_processor(cls: Any, folder: Path) -> Any:
    """lerobot's FAST processor from the local files (its own loader goes through the hub API)."""
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((folder / "processor_config.json").read_text())
    bpe = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                  clean_up_tokenization_spaces=False)
    return cls(bpe, scale=cfg["scale"], vocab_size=cfg.get("vocab_size", 1024), min_token=cfg["min_token"],
               action_dim=cfg.get("action_dim"), time_horizon=cfg.get("time_horizon"))


def _shrink(modeling: Any, config: Any) -> None:
    """Make lerobot build `config`'s sizes (it hard-codes Gemma 2B, So400m at 224 px, 257,152 tokens)."""
    g, v = config.vlm, config.vision
    real = getattr(modeling, "_flashrt_real_paligemma", modeling.PaliGemmaForConditionalGenerationWithPiGemma)
    modeling._flashrt_real_paligemma = real
    gemma = modeling.GemmaConfig(width=g.width, depth=g.depth, mlp_dim=g.mlp_dim, num_heads=g.num_heads,
                                 num_kv_heads=g.num_kv_heads, head_dim=g.head_dim)
    modeling.get_gemma_config = lambda variant: gemma

    def build(config):
        hf = config
        for key, value in dict(hidden_size=v.width, intermediate_size=v.mlp_dim, num_hidden_layers=v.depth,
                               num_attention_heads=v.num_heads, patch_size=v.patch,
                               image_size=v.image_size).items():
            setattr(hf.vision_config, key, value)
        hf.vision_config.projection_dim = hf.projection_dim = hf.hidden_size = g.width
        hf.text_config.vocab_size = g.vocab_size
        return real(config=hf)

    modeling.PaliGemmaForConditionalGenerationWithPiGemma = build


def _lerobot_policy(modeling: Any, folder: Path) -> tuple[Any, Any]:
    from lerobot.configs.policies import PreTrainedConfig
    from safetensors.torch import load_file

    cfg = PreTrainedConfig.from_pretrained(folder)
    cfg.device = "cpu"
    policy = modeling.PI0FastPolicy(cfg)
    policy.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    return policy.eval(), cfg


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


class Pi0FastBenchmark:
    """Adapter of the `Benchmark` protocol (flashrt.bench.registry) for Pi0-FAST."""

    def __init__(self, profile: Profile, checkpoint: str | None, device: str):
        unknown = sorted(set(profile.model) - set(_MODEL_KEYS))
        if unknown:
            raise ConfigError(f"{profile.path or profile.name}: [model] keys {unknown} are not Pi0-FAST "
                              f"benchmark options {list(_MODEL_KEYS)}")
        if profile.precision not in ("fp32", "bf16"):
            raise ConfigError(f"the Pi0-FAST benchmark runs fp32 or bf16, not {profile.precision!r}")
        self.profile, self.device, self.cold_start_ms = profile, device, {}
        self.case = None if checkpoint else FIXTURE / "cam2"
        if self.case is not None and not (self.case / "policy").is_dir():
            raise ConfigError(f"no {self.case}: run from a flashrt checkout, or pass --checkpoint DIR "
                              "(a lerobot pi0_fast policy dir)")
        self.folder = Path(checkpoint) if checkpoint else self.case / "policy"
        fixture_tokenizer = FIXTURE / "tokenizer.model" if self.case else None
        self.tokenizer = profile.model.get("tokenizer") or fixture_tokenizer
        self.loaded = self._load()
        self.name = f"flashrt:{profile.runtime.backend}"
        self.impl = PolicyRunner(self.name, self.loaded)

    def _load(self, backend: str | None = None) -> Any:
        from flashrt.runner.policy import load_policy

        start = time.perf_counter()
        policy = load_policy(self.folder, device=self.device, precision=self.profile.precision,
                             backend=backend or self.profile.runtime.backend,
                             buckets=self.profile.shapes.buckets or None, family="pi0_fast",
                             tokenizer=self.tokenizer,
                             action_tokenizer=self.profile.model.get("action_tokenizer"))
        self.cold_start_ms.setdefault("load", _ms_since(start))
        return policy

    def make_inputs(self, trace_seed: int) -> list[dict[str, Any]]:
        n = self.profile.bench.trace_len
        if self.case is not None:
            return fixture_observations(self.case, n)
        rng, front = np.random.default_rng(trace_seed), self.loaded.frontend
        r = front.checkpoint.resolution
        return [{"images": {c: rng.integers(0, 256, (r, r, 3), dtype=np.uint8) for c in front.images.cameras},
                 "state": rng.normal(0.0, 0.5, front.state_dim).astype(np.float32),
                 "prompt": "pick up the cube"} for _ in range(n)]

    def run(self, inputs: dict[str, Any], timer: StageTimer) -> dict[str, np.ndarray]:
        return self.impl.run(inputs, timer)

    def reference(self, name: str) -> Any:
        from flashrt.runtime.graphs import backend_names

        if name == "lerobot":
            if self.tokenizer is None:
                raise ReferenceUnavailable("lerobot needs the text tokenizer: set [model] tokenizer")
            return LerobotFastRunner(self.folder, self.loaded, Path(self.tokenizer))
        backend = name.removesuffix("-backend")
        if backend in backend_names() or name == "eager":
            return PolicyRunner(name, self._load("eager" if name == "eager" else backend))
        raise ReferenceUnavailable(f"pi0_fast has no reference {name!r}; it offers lerobot and the graph "
                                   f"backends {backend_names()}")

    def flops_bytes(self) -> tuple[float, float]:
        """Matmul FLOPs and weight bytes of one call at the last request's size: vision, the prefix once,
        one lm_head + decoder pass per generated token (2 x parameters touched)."""
        front = self.loaded.frontend
        net, last = front.model.net, front.decoder.last
        c, n_cams = net.config, front.model.n_cams
        layers = sum(p.numel() for p in net.vlm.layers.parameters())
        vision = sum(p.numel() for p in net.vision.parameters()) * c.vision.num_tokens * n_cams
        tokens = max(1, len(last.tokens) + 1)
        prefix = front.model.image_slots + last.prompt_len
        flops = 2 * (vision + layers * (prefix + tokens) + net.lm_head.weight.numel() * tokens)
        weight_bytes = net.lm_head.weight.element_size()
        nbytes = weight_bytes * (sum(p.numel() for p in net.parameters())
                                 + tokens * (layers + net.lm_head.weight.numel()))
        return float(flops), float(nbytes)

    def memory(self) -> dict[str, int]:
        front = self.loaded.frontend
        return {"buffers": front.buffers.nbytes() + front.decoder.io.buffers.nbytes(),
                "weights": sum(p.numel() * p.element_size() for p in front.model.net.parameters())}

    def close(self) -> None:
        pass


def make_pi0_fast_benchmark(profile: Profile, checkpoint: str | None, device: str) -> Pi0FastBenchmark:
    """Factory registered as `pi0_fast`."""
    return Pi0FastBenchmark(profile, checkpoint, device)


register_benchmark("pi0_fast", make_pi0_fast_benchmark,
                   description="Pi0-FAST policy end to end (frames, state, prompt -> greedy FAST tokens -> "
                               "action chunk)")
