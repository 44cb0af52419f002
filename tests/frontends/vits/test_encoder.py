"""The time-major text encoder (flashrt/frontends/vits/encoder.py) against the conv form of `TextEncoder`,
padded bucket included."""

from dataclasses import replace

import pytest
import torch

from flashrt.frontends.vits.config import PRESETS
from flashrt.frontends.vits.modules import TextEncoder, relative_index

pytestmark = pytest.mark.usefixtures("one_thread")


def _module(cfg, seed: int = 0):
    torch.manual_seed(seed)
    module = TextEncoder(cfg)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    return module


@pytest.mark.parametrize("window", [2, 4])
def test_packed_encoder_matches_the_conv_form(window):
    cfg = replace(PRESETS["tiny"], window_size=window)
    enc = _module(cfg)
    p, real = 23, 17
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, cfg.n_vocab, (1, p), generator=gen)
    mask = torch.ones(1, 1, p)
    mask[..., real:] = 0
    index = relative_index(p, window)
    with torch.no_grad():
        want = enc(ids, mask, index)
        enc.pack()
        assert enc.packed is not None
        got = enc(ids, mask, index)
        ids2 = ids.clone()
        ids2[:, real:] = 3  # other ids in the padding change nothing real
        again = enc(ids2, mask, index)
        short = enc(ids[:, :real], torch.ones(1, 1, real), relative_index(real, window))  # unpadded
    assert want[1].abs().max() > 0.1
    for w, g, a, s in zip(want, got, again, short):
        assert g.shape == w.shape
        assert (g - w)[..., :real].abs().max() <= 1e-5
        assert (a - g)[..., :real].abs().max() <= 1e-5
        assert (s - g[..., :real]).abs().max() <= 1e-5


def test_packed_prior_exports_to_onnxruntime():
    """The packed forms record as plain ops: a tiny voice on the onnxrt backend (every stage exported and
    run by onnxruntime) gives the eager audio. The band was once an in-place strided write, which the
    ONNX conversion refused."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from support.vits import tiny_state

    from flashrt.frontends.vits.frontend import VitsFrontend
    from flashrt.frontends.vits.model import load_weights

    cfg = PRESETS["tiny"]
    prior, dec = load_weights(tiny_state(), cfg, conv="direct")
    kw = {"phoneme_buckets": (16,), "frame_buckets": (64,), "window_buckets": (24,)}
    ids = [1, 5, 7, 3, 9, 12, 2, 30, 4, 0, 11]
    out = []
    with torch.no_grad():
        for backend in ("eager", "onnxrt"):
            fe = VitsFrontend(cfg, prior, dec, backend=backend, **kw)
            bucket, checked = fe.check(ids, 0.0, 1.0, 0.0)
            fe.write(bucket, checked)
            fe.replay(bucket)
            plan = fe.expand(checked)
            fe.flow(plan)
            out.append(fe.read(plan))
    assert out[0].abs().max() > 0.01
    assert out[1].shape == out[0].shape and (out[1] - out[0]).abs().max() <= 1e-5
