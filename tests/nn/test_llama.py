"""The one decoder layer (`flashrt.nn.llama.DecoderLayer`): every family's layer is it, with its flags."""

import pytest
import torch

from flashrt.nn.gemma import Gemma, gemma_layer
from flashrt.nn.llama import DecoderLayer, LayerShape, Llama
from flashrt.nn.norms import AdaRMSNorm, RMSNorm
from flashrt.nn.qwen3vl import qwen3_layer


def test_gemma_llama_qwen3_and_qwen3vl_layers_are_the_one_decoder_layer():
    with torch.device("meta"):
        gemma = Gemma(16, 2, 32, 2, 1, 8, vocab_size=10).layers[0]
        expert = Gemma(16, 1, 32, 2, 1, 8, cond_dim=16).layers[0]
        llama = Llama(LayerShape(16, 32, 2, 1, 8), 1, 10, tied=True).layers[0]
        qwen3 = Llama(LayerShape(16, 32, 2, 1, 8, qk_norm=True), 1, 10, tied=True).layers[0]
        qwen3vl = qwen3_layer(16, 32, 2, 1, 8)
    assert all(type(m) is DecoderLayer for m in (gemma, expert, llama, qwen3, qwen3vl))
    flags = [(m.s.act, m.s.offset, m.s.cast_first, m.s.causal) for m in (gemma, llama)]
    assert flags == [("gelu_tanh", True, False, False), ("silu", False, True, True)]
    assert qwen3.q_norm is not None and qwen3vl.q_norm is not None and not qwen3vl.s.cast_first
    assert llama.q_norm is None and isinstance(expert.input_norm, AdaRMSNorm)
    for layer in (gemma, llama, qwen3vl):  # one RMSNorm module, the forms as its flags
        assert type(layer.input_norm) is RMSNorm and layer.input_norm.offset == layer.s.offset
    assert isinstance(gemma_layer(16, 32, 2, 1, 8), DecoderLayer)


def test_an_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="act="):
        DecoderLayer(LayerShape(16, 32, 2, 1, 8, act="relu"))
