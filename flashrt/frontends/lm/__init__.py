"""Causal language models (Llama, Qwen2, Qwen3) loaded strictly from transformers folders.

    from flashrt.frontends.lm import load_lm
    lm = load_lm("path/to/dir", device="cpu", precision="fp32", cache_len=1024)

The frontend (`CausalLM`) owns the module and its static K/V cache; the AR decode runner
(`flashrt.runtime.decode.Decoder`) captures its prefill buckets and its decode step.
"""

from flashrt.frontends.lm.config import ARCHITECTURES, PRESETS, LMConfig
from flashrt.frontends.lm.frontend import CausalLM, load_lm, read_config

__all__ = ["ARCHITECTURES", "PRESETS", "LMConfig", "CausalLM", "load_lm", "read_config"]
