"""Pi0 / Pi0.5 model: parity with lerobot 0.6.1 (fixtures), graph rules, buffers, FLOP accounting.

Fixtures: tests/fixtures/pi0/{pi0,pi05}_tiny (tests/fixtures/gen/gen_pi0_model.py, lerobot 0.6.1).
"""

from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from flashrt import ops
from flashrt.errors import ConfigError
from flashrt.frontends.pi0.config import config_from_state_dict_shapes, preset
from flashrt.frontends.pi0.model import (
    bytes_per_step,
    flops_per_step,
    io_buffer_specs,
    kv_buffer_specs,
    make_step,
    param_counts,
)
from flashrt.frontends.pi0.weights import detect_variant, load_pi0
from flashrt.io import open_checkpoint
from flashrt.nn.gemma import onednn_available
from flashrt.runtime.buffers import Buffers
from flashrt.runtime.graphs import get_backend

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "pi0"
CASES = ("cam1", "cam2", "cam3", "cam3_padded", "cam3_missing")
VARIANTS = ("pi0", "pi05")
TOL = 1e-4
BUFFER_OF = {"images": "vision_images", "img_masks": "vision_masks", "tokens": "prefix_tokens",
             "token_masks": "prefix_token_masks", "state": "expert_state", "noise": "expert_noise"}


@cache
def _io(variant: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / f"{variant}_tiny" / "io.safetensors"))


@cache
def _model(variant: str, num_steps: int | None = None, dtype: torch.dtype = torch.float32):
    ckpt = open_checkpoint(FIXTURES / f"{variant}_tiny" / "model.safetensors")
    steps = num_steps or int(_io(variant)["num_steps"])
    shapes = {k: ckpt.shape(k) for k in ckpt}
    cfg = config_from_state_dict_shapes(shapes, detect_variant(shapes), "tiny", "tiny", chunk_size=6,
                                        num_steps=steps)
    return load_pi0(cfg, ckpt, dtype=dtype)


def _case(variant: str, case: str) -> dict[str, torch.Tensor]:
    io = _io(variant)
    return {k.split("/", 1)[1]: v.clone() for k, v in io.items() if k.startswith(case + "/")}


def _run(model, c: dict[str, torch.Tensor], **kw) -> torch.Tensor:
    return model.sample_actions(c["images"], c["img_masks"], c["tokens"], c["token_masks"], c.get("state"),
                                c["noise"], **kw)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_parity_with_lerobot(variant, case):
    c = _case(variant, case)
    out = _run(_model(variant), c)  # the CPU's own kernel choice (oneDNN fused GELUs where available)
    assert out.shape == c["actions"].shape and out.dtype == torch.float32
    assert (out - c["actions"]).abs().max() <= TOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_parity_holds_with_every_mlp_kernel(variant):
    c = _case(variant, "cam3_padded")
    kernels = ["aten", "onednn"] if onednn_available() else ["aten"]
    for kernel in kernels:
        model = _model(variant)
        ops.select(model, "cpu", prefer={"mlp": kernel})
        assert model.vlm.layers[0].geglu.form == model.vision.layers[0].fc1_gelu.form == kernel
        assert (_run(model, c) - c["actions"]).abs().max() <= TOL, kernel
    with pytest.raises(ConfigError, match="no form 'triton'"):
        ops.select(model, "cpu", prefer={"mlp": "triton"})


def test_cpu_load_lays_out_the_expert_column_major_and_keeps_the_vlm_row_major():
    model = _model("pi0")
    assert model.expert.layers[0].down.weight.t().is_contiguous()
    assert model.action_in.weight.t().is_contiguous()
    assert model.vlm.layers[0].gate_up.weight.is_contiguous()
    assert model.vision.layers[0].fc1.weight.is_contiguous()


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_input_moves_the_actions_far_beyond_tolerance(variant):
    model, c = _model(variant), _case(variant, "cam3_padded")
    base = _run(model, c)
    perturb = {"camera0": ("images", lambda t: t[:, 0].neg_()),
               "camera2": ("images", lambda t: t[:, 2].neg_()),
               "token0": ("tokens", lambda t: t[:, 0].add_(1)),
               "noise": ("noise", lambda t: t.add_(0.1))}
    if variant == "pi0":
        perturb["state"] = ("state", lambda t: t[:, :7].add_(0.5))
    for name, (key, fn) in perturb.items():
        moved = {k: v.clone() for k, v in c.items()}
        fn(moved[key])
        assert (_run(model, moved) - base).abs().max() > 100 * TOL, name


@pytest.mark.parametrize("variant", VARIANTS)
def test_masked_cameras_and_padded_tokens_are_ignored(variant):
    model, c = _model(variant), _case(variant, "cam3_missing")
    assert not c["img_masks"][0, 2] and not c["token_masks"][1, 7]
    base = _run(model, c)
    c["images"][0, 2] = torch.rand_like(c["images"][0, 2])
    c["tokens"][1, 6:] = (c["tokens"][1, 6:] + 7) % 512
    assert (_run(model, c) - base).abs().max() <= 1e-6


@pytest.mark.parametrize("variant", VARIANTS)
def test_batch_rows_are_independent(variant):
    model, c = _model(variant), _case(variant, "cam3_missing")
    both = _run(model, c)
    for b in range(2):
        row = {k: v[b:b + 1] for k, v in c.items()}
        assert (_run(model, row) - both[b:b + 1]).abs().max() <= 1e-5


def _capture(variant: str, backend: str, model=None):
    model = model or _model(variant)
    cfg, device = model.config, model.action_in.weight.device
    bufs = Buffers([*io_buffer_specs(cfg, 2, 3, 10), *kv_buffer_specs(cfg, 2, cfg.prefix_len(3, 10))], device)
    bufs.populate({BUFFER_OF[k]: v for k, v in _case(variant, "cam3").items() if k in BUFFER_OF})
    return model, bufs, get_backend(backend).capture(make_step(model, bufs), bufs)


@pytest.mark.parametrize("variant", VARIANTS)
def test_trace_replay_equals_eager_bit_for_bit_and_reuses_static_kv(variant):
    model, bufs, graph = _capture(variant, "trace")  # capture refuses host syncs / dynamic shapes
    for case in ("cam3_missing", "cam3", "cam3_padded"):  # refill: no stale prefix K/V between calls
        c = _case(variant, case)
        bufs.populate({BUFFER_OF[k]: v for k, v in c.items() if k in BUFFER_OF})
        graph.replay()
        replayed = bufs.read("expert_actions")
        assert torch.equal(replayed, _run(model, c)), case
        assert (replayed - c["actions"]).abs().max() <= TOL, case


def test_eager_backend_with_buffers_matches_fixture():
    _, bufs, graph = _capture("pi0", "eager")
    graph.replay()
    assert (bufs.read("expert_actions") - _case("pi0", "cam3")["actions"]).abs().max() <= TOL


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_graph_replay_matches_fixture(variant):
    ckpt = open_checkpoint(FIXTURES / f"{variant}_tiny" / "model.safetensors")
    model = load_pi0(_model(variant).config, ckpt, device="cuda")
    with torch.backends.cudnn.flags(allow_tf32=False):
        _, bufs, graph = _capture(variant, "cuda", model)
        for case in ("cam3_missing", "cam3"):
            c = _case(variant, case)
            bufs.populate({BUFFER_OF[k]: v.cuda() for k, v in c.items() if k in BUFFER_OF})
            graph.replay()
            assert (bufs.read("expert_actions").cpu() - c["actions"]).abs().max() <= TOL, case


def test_num_steps_override_equals_a_model_built_for_that_schedule():
    c = _case("pi05", "cam2")
    override = _run(_model("pi05"), c, num_steps=2)
    assert torch.allclose(override, _run(_model("pi05", num_steps=2), c), atol=1e-6)
    assert (_run(_model("pi05"), c, num_steps=2) - c["actions"]).abs().max() > 100 * TOL


def test_out_and_kv_arguments():
    model, c = _model("pi0"), _case("pi0", "cam1")
    out = torch.full_like(c["actions"], float("nan"))
    assert _run(model, c, out=out) is out and (out - c["actions"]).abs().max() <= TOL
    with pytest.raises(ValueError, match="kv_buffer_specs"):
        _run(model, c, kv=(torch.zeros(2, 2, 1, 9, 16), torch.zeros(2, 2, 1, 9, 16)))
    with pytest.raises(ValueError, match="state"):
        _run(model, {**c, "state": None})


def test_bf16_model_runs_close_to_fp32():
    c = _case("pi05", "cam3")
    out = _run(_model("pi05", dtype=torch.bfloat16), c)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - c["actions"]).abs().max() < 0.05  # measured 0.003


def test_buffer_specs_names_shapes_roles():
    cfg = preset("pi0")
    p = cfg.prefix_len(3, 48)
    assert p == 3 * 256 + 48
    k, v = kv_buffer_specs(cfg, 1, p, torch.bfloat16)
    assert (k.name, v.name) == ("prefix_k", "prefix_v") and k.role == "state"
    assert k.shape == (18, 1, 1, p + 51, 256) and k.dtype == torch.bfloat16
    names = {s.name: s for s in io_buffer_specs(cfg, 1, 3, 48)}
    assert names["vision_images"].shape == (1, 3, 3, 224, 224)
    assert names["expert_actions"].role == "output" and "expert_state" in names
    assert "expert_state" not in {s.name for s in io_buffer_specs(preset("pi05"), 1, 3, 48)}
    assert kv_buffer_specs(preset("pi05"), 1, p)[0].shape[3] == p + 50


@pytest.mark.parametrize("variant", VARIANTS)
def test_flops_match_a_flop_counter_on_a_real_call(variant):
    model, c = _model(variant), _case(variant, "cam2")
    ops.select(model, "cpu", prefer={"mlp": "aten"})  # the counter knows ATen's matmuls, not oneDNN's
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _run(model, c)
    flops = flops_per_step(model.config, n_cams=2, prompt_len=10, batch=2)
    assert counter.get_total_flops() == flops["total"]
    assert flops["total"] == flops["vision"] + flops["prefix"] + flops["expert"] > flops["attention"] > 0


def test_real_size_accounting_is_plausible():
    cfg = preset("pi0")
    counts = param_counts(cfg)
    assert 0.38e9 < counts["vision"] < 0.45e9 and 1.9e9 < counts["vlm"] < 2.1e9
    assert 0.29e9 < counts["expert"] < 0.33e9 and counts["vlm_embed"] == 257_152 * 2048
    f10, f5 = flops_per_step(cfg, 3, 48, 10), flops_per_step(cfg, 3, 48, 5)
    assert f10["prefix"] == f5["prefix"] and f10["expert"] > 1.9 * f5["expert"]
    b = bytes_per_step(cfg, 3, 48, 10, weight_bytes=2)
    assert b["total"] == b["weights"] + b["kv"] and 10e9 < b["weights"] < 13e9
