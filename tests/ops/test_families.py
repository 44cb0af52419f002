"""Each family's one `flashrt.ops.select` pass, read back on the CPU and on the CUDA code path (the module
on the meta device, the pass run for a CUDA device whose csrc library loads, as ``flashrt kernels --path
cuda`` counts it): which form every op slot of the family's module runs, and that ``describe()`` reports
what the module runs."""

from pathlib import Path

import pytest
import torch

from flashrt import ops
from flashrt.io.loading import build_on_meta, expected_slots, meta_twin, reset_derived
from flashrt.ops.decoder import decoder_prefer
from flashrt.ops.platform import onednn_available

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DECODER = ("add_rms_norm", "gelu_mul", "rms_norm", "rope_qkv")
CPU_MLP = "onednn" if onednn_available() else "aten"


@pytest.fixture
def csrc_builds(monkeypatch):
    """A CUDA install whose csrc library loads (nothing is built or loaded: the pass only asks)."""
    from flashrt.ops import csrc

    monkeypatch.setattr(csrc, "load", lambda *a, **k: object())


def _on_cpu(build, dtype=torch.float32):
    """``build()`` with zero weights of ``dtype`` on the CPU, derived tables (and the family's pass) run."""
    module = build_on_meta(build)
    slots = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in expected_slots(module, dtype).items()}
    module.load_state_dict(slots, strict=True, assign=True)
    reset_derived(module, "cpu")
    return module


def _forms(choices, names):
    return {name: choices[name] for name in names}


def _pi0_config():
    from flashrt.frontends.pi0.config import config_from_state_dict_shapes
    from flashrt.frontends.pi0.weights import detect_variant
    from flashrt.io import open_checkpoint

    ckpt = open_checkpoint(FIXTURES / "pi0" / "pi05_tiny" / "model.safetensors")
    shapes = {k: ckpt.shape(k) for k in ckpt}
    return config_from_state_dict_shapes(shapes, detect_variant(shapes), "tiny", "tiny", chunk_size=6)


def test_pi0_on_the_cpu_and_on_the_cuda_path(csrc_builds):
    from flashrt.frontends.pi0.model import Pi0Model

    config = _pi0_config()
    depth, experts, vision = config.vlm.depth, config.expert.depth, config.vision.depth
    model = _on_cpu(lambda: Pi0Model(config))
    # CPU: the decoder ops' references; oneDNN's GeGLU in the (row-major) VLM, not in the column-major
    # expert; oneDNN's fc1 + GELU in the vision tower
    assert model.op_choices == ops.choices(model)
    assert {name: set(model.op_choices[name]) for name in DECODER} == {name: {"aten"} for name in DECODER}
    assert model.op_choices["geglu"] == ({"aten": experts, "onednn": depth} if CPU_MLP == "onednn"
                                         else {"aten": depth + experts})
    assert model.op_choices["fc1_gelu"] == {CPU_MLP: vision}
    twin = meta_twin(lambda: Pi0Model(config), torch.bfloat16)
    cuda = twin.select_ops("cuda")
    assert cuda["rms_norm"] == {"fused": depth + experts + 2} and cuda["rope_qkv"] == \
        {"fused": depth + experts}
    assert cuda["geglu"] == {"aten": depth + experts} and cuda["fc1_gelu"] == {"aten": vision}
    forced = meta_twin(lambda: Pi0Model(config, kernels="aten"), torch.bfloat16).select_ops("cuda")
    assert {name: set(forced[name]) for name in DECODER} == {name: {"aten"} for name in DECODER}


LLAMA = ("add_rms_norm", "rms_norm", "rope_qkv", "silu_mul", "token_rope")


def _only(choices, names, form):
    return {name: set(choices[name]) for name in names} == {name: {form} for name in names}


def test_pi0_fast_fuses_its_decoder_on_the_cuda_path_and_takes_onednn_on_the_cpu(csrc_builds):
    from flashrt.frontends.pi0_fast.config import preset
    from flashrt.frontends.pi0_fast.model import Pi0FastNet

    config = preset("pi0_fast-tiny")
    decoder = (*DECODER, "decode_tokens", "token_rope")
    net = _on_cpu(lambda: Pi0FastNet(config))
    assert _forms(net.op_choices, ("geglu", "fc1_gelu")) == {"geglu": {CPU_MLP: config.vlm.depth},
                                                            "fc1_gelu": {CPU_MLP: config.vision.depth}}
    assert _only(net.op_choices, decoder, "aten")
    cuda = meta_twin(lambda: Pi0FastNet(config), torch.bfloat16).select_ops("cuda")
    assert _only(cuda, decoder, "fused") and cuda["decode_tokens"] == {"fused": 1}
    assert _only(cuda, ("geglu", "fc1_gelu"), "aten")
    forced = meta_twin(lambda: Pi0FastNet(config, "aten"), torch.bfloat16).select_ops("cuda")
    assert all(set(forms) == {"aten"} for forms in forced.values())


def test_groot_fuses_its_text_layers_on_the_cuda_path_and_keeps_its_vision_reference(csrc_builds):
    from flashrt.frontends.groot.common.head import select_ops
    from flashrt.frontends.groot.n15.model import GrootN15Model, n15_config

    config = n15_config(FIXTURES / "groot" / "n15_tiny")
    model = _on_cpu(lambda: GrootN15Model(config))
    layers = len(model.backbone.vision.layers)
    assert model.op_choices["fc1_gelu"] == {"aten": layers}  # its SigLIP tower, pinned to the reference
    assert _only(model.op_choices, LLAMA, "aten")
    cuda = select_ops(meta_twin(lambda: GrootN15Model(config), torch.bfloat16), "cuda")
    assert cuda["fc1_gelu"] == {"aten": layers} and _only(cuda, LLAMA, "fused")


def test_lm_fuses_its_decoder_on_the_cuda_path_only(csrc_builds):
    from flashrt.frontends.lm.config import preset
    from flashrt.frontends.lm.frontend import CausalLM
    from flashrt.nn.llama import Llama

    cfg = preset("tiny")
    lm = CausalLM(cfg, _on_cpu(lambda: Llama(cfg.layer, cfg.depth, cfg.vocab_size, cfg.tied)), cache_len=16)
    assert _only(lm.op_choices, LLAMA, "aten") and lm.describe()["ops"] == lm.op_choices
    twin = meta_twin(lambda: Llama(cfg.layer, cfg.depth, cfg.vocab_size, cfg.tied), torch.bfloat16)
    cuda = ops.select(twin, "cuda", torch.bfloat16, decoder_prefer("auto"))
    assert _only(cuda, LLAMA, "fused")
    twin = meta_twin(lambda: Llama(cfg.layer, cfg.depth, cfg.vocab_size, cfg.tied), torch.bfloat16)
    assert _only(ops.select(twin, "cuda", torch.bfloat16, decoder_prefer("aten")), LLAMA, "aten")


def test_bigvgan_takes_the_native_activation_and_the_measured_sine_on_the_cpu_only():
    from flashrt.frontends.vocoders import get_family, prepare_module
    from flashrt.frontends.vocoders.bigvgan import BigVGANConfig
    from flashrt.nn.alias_free import pick_sine
    from flashrt.ops import csrc_cpu

    fam = get_family("bigvgan")
    cfg = BigVGANConfig(num_mels=8, upsample_initial_channel=32, upsample_rates=(2, 2),
                        upsample_kernel_sizes=(4, 4), resblock_kernel_sizes=(3,),
                        resblock_dilation_sizes=((1, 3),))
    module = prepare_module(fam, _on_cpu(lambda: fam.build(cfg)), "cpu", torch.float32)
    choices = ops.choices(module)
    acts = sum(choices["aa_snake"].values())
    native = "native" if csrc_cpu.load() is not None else "torch"
    snakes = sum(choices["snake_sine"].values())
    assert choices == {"aa_snake": {native: acts}, "snake_sine": {pick_sine(): snakes}}
    twin = prepare_module(fam, meta_twin(lambda: fam.build(cfg), torch.float32), "cuda", torch.float32)
    assert ops.choices(twin) == {"aa_snake": {"torch": acts}, "snake_sine": {"aten": snakes}}
    half = prepare_module(fam, _on_cpu(lambda: fam.build(cfg), torch.bfloat16), "cpu", torch.bfloat16)
    assert ops.choices(half) == ops.choices(twin)  # the CPU forms are float32 forms
