"""The Pi0 family's load options: the kernel-table row and lerobot's bf16 recipe, reported by describe()."""

from __future__ import annotations

import pytest
import torch
from support import pi0_e2e as E2E

from flashrt.errors import ConfigError
from flashrt.runner.policy import load_policy


def _load(**options):
    return load_policy(E2E.case("pi05_cam2").policy_dir, tokenizer=E2E.TOKENIZER, backend="eager", **options)


@pytest.mark.parametrize("fp32_modules, heads", [("lerobot", torch.float32), ("none", torch.bfloat16)])
def test_bf16_keeps_lerobots_fp32_modules_unless_told_not_to(fp32_modules, heads):
    policy = _load(precision="bfloat16", fp32_modules=fp32_modules)
    model, d = policy.frontend.frontend.model, policy.describe()
    assert model.dtype == torch.bfloat16 and model.action_in.weight.dtype == heads
    assert model.vision.patch.weight.dtype == model.vlm.norm.weight.dtype == heads
    assert d["dtype"] == "bfloat16" and d["fp32_modules"] == fp32_modules


def test_describe_names_the_kernel_row_and_its_count():
    d = _load(kernels="fused").describe()
    assert d["kernels"] == "fused" and d["fp32_modules"] == "all"
    assert d["kernels_per_replay"] < _load().describe()["kernels_per_replay"]


def test_numerics_are_pinned_per_family_and_tf32_is_a_load_option():
    assert _load().describe()["numerics"] == {"tf32": False, "sdpa": ["flash", "efficient", "math"]}
    policy = _load(tf32=True)
    assert policy.describe()["numerics"]["tf32"] is True
    before = torch.backends.cuda.matmul.allow_tf32
    policy.infer(E2E.case("pi05_cam2").obs(0), seed=0)      # a CPU step leaves the flags alone
    assert torch.backends.cuda.matmul.allow_tf32 == before


@pytest.mark.parametrize("options, match", [({"fp32_modules": "vision"}, "fp32_modules="),
                                            ({"kernels": "triton"}, "kernels="),
                                            ({"tf32": "yes"}, "tf32 must be")])
def test_bad_option_values_are_config_errors(options, match):
    with pytest.raises(ConfigError, match=match):
        _load(**options)
