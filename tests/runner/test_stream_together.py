"""Several streams of one vocoder decoded together (`StreamRunner.decode_together`): windows of one
length stacked as rows of one replay give each stream exactly its audio alone; a lone window replays
the one-row graph; with ``stack_windows`` only the stream window's bucket is captured at more rows."""

from pathlib import Path

import pytest
import torch

import flashrt

SNAC = Path(__file__).resolve().parents[1] / "fixtures" / "tts" / "orpheus_tiny" / "snac"


def _codes(voc, frames, seed):
    g = torch.Generator().manual_seed(seed)
    inputs = voc.frontend.signature.inputs
    return [torch.randint(0, s.high + 1, (1, frames * s.rate), generator=g) for s in inputs]


def _chunks(voc, codes, frames):
    rates = [s.rate for s in voc.frontend.signature.inputs]
    return [tuple(c[..., i * r:(i + 1) * r] for c, r in zip(codes, rates)) for i in range(frames)]


@pytest.mark.parametrize("backend,grow", [("eager", None), ("trace", None), ("eager", 8), ("trace", 8)])
def test_streams_decoded_together_equal_each_alone(backend, grow, one_thread):
    """``grow``: windows growing from 4 frames to 8 (each graph backend bucket holds every window size)."""
    alone = flashrt.load_vocoder(SNAC, backend=backend, stream_chunk=4, max_stream_chunk=grow)
    together = flashrt.load_vocoder(SNAC, backend=backend, stream_chunk=4, max_stream_chunk=grow, batch=4,
                                    stack_windows=True)
    if grow:
        assert set(together.stream_windows) <= set(together.buckets) and len(together.stream_windows) == 2
    lengths = (12, 7, 12) if grow is None else (30, 7, 30)  # windows of one length stack, the rest alone
    codes = [_codes(alone, n, seed) for seed, n in enumerate(lengths)]
    want = [torch.cat(list(alone.stream(_chunks(alone, c, n))), -1) for c, n in zip(codes, lengths)]
    streams = [together.open() for _ in lengths]
    chunks = [_chunks(together, c, n) for c, n in zip(codes, lengths)]
    for i in range(max(lengths)):
        for st, ch in zip(streams, chunks):
            if i < len(ch):
                st.feed(ch[i])
            elif not st.closing:
                st.finish()
        together.decode_together(streams)
    for st in streams:
        st.finish()
    together.decode_together(streams)
    for st, w in zip(streams, want):
        got = torch.cat(st.take(), -1)
        assert got.shape == w.shape
        if backend == "trace":
            assert torch.equal(got, w)
        else:
            torch.testing.assert_close(got, w, atol=1e-5, rtol=0)


def test_a_lone_window_replays_one_row_and_long_buckets_stay_one_row(one_thread):
    voc = flashrt.load_vocoder(SNAC, backend="trace", stream_chunk=4, batch=4, stack_windows=True)
    fe = voc.frontend
    window = voc.stream_window
    assert fe.row_buckets == (1, 2, 4) and fe.graphs is fe.row_sets[1]
    assert all(b <= max(window, fe.buckets[0]) for r in (2, 4) for b in fe.row_sets[r].buckets)
    assert fe.row_sets[1].buckets == list(fe.buckets)
    used = []
    for rows, gs in fe.row_sets.items():
        gs.replay = (lambda inner, r: lambda bucket: used.append(r) or inner(bucket))(gs.replay, rows)
    alone = torch.cat(list(voc.stream(_chunks(voc, _codes(voc, 9, 1), 9))), -1)
    assert alone.shape[-1] > 0 and set(used) == {1}  # one stream's windows compute one row, not four
    assert fe.max_rows(window) == 4 and fe.max_rows(fe.buckets[-1]) == 1
    # one-shot of a long signal at 4 rows: only one-row graphs hold that length
    long_codes = [torch.cat([c] * 2) for c in _codes(voc, 200, 2)]
    with pytest.raises(flashrt.InputError, match="stack"):
        voc(*long_codes)
