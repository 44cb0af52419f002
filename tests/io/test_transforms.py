"""flashrt/io/transforms.py: weight-norm folding against torch's own weight norm, shape transforms."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from flashrt.io import transforms as T


def _randomize_g(g: torch.Tensor) -> None:
    with torch.no_grad():
        g.copy_(torch.rand_like(g) + 0.5)  # weight_norm initializes g = ||v||, which would hide bugs


@pytest.mark.parametrize("make", [lambda: nn.Conv1d(6, 8, 5), lambda: nn.ConvTranspose1d(6, 8, 4, stride=2),
                                  lambda: nn.Linear(7, 3)])
@pytest.mark.parametrize("dim", [0, 1, None])
def test_fold_matches_parametrizations_weight_norm(make, dim):
    torch.manual_seed(0)
    m = parametrizations.weight_norm(make(), dim=dim)
    g, v = m.parametrizations.weight.original0, m.parametrizations.weight.original1
    _randomize_g(g)
    folded = T.fold_weight_norm(g.detach(), v.detach(), dim=dim)
    ref = m.weight.detach()
    assert folded.shape == v.shape
    assert torch.equal(folded, ref)  # same op as torch's, same float32 inputs: bit-identical
    others = [d for d in range(v.dim()) if d != dim] if dim is not None else list(range(v.dim()))
    explicit = g.detach() * v.detach() / v.detach().pow(2).sum(others, keepdim=True).sqrt()
    torch.testing.assert_close(folded, explicit, rtol=1e-6, atol=1e-7)  # the textbook formula


@pytest.mark.parametrize("make", [lambda: nn.Conv1d(4, 5, 3), lambda: nn.ConvTranspose1d(5, 4, 3)])
def test_fold_matches_legacy_weight_norm_default_dim(make):
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        m = nn.utils.weight_norm(make())  # default dim=0, also for ConvTranspose1d
    _randomize_g(m.weight_g)
    m(torch.randn(1, m.in_channels, 6))  # the forward pre-hook recomputes m.weight from g, v
    assert m.weight_g.shape[0] == m.weight.shape[0] and m.weight_g.shape[1:] == (1, 1)
    folded = T.weight_norm()(m.weight_g.detach(), m.weight_v.detach())
    assert torch.equal(folded, m.weight.detach())


def test_fold_half_precision_computes_in_float32():
    torch.manual_seed(2)
    g, v = torch.rand(8, 1, 1) + 0.5, torch.randn(8, 4, 3)
    ref = T.fold_weight_norm(g, v)
    half = T.fold_weight_norm(g.to(torch.bfloat16), v.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), ref, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_fold_wrong_g_shape_raises(device):
    g, v = torch.ones(3, 1, device=device), torch.ones(4, 2, 5, device=device)
    msg = r"does not fit v of shape \(4, 2, 5\) with dim=0 \(expected \(4, 1, 1\)\)"
    with pytest.raises(ValueError, match=msg):
        T.fold_weight_norm(g, v)


def test_fold_accepts_flat_g_and_1d_v():
    v = torch.tensor([3.0, -4.0])
    torch.testing.assert_close(T.fold_weight_norm(torch.tensor([2.0, 2.0]), v), torch.tensor([2.0, -2.0]))
    g, v = torch.rand(4) + 0.5, torch.randn(4, 2, 3)
    torch.testing.assert_close(T.fold_weight_norm(g, v), T.fold_weight_norm(g.reshape(4, 1, 1), v))


def test_shape_transforms():
    x = torch.arange(24.0).reshape(2, 3, 4)
    assert T.transpose()(x).shape == (3, 2, 4)
    assert T.transpose(1, 2)(x).shape == (2, 4, 3)
    assert T.permute(2, 0, 1)(x).shape == (4, 2, 3)
    assert T.reshape(6, 4)(x).shape == (6, 4)
    assert T.concat(1)(x, x).shape == (2, 6, 4)
    torch.testing.assert_close(T.split(1, 2, dim=2)(x), x[:, :, 2:])
    assert T.to_dtype(torch.float16)(x).dtype == torch.float16
    chained = T.chain(T.concat(0), T.transpose(0, 2))(x, x)
    torch.testing.assert_close(chained, torch.cat([x, x]).transpose(0, 2))


def test_transforms_have_readable_reprs():
    assert repr(T.split(0, 3)) == "split(index=0, n=3, dim=0)"
    assert T.transpose(0, 1) == T.transpose()
