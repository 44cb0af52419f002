"""Two threads on one vocoder: every one-shot call and every stream gets its own audio (the runner
serializes windows through the static buffers), equal to what one thread alone gets."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

import flashrt

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vocoders"


def test_threads_share_a_vocoder_without_mixing_audio(one_thread):
    voc = flashrt.load_vocoder(FIXTURES / "speecht5_hifigan_tiny", buckets=(16, 32))
    channels = voc.frontend.buffers.spec("features").shape[1]
    mels = [torch.randn(1, channels, 24, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    want_call = [voc(m) for m in mels]
    want_stream = [torch.cat(list(voc.stream(m.split(5, dim=-1))), dim=-1) for m in mels]
    wrong: list[str] = []

    def hammer(which: list[int]) -> None:
        for _ in range(8):
            for i in which:
                if not torch.equal(voc(mels[i]), want_call[i]):
                    wrong.append(f"call {i}")
                if not torch.equal(torch.cat(list(voc.stream(mels[i].split(5, dim=-1))), -1), want_stream[i]):
                    wrong.append(f"stream {i}")

    threads = [threading.Thread(target=hammer, args=(w,)) for w in ([0, 1], [2, 3])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
