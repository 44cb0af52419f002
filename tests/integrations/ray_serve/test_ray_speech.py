"""The speech chain split at its stage boundary, without Ray: `load_orpheus(..., vocoder=False)` streams a
request's SNAC code chunks, and the vocoder stage of `flashrt.integrations.ray_serve` decodes them into
exactly the audio the whole model streams for the same request and seed (what the Ray deployments rely on)."""

from pathlib import Path

import numpy as np
import pytest

from flashrt.integrations.ray_serve import VocoderStage
from flashrt.runner.orpheus import load_orpheus

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "tts" / "orpheus_tiny"
OPTIONS = {"max_new_tokens": 200, "cache_len": 512, "slots": 2}

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def models(one_thread):
    whole, lm = load_orpheus(FIXTURE, **OPTIONS), load_orpheus(FIXTURE, vocoder=False, **OPTIONS)
    yield whole, lm, VocoderStage(str(FIXTURE), OPTIONS, 1, lm=None)
    whole.close()
    lm.close()


@pytest.mark.parametrize("text,seed", [("Hello there.", 5), ("Numbers: one, two, three.", 9)])
def test_lm_stage_codes_decode_to_the_whole_models_audio(models, text, seed):
    whole, lm, vocoder = models
    want = np.concatenate(list(whole.stream(text, voice="tara", seed=seed)))
    stream, audio = vocoder.vocoder.open(), []
    items = list(lm.chain.submit(lm.request(text, voice="tara", seed=seed)))
    assert items[-1].last and not any(item.last for item in items[:-1])
    for item in items:
        chunk = vocoder._decode(stream, item.codes, item.last)
        if chunk is not None:
            audio.append(chunk)
    assert len(audio) > 1  # streamed, not one piece
    assert np.array_equal(np.concatenate(audio), want)


def test_an_lm_only_model_loads_no_vocoder(models):
    _, lm, _ = models
    assert lm.vocoder is None and [stage.name for stage in lm.chain.stages] == ["lm"]


def test_an_lm_stage_whose_chain_closes_mid_request_raises(one_thread):
    """The lm deployment's stream, when its chain is closed under it (a replica shutting down), ends
    with an error, not as if the utterance were over (the client would take part for the whole)."""
    import asyncio

    from flashrt.integrations.ray_serve import LMStage
    from flashrt.serve.app import ServerLimits

    stage = LMStage(str(FIXTURE), OPTIONS, ServerLimits(), 1)

    async def run():
        chunks = stage.codes("Hello there.", "tara", 5, 1.0)
        got = [await asyncio.wait_for(chunks.__anext__(), 30)]
        stage.chain.close()
        async for item in chunks:
            got.append(item)
        return got

    with pytest.raises(RuntimeError, match="early"):
        asyncio.run(asyncio.wait_for(run(), 60))
    stage.chain.close()


class _Handle:
    """A stand-in for an lm deployment's handle (``handle.codes.options(stream=True).remote(...)``),
    streaming the given (codes, last) items."""

    def __init__(self, items):
        self.codes, self.items = self, items

    def options(self, stream):
        return self

    def remote(self, *args):
        return _Items(self.items)


class _Items:
    def __init__(self, items):
        self.items = list(items)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self):
        self.items = []


def test_the_vocoder_stage_refuses_a_code_stream_without_its_last_chunk(models):
    """An lm stream that stops before its last chunk (its replica gone) is an error at the vocoder,
    never a clean end of part of the audio; a whole one decodes to the whole model's audio."""
    import asyncio

    whole, lm, _ = models
    items = [(item.codes, item.last) for item in lm.chain.submit(lm.request("Hello there.", "tara", seed=5))]

    async def audio(handle):
        stage = VocoderStage(str(FIXTURE), OPTIONS, 1, lm=handle)
        return [chunk async for chunk in stage.audio("Hello there.", "tara", 5, 1.0)]

    got = asyncio.run(asyncio.wait_for(audio(_Handle(items)), 30))
    assert np.array_equal(np.concatenate(got), np.concatenate(list(whole.stream("Hello there.", "tara", 5))))
    with pytest.raises(RuntimeError, match="before the utterance's last chunk"):
        asyncio.run(asyncio.wait_for(audio(_Handle(items[:-1])), 30))


class _Paced(_Items):
    """Items handed out one per event-loop turn, so two requests' chunks arrive interleaved."""

    async def __anext__(self):
        import asyncio

        await asyncio.sleep(0)
        return await super().__anext__()


def test_the_windows_of_several_requests_are_decoded_together(models):
    """Two requests streamed by one vocoder replica at once: their steps share decodes (the windows
    due in both stacked, as the single-process snac stage does) and each request's audio is the whole
    model's for it alone, bit for bit."""
    import asyncio

    whole, lm, _ = models
    texts = {"Hello there.": 5, "Numbers: one, two, three.": 9}
    items = {text: [(i.codes, i.last) for i in lm.chain.submit(lm.request(text, "tara", seed=seed))]
             for text, seed in texts.items()}

    class Handle(_Handle):
        def remote(self, text, *args):
            return _Paced(items[text])

    stage = VocoderStage(str(FIXTURE), OPTIONS, 1, lm=Handle(None))

    async def audio(text):
        return [chunk async for chunk in stage.audio(text, "tara", texts[text], 1.0)]

    async def both():
        return await asyncio.gather(*(audio(text) for text in texts))

    got = asyncio.run(asyncio.wait_for(both(), 60))
    for text, chunks in zip(texts, got):
        want = np.concatenate(list(whole.stream(text, voice="tara", seed=texts[text])))
        assert np.array_equal(np.concatenate(chunks), want), text
    assert stage.stack and max(stage.rounds) == 2, stage.rounds  # steps of both requests in one decode
