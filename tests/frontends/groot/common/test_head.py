"""GR00T N1.7 model pieces: the key masks converted once (`key_bias`) attend exactly as bool masks do."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from flashrt.frontends.groot.common.head import key_bias
from flashrt.nn.attention import aligned_keys


@pytest.mark.parametrize("keys", [24, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_bias_attends_bit_for_bit_like_the_bool_mask_it_replaces(dtype, keys):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 32, generator=g).to(dtype) for n in (9, keys, keys))
    mask = torch.rand(1, 1, 1, keys, generator=g) > 0.5
    mask[..., 0] = True  # at least one valid key (an all-masked row is NaN either way)
    bias = key_bias(mask, dtype)
    assert bias.dtype == dtype and bias.shape == mask.shape
    assert bias.stride()[:-1] == (aligned_keys(keys),) * 3 and bias.stride(-1) == 1  # no per-call pad
    assert torch.equal(bias == 0, mask) and torch.isneginf(bias[~mask]).all()
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
