"""lerobot 0.6.1's Pi0 / Pi0.5 at any size, for ``flashrt bench pi0|pi05 --vs lerobot`` (and the parity
fixture generator, tests/fixtures/gen/gen_pi0_e2e.py): shipped in the package, so the comparison runs
from an installed flashrt, not only from a checkout. Needs lerobot 0.6.1 and transformers importable
(the reference environment); nothing here is imported otherwise.

    shrink(modeling, vocab, vlm, expert, vision)   make lerobot build Gemma / SigLIP of these sizes
    load_hf_tokenizer(path)                        transformers' GemmaTokenizer from a SentencePiece
                                                   .model file, without the sentencepiece package
    lerobot_batch(observation)                     a flashrt observation as lerobot's batch
    pi0_modeling, pi05_modeling, tokenizer_processor   lerobot's modules (imported on first use)

Facts about lerobot 0.6.1 this relies on: `modeling_pi0` / `modeling_pi05` build their Gemmas through
``get_gemma_config(variant)`` ("gemma_2b" for the VLM, else the expert) and the classes
``PaliGemmaForConditionalGenerationWithPiGemma`` / ``PiGemmaForCausalLM``, with a So400m SigLIP and
PaliGemma's 257,152-token vocabulary hard-coded; its TokenizerProcessorStep loads the tokenizer through
``tokenizer_processor.AutoTokenizer``; images enter as float CHW in [0, 1].
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

__all__ = ["shrink", "load_hf_tokenizer", "lerobot_batch"]  # and the lerobot modules of `_MODULES`

_MODULES = {"pi0_modeling": "lerobot.policies.pi0.modeling_pi0",
            "pi05_modeling": "lerobot.policies.pi05.modeling_pi05",
            "tokenizer_processor": "lerobot.processor.tokenizer_processor"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def shrink(modeling: Any, vocab: int, vlm: dict, expert: dict, vision: dict) -> None:
    """Make lerobot's ``modeling`` module build its VLM Gemma with ``vlm`` sizes, the action expert with
    ``expert`` sizes, SigLIP with ``vision`` sizes and a ``vocab``-token embedding (GemmaConfig keyword
    arguments; SigLIP vision_config attributes)."""
    gemma_config = modeling.GemmaConfig
    modeling.get_gemma_config = lambda v: gemma_config(**(vlm if v == "gemma_2b" else expert))
    real_vlm, real_expert = modeling.PaliGemmaForConditionalGenerationWithPiGemma, modeling.PiGemmaForCausalLM

    def build_vlm(config: Any) -> Any:
        for key, value in vision.items():
            setattr(config.vision_config, key, value)
        config.vision_config.projection_dim = config.text_config.hidden_size
        config.projection_dim = config.hidden_size = config.text_config.hidden_size
        config.text_config.vocab_size = vocab
        return real_vlm(config=config)

    def build_expert(config: Any) -> Any:
        config.vocab_size = vocab
        return real_expert(config=config)

    modeling.PaliGemmaForConditionalGenerationWithPiGemma = build_vlm
    modeling.PiGemmaForCausalLM = build_expert


def load_hf_tokenizer(path: str | Path) -> Any:
    """transformers' GemmaTokenizer from the SentencePiece model at ``path`` (transformers parses the
    proto with protobuf; its sentencepiece-package check is lifted for the call)."""
    loaded = sys.modules.get("sentencepiece.sentencepiece_model_pb2")
    if loaded is not None:  # both define the same messages; registering transformers' copy would clash
        sys.modules.setdefault("transformers.utils.sentencepiece_model_pb2_new", loaded)
    from transformers import GemmaTokenizer

    convert = importlib.import_module("transformers.convert_slow_tokenizer")
    real = convert.requires_backends

    def protobuf_only(obj: Any, backends: Any) -> Any:
        backends = [backends] if isinstance(backends, str) else list(backends)
        return real(obj, [b for b in backends if b != "sentencepiece"])

    convert.requires_backends = protobuf_only
    try:
        return GemmaTokenizer.from_pretrained(str(Path(path).parent), add_bos_token=True)
    finally:
        convert.requires_backends = real


def lerobot_batch(observation: dict[str, Any]) -> dict[str, Any]:
    """A flashrt observation (uint8 HWC images, state, prompt) as lerobot's batch (float CHW / 255)."""
    import torch

    batch = {f"observation.images.{camera}": torch.from_numpy(image).permute(2, 0, 1).float() / 255.0
             for camera, image in observation["images"].items()}
    batch["observation.state"] = torch.from_numpy(observation["state"])
    batch["task"] = observation["prompt"]
    return batch
