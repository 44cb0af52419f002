"""Slot-batched decode: requests joining and leaving one captured step give the tokens they get alone
(and transformers' generate), sampled ones reproduce under any mix of neighbours; paused rows hold;
graphs are captured once; bad requests touch nothing."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashrt import ops
from flashrt.errors import ConfigError, InputError
from flashrt.frontends.lm import load_lm
from flashrt.ops import torch_cpu
from flashrt.runtime.decode import Decoder, Sampling
from flashrt.runtime.slots import SlotDecoder, SlotModel

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lm"
PENALIZED = Sampling(repetition_penalty=1.3)


def _sampled(seed: int) -> Sampling:
    return Sampling(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.3, seed=seed)


def _slots(name="qwen3_tiny", rows=8, backend=None, **kw):
    return SlotDecoder(load_lm(FIXTURES / name, batch=rows), prompt_buckets=(8, 64), max_new_tokens=48,
                       backend=backend, **kw).capture()


def _prompts(name="qwen3_tiny"):
    io = load_file(FIXTURES / f"{name}_io.safetensors")
    return [io[f"prompt.{i}"] for i in range(5)]


def _drive(dec, requests, join_every=2, blocks=3):
    """Join ``requests`` (prompt, max_new, sampling) one every ``join_every`` steps while rows are free;
    step until all are done. -> tokens per request, in order."""
    tokens, seats, waiting, t = {}, {}, list(range(len(requests))), 0
    while waiting or dec.live:
        if waiting and dec.free and t % join_every == 0:
            i = waiting.pop(0)
            prompt, n, sampling = requests[i]
            seats[i], tokens[i] = dec.join(prompt, n, sampling=sampling), []
        for seat in dec.step(blocks):
            tokens[next(i for i, s in seats.items() if s is seat)] += seat.new
        t += 1
    return [tokens[i] for i in range(len(requests))]


@pytest.fixture(scope="module")
def single(one_thread):
    return Decoder(load_lm(FIXTURES / "qwen3_tiny"), buckets=(8, 64), max_new_tokens=48).capture()


def test_the_lm_frontend_answers_the_slot_protocol():
    assert isinstance(load_lm(FIXTURES / "qwen3_tiny", batch=2), SlotModel)


@pytest.mark.parametrize("concurrent", [1, 3, 8])
def test_requests_joining_and_leaving_get_the_tokens_they_get_alone(single, concurrent):
    """Different prompts and lengths, greedy and sampled mixed, joining at different steps; the rows
    move as requests leave (packed to the front), the batch bucket goes up and down."""
    dec = _slots(rows=concurrent)
    prompts = _prompts()
    requests = [(prompts[i % 5], 6 + 5 * i, PENALIZED if i % 2 == 0 else _sampled(i)) for i in range(8)]
    alone = [list(single.generate(p, n, sampling=s)) for p, n, s in requests]
    assert _drive(dec, requests, join_every=1) == alone
    report = dec.report()
    assert report["captures"] == 2 + 2 * len(dec.batch_buckets) * len(dec.key_buckets)  # at load only
    if concurrent == 8:
        assert report["row_moves"] > 0 and {"sample@1", "sample@8"} <= set(report["decode_replays"])


def test_sampled_requests_reproduce_under_another_mix_of_neighbours():
    dec = _slots(rows=4)
    prompts = _prompts()
    mine = (prompts[2], 40, _sampled(7))
    first = _drive(dec, [mine, (prompts[0], 30, _sampled(1)), (prompts[1], 12, PENALIZED)])[0]
    second = _drive(dec, [(prompts[3], 45, PENALIZED), (prompts[4], 5, _sampled(9)), mine],
                    join_every=3, blocks=5)[2]
    assert first == second
    other = _drive(dec, [(prompts[2], 40, _sampled(8))])[0]
    assert other != first


@pytest.mark.parametrize("backend", ["eager", "jit"])
@pytest.mark.parametrize("name", ["llama_tiny", "qwen3_tiny", "qwen2_tiny"])
def test_greedy_rows_are_identical_to_transformers_generate(name, backend, one_thread):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype=torch.float32).eval()
    dec = _slots(name, rows=4, backend=backend)
    prompts = _prompts(name)
    got = _drive(dec, [(p, 40, PENALIZED) for p in prompts], join_every=1, blocks=7)
    for prompt, ours in zip(prompts, got):
        with torch.no_grad():
            out = hf.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), do_sample=False,
                              repetition_penalty=1.3, max_new_tokens=40, min_new_tokens=40, eos_token_id=None)
        assert ours == out[0, prompt.shape[-1]:].tolist()


def test_trace_replays_the_batched_steps_bit_for_bit(one_thread):
    prompts = _prompts()
    requests = [(prompts[i], 20 + 3 * i, PENALIZED if i % 2 else _sampled(i)) for i in range(5)]
    eager, traced = _slots(rows=4), _slots(rows=4, backend="trace")
    assert _drive(traced, requests) == _drive(eager, requests)
    assert torch.equal(traced.model.buffers["lm_k"], eager.model.buffers["lm_k"])


@pytest.mark.parametrize("backend", ["eager", "jit"])
def test_rows_past_the_live_ones_and_greedy_rows_never_make_a_step_rank_every_candidate(backend, one_thread):
    """Two sampled rows whose top-k fits the first ranks and a greedy one, in the batch bucket of 4 (its
    fourth row never used, its knobs zero): no step falls back to ranking every candidate, which the
    bucket's unused row and the greedy row (temperature 0: no number to rank) did at every step."""
    prompts = _prompts()
    dec = _slots(rows=8, backend=backend)
    short = Sampling(temperature=0.8, top_k=5, seed=3)
    for prompt, sampling in zip(prompts, (short, Sampling(), short)):
        dec.join(prompt, 20, sampling=sampling)
    for _ in range(5):
        dec.step(3)
        assert int(dec.io.rank_pause) == 0
    assert set(dec.report()["decode_replays"]) == {"sample@4"}


@pytest.mark.skipif(not torch_cpu.loads(), reason="the CPU torch ops do not build here")
@pytest.mark.parametrize("name", ["llama_tiny", "qwen2_tiny"])
def test_the_native_decode_attention_gives_sdpas_tokens(name, one_thread):
    """The CPU default for a float32 slot step's attention (``flashrt_cpu::decode_attention``, each row
    over its own keys) against SDPA under the rows' bias: the same tokens for greedy and sampled requests
    joining and leaving, caches within float32 rounding."""
    prompts = _prompts(name)
    requests = [(prompts[i], 20 + 3 * i, PENALIZED if i % 2 else _sampled(i)) for i in range(5)]
    sdpa_lm = load_lm(FIXTURES / name, batch=4)
    ops.select(sdpa_lm.module, "cpu", torch.float32, prefer={"decode_attention": "sdpa"})
    sdpa = SlotDecoder(sdpa_lm, prompt_buckets=(8, 64), max_new_tokens=48, backend="jit").capture()
    native = _slots(name, rows=4, backend="jit")
    depth = native.model.cfg.depth
    assert native.model.describe()["ops"]["decode_attention"] == {"native": depth}
    assert sdpa_lm.describe()["ops"]["decode_attention"] == {"sdpa": depth}
    assert _drive(native, requests) == _drive(sdpa, requests)
    torch.testing.assert_close(native.model.buffers["lm_k"], sdpa.model.buffers["lm_k"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama_tiny", "qwen3_tiny", "qwen2_tiny"])
def test_jit_replays_the_batched_steps_bit_for_bit(name, one_thread):
    """The decode steps and prefills traced into TorchScript (`flashrt.runtime.jit`): greedy and sampled
    requests joining and leaving get eager's tokens, the caches end equal, nothing is captured after
    load."""
    prompts = _prompts(name)
    requests = [(prompts[i], 20 + 3 * i, PENALIZED if i % 2 else _sampled(i)) for i in range(5)]
    eager, jit = _slots(name, rows=4), _slots(name, rows=4, backend="jit")
    assert _drive(jit, requests) == _drive(eager, requests)
    assert torch.equal(jit.model.buffers["lm_k"], eager.model.buffers["lm_k"])
    assert jit.report()["captures"] == 2 + 2 * len(jit.batch_buckets) * len(jit.key_buckets)
    assert jit.backend.name == "jit"


@pytest.mark.parametrize("backend", ["eager", "jit"])
def test_steps_attend_to_the_key_bucket_in_use_with_the_tokens_of_the_whole_cache(single, backend):
    """Each block attends to the smallest key bucket holding the slots it writes (rows leave and the
    bucket shrinks, a long row grows it): greedy and sampled requests get the tokens they get alone,
    where every step attends to the whole cache; a freed row past the live ones never writes past
    the bucket (its slot is reset)."""
    dec = _slots(rows=4, backend=backend, key_buckets=(24, 40, 56, 80))
    assert dec.key_buckets == (24, 40, 56, 80, dec.model.cache_len)
    prompts = _prompts()
    requests = [(prompts[i % 5], 10 + 7 * i, PENALIZED if i % 2 == 0 else _sampled(i)) for i in range(6)]
    alone = [list(single.generate(p, n, sampling=s)) for p, n, s in requests]
    assert _drive(dec, requests, join_every=2, blocks=4) == alone
    assert len(dec.report()["key_replays"]) >= 3


def test_a_row_freed_past_the_live_ones_is_computed_inside_the_key_bucket(single):
    """The last row leaves at the furthest slot while three stay, far behind: the batch bucket of four
    still computes it, and the smaller key bucket the three need must hold its write (its slot is
    reset when it is freed; it was left where it stopped, past the bucket)."""
    dec = _slots(rows=4, key_buckets=(8, 16, 24, 32, 48))
    prompts = _prompts()
    short = [dec.join(prompts[0], 30), dec.join(prompts[1], 30),
             dec.join(prompts[0], 30, sampling=_sampled(2))]
    far = dec.join(prompts[4], 2)  # 40 prompt tokens: slot 41 when it stops
    got = {seat: [] for seat in short}
    while not far.done:
        for seat in dec.step(1):
            got.setdefault(seat, []).extend(seat.new)
    assert dec.live == 3 and far.row == -1
    while dec.live:
        for seat in dec.step(2):
            got[seat] += seat.new
    assert set(dec.report()["key_replays"]) & {8, 16}  # the three alone fit a bucket below slot 41
    for seat, (prompt, sampling) in zip(short, [(prompts[0], None), (prompts[1], None),
                                                (prompts[0], _sampled(2))]):
        assert got[seat] == list(single.generate(prompt, 30, sampling=sampling or Sampling()))


def test_a_paused_row_holds_its_place_and_its_tokens_do_not_change(single):
    dec = _slots(rows=2)
    prompts = _prompts()
    a, b = dec.join(prompts[0], 30, sampling=_sampled(3)), dec.join(prompts[1], 30, sampling=PENALIZED)
    got = {a: [], b: []}
    for round_ in range(12):
        dec.pause(a, 3 <= round_ < 8)  # a waits five steps while b goes on
        held = a.produced
        for seat in dec.step(3):
            got[seat] += seat.new
        if 3 <= round_ < 8:
            assert a.produced == held
    while dec.live:
        dec.pause(a, False)
        for seat in dec.step(3):
            got[seat] += seat.new
    assert got[a] == list(single.generate(prompts[0], 30, sampling=_sampled(3)))
    assert got[b] == list(single.generate(prompts[1], 30, sampling=PENALIZED))


def test_stop_tokens_end_a_row_and_a_leaving_request_frees_it(single):
    dec = _slots(rows=2)
    prompts = _prompts()
    full = list(single.generate(prompts[0], 30))
    stop = full[9]
    a = dec.join(prompts[0], 30, stop=[stop])
    b = dec.join(prompts[1], 30)
    got = []
    while not a.done:
        got += next((s.new for s in dec.step(4) if s is a), [])
    assert got == full[:full.index(stop)] and a.finish == "stop" and dec.live == 1
    dec.leave(b)
    assert dec.live == 0 and b.finish == "left" and dec.free == 2


def test_bad_requests_raise_before_anything_is_written_and_a_full_decoder_refuses(single):
    dec = _slots(rows=2)
    prompts = _prompts()
    a = dec.join(prompts[0], 20)
    before = {k: t.clone() for k, t in dec.graph_buffers.tensors.items()}
    for bad in ([600], [], [[1.5]], list(range(65))):
        with pytest.raises(InputError):
            dec.join(bad, 5)
    with pytest.raises(InputError):
        dec.join(prompts[1], 49)
    with pytest.raises(InputError):
        dec.join(prompts[1], 5, sampling=Sampling(top_p=0.0))
    assert all(torch.equal(before[k], t) for k, t in dec.graph_buffers.tensors.items())
    dec.join(prompts[1], 5)
    with pytest.raises(ConfigError, match="rows"):
        dec.join(prompts[2], 5)
    got = []
    while not a.done:
        got += next((s.new for s in dec.step(5) if s is a), [])
    assert got == list(single.generate(prompts[0], 20))


def test_batch_buckets_always_end_with_the_row_count():
    dec = SlotDecoder(load_lm(FIXTURES / "qwen3_tiny", batch=6), prompt_buckets=(8,), max_new_tokens=4,
                      batch_buckets=(1, 4, 16))
    assert dec.batch_buckets == (1, 4, 6)
