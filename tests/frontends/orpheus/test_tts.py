"""Orpheus-style TTS: parity with transformers generate + the snac package (tests/fixtures/tts, made by
gen_tts.py), stream == one-shot, bad tokens, cancel, concurrency, the family registry."""

import contextlib
import threading
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flashrt.chain import StageError
from flashrt.errors import CheckpointError, InputError
from flashrt.frontends.orpheus.layout import AudioTokenError, FrameDecoder, OrpheusLayout
from flashrt.frontends.orpheus.tts import OrpheusTTS, frame_constraint, to_pcm16
from flashrt.frontends.registry import tts_families
from flashrt.runner.tts import load_tts
from flashrt.runtime.decode import Sampling

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "tts"
CASES = (("tara", "Hello there."), ("leo", "A much longer sentence, so the prompt lands in another bucket."))
GREEDY = Sampling()


@pytest.fixture(scope="module")
def io():
    return load_file(FIXTURES / "orpheus_tiny_io.safetensors")


@pytest.fixture(scope="module")
def tts(one_thread):
    model = load_tts(FIXTURES / "orpheus_tiny", max_new_tokens=400, cache_len=512)
    assert isinstance(model, OrpheusTTS)
    yield model
    model.close()


def _reference(io, i):
    return io[f"audio.{i}"][0].numpy()


def test_prompt_follows_orpheus_template(tts, io):
    for i, (voice, text) in enumerate(CASES):
        assert tts.prompt_ids(text, voice) == io[f"prompt.{i}"].tolist()


@pytest.mark.parametrize("i", range(len(CASES)))
def test_greedy_audio_matches_transformers_and_snac(tts, io, i):
    voice, text = CASES[i]
    audio = tts(text, voice=voice, sampling=GREEDY)
    assert audio.dtype == np.float32 and audio.shape == _reference(io, i).shape
    np.testing.assert_allclose(audio, _reference(io, i), atol=1e-4, rtol=0)
    assert tts.report()["tokens"] == io[f"tokens.{i}"].numel() and tts.report()["finish"] == "stop"


def test_stream_concatenates_to_the_one_shot_audio_without_recapture(tts, io):
    voice, text = CASES[0]
    one_shot = tts(text, voice=voice, sampling=GREEDY)
    captures = tts.decoder.report()["captures"]
    chunks = list(tts.stream(text, voice=voice, sampling=GREEDY))
    assert len(chunks) > 2
    np.testing.assert_allclose(np.concatenate(chunks), one_shot, atol=1e-5, rtol=0)
    report = tts.report()
    assert report["ttfa_ms"] is not None and report["rtf"] > 0
    assert set(report["stages"]) == {"lm", "snac"}
    # 4 prompt buckets + 2 modes x batch buckets (1, 2, 4, 8) x key buckets (128, 256, 512): all at
    # load, none since
    assert tts.decoder.key_buckets == (128, 256, 512)
    assert tts.decoder.report()["captures"] == captures == 4 + 2 * 5 * 3  # prompts + modes x batch x keys
    pcm = np.concatenate(list(tts.stream(text, voice=voice, sampling=GREEDY, format="pcm16")))
    assert pcm.dtype == np.int16 and np.array_equal(pcm, to_pcm16(one_shot))


def test_async_stream_equals_the_sync_stream(tts, io):
    import asyncio

    async def collect():
        return [c async for c in tts.astream(CASES[1][1], voice=CASES[1][0], sampling=GREEDY)]

    np.testing.assert_allclose(np.concatenate(asyncio.run(collect())), _reference(io, 1), atol=1e-4, rtol=0)


def test_sampled_speech_is_reproducible_per_seed(tts):
    sampled = Sampling(temperature=0.7, top_p=0.9, repetition_penalty=1.1)
    tokens = []
    for seed in (3, 3):
        with contextlib.suppress(StageError):  # a sampled token off the layout ends it, reproducibly too
            tts("Hi.", seed=seed, sampling=sampled)
        tokens.append(list(tts.decoder.last.tokens))
    assert tokens[0] == tokens[1] and tokens[0]


def test_a_bad_token_ends_the_stream_naming_the_stage_and_the_next_request_is_fine(tts, io, monkeypatch):
    good = io["tokens.0"].tolist()

    step = tts.decoder.step

    def bad_step(blocks=1):  # a text token where an audio code must come, after 28 good tokens
        seats = step(blocks)
        for seat in seats:
            if len(seat.generation.tokens) == 28 and seat.new:
                seat.new.append(5)
        return seats

    with monkeypatch.context() as patch:
        patch.setattr(tts.decoder, "step", bad_step)
        with pytest.raises(StageError) as err:
            list(tts.stream(CASES[0][1], voice=CASES[0][0], sampling=GREEDY))
    assert err.value.stage == "lm" and isinstance(err.value.original, AudioTokenError)
    assert "token 5 at audio position 28" in str(err.value)
    assert good[:28] == tts.decoder.last.tokens[:28] or tts.decoder.live == 0
    voice, text = CASES[0]
    np.testing.assert_allclose(tts(text, voice=voice, sampling=GREEDY), _reference(io, 0), atol=1e-4, rtol=0)


def test_cancel_mid_stream_then_the_next_request_is_correct(tts, io):
    voice, text = CASES[0]
    for _ in tts.stream(text, voice=voice, sampling=GREEDY):
        break
    np.testing.assert_allclose(np.concatenate(list(tts.stream(text, voice=voice, sampling=GREEDY))),
                               _reference(io, 0), atol=1e-4, rtol=0)


def test_eight_concurrent_requests_all_complete_with_correct_audio(tts, io):
    results = {}

    def client(k):
        voice, text = CASES[k % 2]
        results[k] = np.concatenate(list(tts.stream(text, voice=voice, sampling=GREEDY)))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == list(range(8))
    for k, audio in results.items():
        np.testing.assert_allclose(audio, _reference(io, k % 2), atol=1e-4, rtol=0)


def test_bad_requests_raise_input_errors(tts):
    bad = ({"text": ""}, {"text": "hi", "voice": ""}, {"text": "x" * 400}, {"text": "hi", "speed": 2.0})
    for kwargs in bad:
        with pytest.raises(InputError):
            tts(**kwargs)
    with pytest.raises(InputError):
        list(tts.stream("hi", format="mp3"))


def test_frame_decoder_interleaves_levels_1_2_4():
    layout = OrpheusLayout(base_vocab=100, codebook_size=10)
    dec = FrameDecoder(layout)
    frame = None
    for place, code in enumerate([1, 2, 3, 4, 5, 6, 7]):
        frame = dec.push(110 + place * 10 + code)
    assert frame == [[1], [2, 5], [3, 4, 6, 7]]
    assert dec.push(110 + 3) is None  # position 7 starts the next frame: place 0, code 3
    with pytest.raises(AudioTokenError, match="position 8 .* place 1"):
        dec.push(110 + 4)  # a place-0 code where place 1 (ids 120..129) must come


@pytest.mark.parametrize("layout", [OrpheusLayout(), OrpheusLayout(base_vocab=100, codebook_size=10)])
def test_frame_constraint_allows_exactly_the_codes_of_each_place(layout):
    """At step k only place k % 7's ids [lo, lo + codebook) survive: the last code of the place stays, one
    past it (the next place's first) and one before its first are masked."""
    constrain = frame_constraint(layout)
    logits = torch.zeros(1, layout.vocab_needed + 5)
    for step in range(2 * 7):
        kept = constrain(logits, torch.tensor([step])).isfinite()[0]
        lo = layout.audio_base + (step % 7) * layout.codebook_size
        assert kept.nonzero().flatten().tolist() == list(range(lo, lo + layout.codebook_size)), step


def test_load_tts_names_every_family_it_tried(tmp_path):
    assert "orpheus" in tts_families()
    with pytest.raises(CheckpointError, match="orpheus: .*no config.json"):
        load_tts(tmp_path)


def test_say_writes_the_wav_and_prints_ttfa_rtf_and_stages(tmp_path, io):
    from typer.testing import CliRunner

    from flashrt.cli import app

    out = tmp_path / "hello.wav"
    model = str(FIXTURES / "orpheus_tiny")
    args = ["say", CASES[0][1], "--model", model, "--speaker", CASES[0][0], "-o", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "TTFA" in result.output and "RTF" in result.output and "snac" in result.output
    with wave.open(str(out)) as w:
        assert w.getframerate() == 24000 and w.getnframes() == io["audio.0"].shape[-1]


def test_say_snac_noise_seeded_keeps_the_decoders_noise(tmp_path, capsys):
    """`--snac-noise seeded` reaches the SNAC loader: with a decoder that has noise blocks the audio
    differs from the default (noise dropped) and is the same on a second run; without noise blocks it is
    refused in one line."""
    import shutil

    from flashrt.cli import main

    model = tmp_path / "orpheus"
    shutil.copytree(FIXTURES / "orpheus_tiny", model, ignore=shutil.ignore_patterns("snac"))
    shutil.copytree(FIXTURES.parent / "vocoders" / "snac_24khz_noise_tiny", model / "snac")

    def say(name, *extra):
        out = tmp_path / f"{name}.wav"
        argv = ["say", CASES[0][1], "--model", str(model), "--seed", "0", "-o", str(out), *extra]
        assert main(argv) == 0, capsys.readouterr().err
        with wave.open(str(out)) as w:
            return w.readframes(w.getnframes())

    off, seeded = say("off"), say("seeded", "--snac-noise", "seeded")
    assert len(off) == len(seeded) and off != seeded
    assert say("again", "--snac-noise", "seeded") == seeded
    capsys.readouterr()
    argv = ["say", "hi", "--model", str(FIXTURES / "orpheus_tiny"), "--snac-noise", "seeded", "-o",
            str(tmp_path / "x.wav")]
    assert main(argv) == 2 and "noise blocks" in capsys.readouterr().err


def test_a_tokenizer_json_is_read_with_its_bos_post_processor(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from flashrt.frontends.orpheus.layout import format_prompt, load_text_tokenizer

    vocab = {"<bos>": 128000, "tara": 5, ":": 6, "hi": 7, "[UNK]": 8}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 128000)])
    tok.save(str(tmp_path / "tokenizer.json"))
    layout = OrpheusLayout()  # the released ids
    ids = format_prompt(layout, load_text_tokenizer(tmp_path, layout), "hi", "tara")
    assert ids == [128259, 128000, 5, 6, 7, 128009, 128260, 128261, 128257]


def test_the_lm_and_the_snac_decoder_can_live_in_two_folders(tmp_path, io):
    import shutil

    lm = tmp_path / "lm"
    shutil.copytree(FIXTURES / "orpheus_tiny", lm, ignore=shutil.ignore_patterns("snac"))
    with pytest.raises(CheckpointError, match="no SNAC decoder"):
        load_tts(lm, family="orpheus")
    tts = load_tts(lm, family="orpheus", snac=FIXTURES / "orpheus_tiny" / "snac", max_new_tokens=400,
                   cache_len=512)
    try:
        voice, text = CASES[0]
        audio = tts(text, voice=voice, sampling=GREEDY)
        np.testing.assert_allclose(audio, _reference(io, 0), atol=1e-4, rtol=0)
        assert tts.describe()["family"] == "orpheus"
    finally:
        tts.close()


def test_a_bfloat16_lm_speaks_the_same_frames(io):
    tts = load_tts(FIXTURES / "orpheus_tiny", precision="bf16", max_new_tokens=400, cache_len=512)
    try:
        assert tts.decoder.model.dtype == torch.bfloat16
        audio = tts(CASES[0][1], voice=CASES[0][0], sampling=GREEDY)  # margins of ~15 logits: same tokens
        assert tts.report()["tokens"] == io["tokens.0"].numel()
        np.testing.assert_allclose(audio, _reference(io, 0), atol=1e-4, rtol=0)  # SNAC stays float32
    finally:
        tts.close()


def test_the_last_partial_chunk_is_streamed(io, one_thread):
    """An utterance whose frame count is not a multiple of frames_per_chunk: the frames left over at the
    end are streamed as a last, shorter chunk, so the stream still equals the one-shot audio."""
    voice, text = CASES[0]
    frames = io["tokens.0"].numel() // 7
    per_chunk = next(k for k in range(2, 9) if frames % k)
    model = load_tts(FIXTURES / "orpheus_tiny", max_new_tokens=400, cache_len=512, frames_per_chunk=per_chunk)
    try:
        one_shot = model(text, voice=voice, sampling=GREEDY)
        chunks = list(model.stream(text, voice=voice, sampling=GREEDY))
        assert model.report()["frames"] == frames and frames % per_chunk
        np.testing.assert_allclose(np.concatenate(chunks), one_shot, atol=1e-5, rtol=0)
        np.testing.assert_allclose(one_shot, _reference(io, 0), atol=1e-4, rtol=0)
    finally:
        model.close()
