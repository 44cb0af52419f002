"""attend (grouped queries folded into SDPA), key-padding biases, StaticKV."""

import pytest
import torch

from flashrt.nn.attention import BIAS_ALIGN, StaticKV, aligned_keys, attend, key_padding_bias, mask_value
from flashrt.runtime.buffers import Buffers, BufferSpec
from flashrt.runtime.graphs import get_backend


def _naive(q, k, v, valid=None):
    """Per-head softmax attention with K/V heads repeated, masked keys removed (float64)."""
    b, n, h, d = q.shape
    g = h // k.shape[1]
    kk = k.repeat_interleave(g, dim=1).double()
    vv = v.repeat_interleave(g, dim=1).double()
    s = q.transpose(1, 2).double() @ kk.transpose(-1, -2) / d**0.5
    if valid is not None:
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    return (s.softmax(-1) @ vv).transpose(1, 2).reshape(b, n, h * d)


@pytest.mark.parametrize("heads,kv_heads", [(8, 1), (8, 2), (4, 4)])
def test_attend_matches_naive_grouped_attention(heads, kv_heads):
    torch.manual_seed(heads + kv_heads)
    b, n, s, d = 2, 5, 9, 16
    q = torch.randn(b, n, heads, d)
    k, v = torch.randn(b, kv_heads, s, d), torch.randn(b, kv_heads, s, d)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, 4:] = False
    out = attend(q, k, v, key_padding_bias(valid, torch.float32))
    assert out.shape == (b, n, heads * d)
    assert torch.allclose(out.double(), _naive(q, k, v, valid), atol=1e-5)
    assert torch.allclose(attend(q, k, v).double(), _naive(q, k, v), atol=1e-5)


def test_masked_keys_have_no_influence():
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 3, 8, 4), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
    valid = torch.tensor([[True, True, True, False, False, True]])
    bias = key_padding_bias(valid, torch.float32)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 3:5] = 1e3
    v2[:, :, 3:5] = -1e3
    assert torch.allclose(attend(q, k, v, bias), attend(q, k2, v2, bias), atol=1e-6)


def test_all_keys_masked_gives_finite_uniform_average():
    q, k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    out = attend(q, k, v, key_padding_bias(torch.zeros(1, 5, dtype=torch.bool), torch.float32))
    assert torch.isfinite(out).all()
    assert torch.allclose(out[0, 0, :4], v[0, 0].mean(0), atol=1e-5)


def test_key_padding_bias_values():
    bias = key_padding_bias(torch.tensor([[True, False]]), torch.bfloat16)
    assert bias.shape == (1, 1, 1, 2) and bias.dtype == torch.bfloat16
    assert bias[0, 0, 0, 0] == 0 and bias[0, 0, 0, 1] < -1e38
    assert mask_value(torch.float16) > torch.finfo(torch.float16).min  # finite headroom


def test_static_kv_write_read_and_bounds():
    k = torch.zeros(2, 1, 1, 5, 4)
    kv = StaticKV(k, torch.zeros_like(k))
    new = torch.arange(8.0).view(1, 2, 1, 4)
    kv.write(1, 3, new, -new)
    keys, values = kv.read(1, 5)
    assert keys.data_ptr() == k[1].data_ptr()  # a view into the static buffer, no copy
    assert torch.equal(keys[0, 0, 3:], new[0, :, 0]) and torch.equal(values[0, 0, 3:], -new[0, :, 0])
    assert torch.equal(k[0], torch.zeros_like(k[0]))
    with pytest.raises(ValueError, match="exceed"):
        kv.write(0, 4, new, new)
    with pytest.raises(ValueError, match="one shape"):
        StaticKV(k, torch.zeros(2, 1, 1, 4, 4))


def test_mask_and_attention_capture_without_host_sync():
    specs = [BufferSpec("valid", (2, 6), torch.bool), BufferSpec("q", (2, 3, 8, 4), torch.float32),
             BufferSpec("k", (2, 1, 6, 4), torch.float32), BufferSpec("v", (2, 1, 6, 4), torch.float32),
             BufferSpec("out", (2, 3, 32), torch.float32, role="output")]
    bufs = Buffers(specs)
    torch.manual_seed(4)
    inputs = {"valid": torch.rand(2, 6) > 0.3, "q": torch.randn(2, 3, 8, 4), "k": torch.randn(2, 1, 6, 4),
              "v": torch.randn(2, 1, 6, 4)}
    bufs.populate(inputs)

    def fn():
        bias = key_padding_bias(bufs["valid"], torch.float32)
        bufs["out"].copy_(attend(bufs["q"], bufs["k"], bufs["v"], bias))

    graph = get_backend("trace").capture(fn, bufs)
    inputs["valid"] = torch.tensor([[True] * 6, [True, False] * 3])
    bufs.populate(inputs)
    graph.replay()
    want = attend(inputs["q"], inputs["k"], inputs["v"], key_padding_bias(inputs["valid"], torch.float32))
    assert torch.equal(bufs["out"], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("keys,extra", [(7, 0), (8, 0), (560, 51), (712, 50), (1, 0), (3, 13)])
def test_key_padding_bias_rows_are_a_multiple_of_8_apart_and_hold_the_same_values(dtype, keys, extra):
    """Rows padded at allocation (memory-efficient attention would pad them again on every call); the
    values are those of the plain (B, 1, 1, S) bias, bit for bit; every key-dim slice stays aligned."""
    valid = torch.rand(3, keys, generator=torch.Generator().manual_seed(keys)) > 0.4
    bias = key_padding_bias(valid, dtype, always_valid=extra)
    full = torch.cat([valid, valid.new_ones(3, extra)], dim=1)
    plain = torch.where(full, torch.zeros((), dtype=dtype), torch.full((), mask_value(dtype), dtype=dtype))
    assert bias.shape == (3, 1, 1, keys + extra) and torch.equal(bias, plain[:, None, None, :])
    assert bias.stride(0) == aligned_keys(keys + extra) < keys + extra + BIAS_ALIGN
    for end in (1, keys, keys + extra):  # what torch's memory-efficient attention takes without a pad
        view = bias[..., :end]
        assert view.stride(-1) == 1 and all(s % BIAS_ALIGN == 0 for s in view.stride()[:-1])
    row = bias.as_strided((3, bias.stride(0)), (bias.stride(0), 1))
    assert (row[:, keys + extra:] == mask_value(dtype)).all()  # the padded keys are masked
