"""flashrt.runtime.numerics: what a step pins on a GPU, scoped to the step, the caller's flags restored.

The flags are process-wide torch settings that a CPU build holds too, so the scope's set / restore
logic is checked here without a GPU; what a CUDA step then runs is checked by the GPU tests (skipped).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from flashrt.errors import ConfigError
from flashrt.runtime.numerics import Numerics, sdpa_backends

NEW_API = hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision")


def _tf32() -> tuple:
    """The TF32 switches as this torch reads them without mixing APIs (True: TF32 allowed)."""
    if NEW_API:
        return (torch.backends.cuda.matmul.fp32_precision == "tf32",
                torch.backends.cudnn.conv.fp32_precision == "tf32")
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def _flags() -> tuple:
    return (*_tf32(),
            torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
            tuple(torch._C._get_sdp_priority_order()))


@pytest.fixture
def caller_flags():
    """The caller's own settings (TF32 on, as some training scripts leave it), restored after the test."""
    if NEW_API:
        saved = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
        torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "tf32"
        yield _flags()
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    yield _flags()
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.skipif(not NEW_API, reason="torch without the fp32_precision API")
@pytest.mark.parametrize("tf32", [False, True])
def test_a_caller_on_the_new_fp32_precision_api_keeps_working(caller_flags, tf32):
    """torch >= 2.9: once a caller set ``fp32_precision``, reading the legacy ``allow_tf32`` raises; the
    scope must use the new API and restore the caller's strings."""
    with Numerics(tf32=tf32).scope("cuda"):
        assert _tf32() == (tf32, tf32)
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cudnn.conv.fp32_precision == "tf32"


@pytest.mark.parametrize("kwargs, match", [({"tf32": 1}, "tf32 must be"),
                                           ({"sdpa": ("flash", "xformers")}, "sdpa backends"),
                                           ({"sdpa": ()}, "sdpa backends")])
def test_bad_settings_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Numerics(**kwargs)


def test_backend_names_map_to_torchs_members_in_order():
    assert sdpa_backends(("math", "flash")) == [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]


def test_cuda_scope_pins_then_restores_the_callers_flags(caller_flags):
    numerics = Numerics(tf32=False, sdpa=("efficient", "math"))
    with numerics.scope("cuda"):
        inside = _flags()
    assert inside[:2] == (False, False)                                  # IEEE float32 GEMMs and convs
    assert inside[2:6] == (False, True, False, True)                     # only the pinned backends
    order = inside[6]
    assert order.index(int(SDPBackend.EFFICIENT_ATTENTION)) < order.index(int(SDPBackend.MATH))
    assert _flags() == caller_flags


def test_scope_restores_on_an_exception(caller_flags):
    with pytest.raises(RuntimeError, match="boom"), Numerics(tf32=False, sdpa=("math",)).scope("cuda:0"):
        assert _tf32() == (False, False)
        raise RuntimeError("boom")
    assert _flags() == caller_flags


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_scope_is_empty_off_cuda(caller_flags, device):
    with Numerics(tf32=False, sdpa=("math",)).scope(device):
        assert _flags() == caller_flags


def test_no_sdpa_pin_leaves_torchs_choice(caller_flags):
    with Numerics(tf32=True).scope("cuda"):
        assert _flags()[2:] == caller_flags[2:]
    assert Numerics(tf32=True).describe() == {"tf32": True, "sdpa": None}


# ------------------------------------------------------------------------------- on a GPU (skipped here)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_each_sdpa_backend_on_pi0s_attention_shapes(backend, dtype, bias):
    """Pi0's attention as `flashrt.nn.attention.attend` calls it: every query head folded onto ONE K/V
    head ((B, 1, L*H, D) queries), a broadcast key-padding bias (B, 1, 1, S); each backend the GPU
    offers for it agrees with float64 math; one that does not support it says so (skipped)."""
    from flashrt.nn.attention import attend, key_padding_bias

    gen = torch.Generator().manual_seed(0)
    shapes = ((1, 50, 8, 64), (1, 1, 626, 64), (1, 1, 626, 64))     # expert queries, prefix + own keys
    q, k, v = (torch.randn(shape, generator=gen) for shape in shapes)
    valid = torch.ones(1, 626, dtype=torch.bool)
    valid[:, 500:576] = False                                    # padded prompt slots, as a bucket has
    ref = attend(q.double(), k.double(), v.double(), key_padding_bias(valid, torch.float64) if bias else None)
    dev = [t.to("cuda", dtype) for t in (q, k, v)]
    mask = key_padding_bias(valid.cuda(), dtype) if bias else None
    try:
        with Numerics(sdpa=(backend,)).scope("cuda"):
            out = attend(*dev, mask)
    except RuntimeError as exc:                                  # "No available kernel" for this call
        pytest.skip(f"{backend} does not run this call here: {str(exc).splitlines()[0]}")
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)
