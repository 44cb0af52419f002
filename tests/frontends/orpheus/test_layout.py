"""Orpheus LM token ids -> SNAC codes (flashrt/frontends/orpheus/layout.py `FrameDecoder`): at each of the 7
places of a frame the ids [lo, lo + codebook) are its codes; the edges of every place are checked (the
last code is accepted, one past it and one before the first are refused), on the released layout and on
a miniature one."""

from __future__ import annotations

import pytest

from flashrt.frontends.orpheus.layout import FRAME, AudioTokenError, FrameDecoder, OrpheusLayout

LAYOUTS = [OrpheusLayout(), OrpheusLayout(base_vocab=100, codebook_size=10)]


def _first_id(layout: OrpheusLayout, place: int) -> int:
    return layout.audio_base + place * layout.codebook_size


def _at_place(layout: OrpheusLayout, place: int) -> FrameDecoder:
    """A decoder whose next token is at ``place`` (the earlier places fed their code 0)."""
    dec = FrameDecoder(layout)
    for p in range(place):
        assert dec.push(_first_id(layout, p)) is None
    return dec


@pytest.mark.parametrize("layout", LAYOUTS, ids=["released", "miniature"])
@pytest.mark.parametrize("place", range(FRAME))
def test_the_last_code_of_each_place_is_accepted_and_one_past_it_refused(layout, place):
    last = _first_id(layout, place) + layout.codebook_size - 1
    dec = _at_place(layout, place)
    dec.push(last)
    assert dec.pending == (place + 1) % FRAME and dec.count == place + 1
    with pytest.raises(AudioTokenError, match=rf"place {place}\)"):
        _at_place(layout, place).push(last + 1)
    with pytest.raises(AudioTokenError, match=rf"place {place}\)"):
        _at_place(layout, place).push(_first_id(layout, place) - 1)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["released", "miniature"])
def test_a_frame_of_last_codes_decodes_to_the_top_code_at_every_level(layout):
    dec, top = FrameDecoder(layout), layout.codebook_size - 1
    frame = [dec.push(_first_id(layout, p) + top) for p in range(FRAME)]
    assert frame[:-1] == [None] * (FRAME - 1)
    assert frame[-1] == [[top], [top, top], [top] * 4]
    assert _first_id(layout, FRAME) == layout.vocab_needed  # one past place 6's last code: no id left
