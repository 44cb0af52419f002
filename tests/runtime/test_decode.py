"""AR decode runner: one decode step captured once, trace replay bit for bit, device sampling, refusals."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashrt.errors import InputError
from flashrt.frontends.lm import load_lm
from flashrt.runtime.decode import DecodeModel, Decoder, Sampling
from flashrt.runtime.sampling import hashed_uniform, sample_token

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lm"
SAMPLED = Sampling(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.3, seed=11)


def _decoder(backend=None, name="qwen3_tiny"):
    return Decoder(load_lm(FIXTURES / name), buckets=(8, 64), max_new_tokens=48, backend=backend).capture()


@pytest.fixture(scope="module")
def prompt():
    return load_file(FIXTURES / "qwen3_tiny_io.safetensors")["prompt.2"]


@pytest.fixture(scope="module")
def eager(one_thread):
    return _decoder()


def test_the_lm_frontend_answers_the_decode_protocol(eager):
    assert isinstance(eager.model, DecodeModel)


@pytest.mark.parametrize("sampling", [Sampling(), SAMPLED], ids=["greedy", "sampled"])
def test_trace_replays_the_decode_step_bit_for_bit(eager, prompt, sampling):
    traced = _decoder("trace")
    assert list(traced.generate(prompt, 40, sampling=sampling)) == list(eager.generate(prompt, 40,
                                                                                        sampling=sampling))
    assert torch.equal(traced.io.logits, eager.io.logits)
    assert torch.equal(traced.model.buffers["lm_k"], eager.model.buffers["lm_k"])
    assert traced.report()["decode_captures"] == {"greedy": 1, "sample": 1}


def test_sampling_is_reproducible_per_seed(eager, prompt):
    first = list(eager.generate(prompt, 40, sampling=SAMPLED))
    assert list(eager.generate(prompt, 40, sampling=SAMPLED)) == first
    other = Sampling(**{**SAMPLED.__dict__, "seed": 12})
    assert list(eager.generate(prompt, 40, sampling=other)) != first
    assert first != list(eager.generate(prompt, 40))


def test_reading_in_blocks_returns_the_same_tokens(eager, prompt):
    assert list(eager.generate(prompt, 30, sync_every=7)) == list(eager.generate(prompt, 30))


def test_stop_tokens_end_the_generation_and_are_not_returned(eager, prompt):
    full = list(eager.generate(prompt, 30))
    stop = full[5]
    cut = list(eager.generate(prompt, 30, stop=[stop], sync_every=4))
    assert cut == full[:full.index(stop)] and eager.last.finish == "stop"


def test_bad_requests_raise_before_anything_is_written_and_the_next_is_fine(eager, prompt):
    good = list(eager.generate(prompt, 20))
    before = eager.io.buffers["prompt"].clone()
    for bad in ([600], [], [[1.5]], list(range(65))):
        with pytest.raises(InputError):
            list(eager.generate(bad, 5))
    with pytest.raises(InputError):
        list(eager.generate(prompt, 49))
    with pytest.raises(InputError):
        list(eager.generate(prompt, 5, sampling=Sampling(top_p=0.0)))
    assert torch.equal(eager.io.buffers["prompt"], before)
    assert list(eager.generate(prompt, 20)) == good


def test_top_k_one_is_greedy_and_the_noise_is_uniform():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(0))
    one = torch.tensor([1])
    for step in range(5):
        picked = sample_token(logits, torch.tensor([2.0]), one, torch.tensor([1.0]), torch.tensor([3]),
                              torch.tensor([step]))
        assert picked.item() == logits.argmax().item()
    u = hashed_uniform(torch.tensor([5]), torch.tensor([0]), 100_000)
    assert u.min() > 0 and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01


def test_graphs_are_captured_against_the_models_own_buffers_too():
    """JoinedBuffers: the step buffers and the model's (K/V cache) as one live named set; clashes refused."""
    from flashrt.errors import ConfigError
    from flashrt.runtime.buffers import Buffers, BufferSpec
    from flashrt.runtime.decode import JoinedBuffers

    step = Buffers([BufferSpec("token", (1, 1), torch.int64, "state")])
    model = Buffers([BufferSpec("lm_k", (2, 3), torch.float32, "state")])
    joined = JoinedBuffers(step, model, None)
    assert set(joined.tensors) == {"token", "lm_k"}
    moved = torch.zeros(2, 3)
    model.tensors["lm_k"] = moved
    assert joined.tensors["lm_k"] is moved  # live: a replaced buffer is seen (and guarded)
    with pytest.raises(ConfigError, match="token"):
        JoinedBuffers(step, Buffers([BufferSpec("token", (1,), torch.int64, "state")]))


@pytest.mark.parametrize("name", ["llama_tiny", "qwen3_tiny", "qwen2_tiny"])
def test_greedy_with_repetition_penalty_is_identical_to_transformers_generate(name, one_thread):
    """The penalty covers the prompt's tokens and every output token (transformers' generate(), greedy,
    repetition_penalty=1.3): ids identical; and the penalty changes the path, so it is exercised."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype=torch.float32).eval()
    dec = Decoder(load_lm(FIXTURES / name), buckets=(8, 64), max_new_tokens=40).capture()
    io = load_file(FIXTURES / f"{name}_io.safetensors")
    changed = 0
    for i in range(5):
        prompt = io[f"prompt.{i}"]
        ours = list(dec.generate(prompt, 40, sampling=Sampling(repetition_penalty=1.3)))
        with torch.no_grad():
            out = hf.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), do_sample=False,
                              repetition_penalty=1.3, max_new_tokens=40, min_new_tokens=40, eos_token_id=None)
        assert ours == out[0, prompt.shape[-1]:].tolist(), f"prompt {i}"
        changed += ours != list(dec.generate(prompt, 40))
    assert changed >= 3


def test_the_kv_cache_holds_a_request_that_fills_it_exactly_and_refuses_one_token_more(eager, prompt):
    """Prompt + new tokens == cache_len runs (tokens as with a roomy cache); one more is an InputError
    before anything is written, and the next good call is unchanged."""
    cache_len, n = 40, prompt.shape[-1]
    small = Decoder(load_lm(FIXTURES / "qwen3_tiny", cache_len=cache_len), buckets=(16,),
                    max_new_tokens=cache_len).capture()
    fits = cache_len - n
    full = list(small.generate(prompt, fits))
    assert full == list(eager.generate(prompt, fits)) and small.last.finish == "length"
    before = {k: t.clone() for k, t in small.io.buffers.tensors.items()}
    with pytest.raises(InputError, match="fit the cache"):
        list(small.generate(prompt, fits + 1))
    assert all(torch.equal(before[k], t) for k, t in small.io.buffers.tensors.items())
    assert list(small.generate(prompt, fits)) == full
