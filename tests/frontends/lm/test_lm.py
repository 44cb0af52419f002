"""Causal LM frontend: parity with transformers (tests/fixtures/lm, made by gen_lm.py), strict loading."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashrt.errors import CheckpointError, ConfigError
from flashrt.frontends.lm import LMConfig, load_lm
from flashrt.nn.llama import causal_bias, gather_rope
from flashrt.ops import torch_cpu
from flashrt.runtime.decode import Decoder, Sampling

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "lm"
MODELS = ("llama_tiny", "qwen3_tiny", "qwen2_tiny")
PROMPTS = 5


@pytest.fixture(scope="module", params=MODELS)
def case(request, one_thread):
    lm = load_lm(FIXTURES / request.param)
    decoder = Decoder(lm, buckets=(8, 32, 64), max_new_tokens=64).capture()
    return request.param, decoder, load_file(FIXTURES / f"{request.param}_io.safetensors")


def test_prefill_logits_match_transformers(case):
    _, dec, io = case
    for i in range(PROMPTS):
        bucket, ids, _ = dec.check(io[f"prompt.{i}"], 1, Sampling())
        dec.write(bucket, ids, Sampling())
        dec.prefills.replay(bucket)
        torch.testing.assert_close(dec.io.logits[0], io[f"logits.{i}"], atol=1e-4, rtol=0)


def test_greedy_tokens_identical_to_generate(case):
    _, dec, io = case
    for i in range(PROMPTS):
        assert list(dec.generate(io[f"prompt.{i}"], 64)) == io[f"greedy.{i}"].tolist(), f"prompt {i}"
        assert dec.last.finish == "length"


def test_a_whole_generation_never_recaptures(case):
    _, dec, io = case
    before = dec.report()
    list(dec.generate(io["prompt.3"], 64))
    after = dec.report()
    assert after["decode_captures"] == before["decode_captures"] == {"greedy": 1, "sample": 1}
    assert after["decode_replays"]["greedy"] - before["decode_replays"]["greedy"] == 63
    assert after["prefill"]["captured"] == before["prefill"]["captured"]
    assert after["prefill"]["fallbacks"]["total"] == 0


def test_tied_head_uses_the_embedding():
    lm = load_lm(FIXTURES / "qwen3_tiny")
    assert lm.cfg.tied and lm.module.head is None
    assert not load_lm(FIXTURES / "llama_tiny").cfg.tied


def test_config_reads_rope_scalings_biases_and_norms():
    llama = json.loads((FIXTURES / "llama_tiny" / "config.json").read_text())
    cfg = LMConfig.from_dict(llama)
    assert cfg.rope.rope_type == "llama3" and cfg.rope.original_max_position_embeddings == 64
    old_style = {k: v for k, v in llama.items() if k != "rope_parameters"}
    old_style.update(rope_theta=500000.0, rope_scaling=dict(llama["rope_parameters"]))
    assert LMConfig.from_dict(old_style) == cfg
    assert LMConfig.from_dict(json.loads((FIXTURES / "qwen3_tiny" / "config.json").read_text())).qk_norm
    qwen2 = LMConfig.from_dict(json.loads((FIXTURES / "qwen2_tiny" / "config.json").read_text()))
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.rope.rope_type == "linear"


@pytest.mark.parametrize("change, field", [({"hidden_act": "gelu"}, "hidden_act"),
                                           ({"model_type": "gpt2"}, "model_type"),
                                           ({"rope_parameters": {"rope_type": "yarn"}}, "rope_type")])
def test_config_refuses_what_it_cannot_compute(change, field):
    d = json.loads((FIXTURES / "llama_tiny" / "config.json").read_text())
    with pytest.raises(CheckpointError, match=field):
        LMConfig.from_dict({**d, **change})


def test_weight_map_is_strict(tmp_path):
    folder = tmp_path / "lm"
    shutil.copytree(FIXTURES / "llama_tiny", folder)
    tensors = load_file(folder / "model.safetensors")
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_lm(folder)
    assert "up_proj" in str(err.value) and "model.extra.weight" in str(err.value)



@pytest.mark.parametrize("name", MODELS)
def test_the_loader_selects_the_kernel_row(name):
    """"auto" is the ATen references on the CPU (the slot-batched decode's attention: the native torch
    op where it builds); "fused" routes the norms, RoPE and SwiGLU through the ``flashrt::`` custom ops
    (their references on the CPU: the same prefill logits, bit for bit)."""
    lm, fused = load_lm(FIXTURES / name), load_lm(FIXTURES / name, kernels="fused")
    n = lm.cfg.depth  # one slot per op per layer (the q / k norms share the layer's rms_norm slot)
    attention = {"native" if torch_cpu.loads() else "sdpa": n}
    assert lm.describe()["kernels"] == "aten"
    auto = lm.describe()["ops"]
    assert auto.pop("decode_attention") == attention and all(set(c) == {"aten"} for c in auto.values())
    assert fused.describe()["ops"] == {"add_rms_norm": {"fused": n}, "rms_norm": {"fused": n + 1},
                                       "rope_qkv": {"fused": n}, "silu_mul": {"fused": n},
                                       "token_rope": {"fused": n}, "decode_attention": attention}
    tokens = torch.arange(7)[None] % lm.cfg.vocab_size
    rope = gather_rope(lm.rope, torch.arange(7)[None], lm.dtype)
    with torch.no_grad():
        h = [m.module.hidden(tokens, rope, m.kv, 0, causal_bias(7, lm.dtype, "cpu")) for m in (lm, fused)]
    assert torch.equal(h[0], h[1]) and torch.equal(lm.kv.k, fused.kv.k)
    with pytest.raises(ConfigError, match="kernels="):
        load_lm(FIXTURES / name, kernels="triton")
