"""flashrt/io/loading.py: the one loading path (meta build, strict map, assign, reset_derived, meta check)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from flashrt.errors import CheckpointError
from flashrt.io import Alt, Checkpoint, Rule, WeightMap, build_on_meta, load_module, transforms


class Rope(nn.Module):
    """No parameters; its table is derived, so it must be built by reset_derived on the target device."""

    def __init__(self, dim: int = 4, base: float = 100.0) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)

    def reset_derived(self) -> None:
        self.inv_freq = self.base ** (-torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.conv = nn.Conv1d(4, 6, 3)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight  # tied inside the module too
        self.rope = Rope()
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.calls: list[str] = []

    def reset_derived(self) -> None:
        self.calls.append("tiny")


def _source() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "model.tok.weight": torch.randn(5, 4, generator=g),
        "model.conv.weight_g": torch.rand(6, 1, 1, generator=g) + 0.5,
        "model.conv.weight_v": torch.randn(6, 4, 3, generator=g),
        "model.conv.bias": torch.randn(6, generator=g),
        "model.steps": torch.tensor(7, dtype=torch.int32),
    }


WMAP = WeightMap([
    Rule("tok.weight", "embed.weight"),
    Rule("tok.weight", "head.weight"),
    Rule(("conv.weight_g", "conv.weight_v"), "conv.weight", transforms.weight_norm(0)),
    Rule("conv.bias", "conv.bias"),
    Rule(Alt("steps", "num_steps"), "steps"),
]).with_prefix("model.")


def test_load_module_end_to_end():
    src = _source()
    m = load_module(Tiny, Checkpoint.from_tensors(src), WMAP)
    assert not m.training and not any(p.requires_grad for p in m.parameters())
    torch.testing.assert_close(m.embed.weight, src["model.tok.weight"], rtol=0, atol=0)
    assert m.head.weight.data_ptr() == m.embed.weight.data_ptr()
    g, v = src["model.conv.weight_g"], src["model.conv.weight_v"]
    torch.testing.assert_close(m.conv.weight, g * v / v.pow(2).sum((1, 2), keepdim=True).sqrt())
    assert m.steps.dtype == torch.int64 and m.steps.item() == 7  # cast to the module's slot dtype
    torch.testing.assert_close(m.rope.inv_freq, torch.tensor([1.0, 0.1]))
    assert m.calls == ["tiny"]
    x = torch.tensor([[0, 3, 4]])
    out = m.head(m.conv(m.embed(x).transpose(1, 2)).transpose(1, 2)[..., :4])
    assert out.shape == (1, 1, 5) and torch.isfinite(out).all()


def test_global_dtype_casts_floating_only_and_rule_dtype_wins():
    bias32 = Rule("model.conv.bias", "conv.bias", dtype=torch.float32)
    wm = WeightMap([*WMAP.rules[:3], bias32, WMAP.rules[4]])
    m = load_module(Tiny, _source(), wm, dtype=torch.bfloat16)
    assert m.embed.weight.dtype == torch.bfloat16 and m.conv.weight.dtype == torch.bfloat16
    assert m.conv.bias.dtype == torch.float32
    assert m.steps.dtype == torch.int64
    assert m.rope.inv_freq.dtype == torch.float32  # derived buffers are the module's business


def test_strict_errors_reported_together():
    src = _source()
    del src["model.conv.bias"]
    src["model.extra"] = torch.ones(1)
    src["model.tok.weight"] = torch.ones(6, 4)
    with pytest.raises(CheckpointError) as err:
        load_module(Tiny, src, WMAP)
    msg = str(err.value)
    assert "'model.conv.bias' (for slot conv.bias): not in the checkpoint" in msg and "model.extra" in msg
    assert "model.tok.weight -> embed.weight: checkpoint gives (6, 4), module expects (5, 4)" in msg


class Forgetful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("window", torch.hann_window(8), persistent=False)


def test_leftover_meta_tensor_is_named():
    src = {"lin.weight": torch.ones(2, 2), "lin.bias": torch.ones(2)}
    wm = WeightMap([Rule("lin.{p}", "lin.{p}")])
    with pytest.raises(CheckpointError, match="still on the meta device.*window.*reset_derived"):
        load_module(Forgetful, src, wm)


def test_build_on_meta_allocates_nothing():
    m = build_on_meta(lambda: nn.Linear(100_000, 100_000))  # 40 GB if it were real
    assert m.weight.is_meta
    with pytest.raises(TypeError, match="nn.Module"):
        build_on_meta(lambda: 3)


def test_reset_derived_children_first():
    order: list[str] = []

    class Leaf(nn.Module):
        def reset_derived(self) -> None:
            order.append("leaf")

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Sequential(Leaf())
            self.w = nn.Parameter(torch.ones(1))

        def reset_derived(self) -> None:
            order.append("root")

    load_module(Root, {"w": torch.ones(1)}, WeightMap([Rule("w", "w")]))
    assert order == ["leaf", "root"]


def test_reset_derived_runs_on_target_device():
    seen = {}

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("t", torch.empty(3), persistent=False)

        def reset_derived(self) -> None:
            self.t = torch.full((3,), math.pi)
            seen["device"] = self.t.device

    m = load_module(M, {}, WeightMap([]), device="cpu")
    assert seen["device"].type == "cpu" and m.t[0].item() == pytest.approx(math.pi)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_module_on_cuda():
    m = load_module(Tiny, _source(), WMAP, device="cuda", dtype=torch.float16)
    assert m.embed.weight.is_cuda and m.rope.inv_freq.is_cuda and m.steps.is_cuda
    assert m.head.weight.data_ptr() == m.embed.weight.data_ptr()


def test_global_dtype_leaves_fp8_slots_alone():
    class Q(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(2, 2, dtype=torch.float8_e4m3fn), requires_grad=False)
            self.scale = nn.Parameter(torch.empty(()))

    src = {"w": torch.ones(2, 2).to(torch.float8_e4m3fn), "scale": torch.tensor(0.5)}
    m = load_module(Q, src, WeightMap([Rule("w", "w"), Rule("scale", "scale")]), dtype=torch.float16)
    assert m.w.dtype == torch.float8_e4m3fn and m.scale.dtype == torch.float16


def test_build_failure_on_meta_gets_a_hint():
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n = int(torch.ones(1).sum().item())

    with pytest.raises(RuntimeError) as err:
        load_module(Bad, {}, WeightMap([]))
    assert "reset_derived" in "".join(getattr(err.value, "__notes__", []))


def test_build_on_meta_skips_init_and_never_imports_dynamo():
    """nn.init on meta computes nothing, but torch runs it through references whose first use imports
    torch._dynamo (over a second of `flashrt say`'s cold start): build_on_meta skips it."""
    import subprocess
    import sys

    code = ("import sys, torch, torch.nn as nn\n"
            "from flashrt.io.loading import build_on_meta\n"
            "m = build_on_meta(lambda: nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 8),\n"
            "                                        nn.Conv1d(8, 8, 3)))\n"
            "assert all(p.is_meta for p in m.parameters())\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_init_outside_build_on_meta_is_untouched():
    import torch.nn as nn

    from flashrt.io.loading import build_on_meta

    build_on_meta(lambda: nn.Linear(4, 4))
    real = nn.Linear(64, 64)  # after (and outside) a meta build: initialised as torch does
    assert real.weight.abs().sum() > 0 and real.weight.std() > 0
