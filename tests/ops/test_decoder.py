"""The decoder ops (`flashrt.ops.decoder`): each reference equals the unfused code it replaces, bit for
bit; the ``flashrt::`` custom ops equal their references on the CPU and pass torch's op checks; a Gemma
stack on the "fused" forms equals the "aten" forms and launches one kernel per fused op."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from flashrt import ops
from flashrt.errors import ConfigError
from flashrt.io.loading import reset_derived
from flashrt.nn.attention import StaticKV, key_padding_bias
from flashrt.nn.gemma import Gemma
from flashrt.nn.llama import LayerShape, Llama, RowPositions, causal_bias, decode_bias
from flashrt.nn.rope import rope_cos_sin
from flashrt.ops.decoder import (
    REFERENCES,
    add_rms_norm_ref,
    apply_rope,
    decoder_prefer,
    gated_residual,
    gelu_mul_ref,
    rms_norm_ref,
    rms_normalize,
    rope_qkv_ref,
    silu_mul_ref,
)
from flashrt.profile.kernels import count_kernels

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _data(dtype, rows=7, d=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, rows, d, generator=g) * 3).to(dtype)
    y = torch.randn(2, rows, d, generator=g).to(dtype)
    w = torch.randn(d, generator=g) * 0.2
    return x, y, w, torch.randn(d, generator=g).to(dtype), torch.randn(d, generator=g)


# ------------------------------------------------------------------------------ references = unfused code
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_ref_is_the_unfused_gemma_rmsnorm(dtype):
    x, _, w, _, shift = _data(dtype)
    w = w.to(dtype)
    unfused = rms_normalize(x, 1e-6, 1.0 + w.float()).to(dtype)  # 1 + w per call, then cast back
    assert torch.equal(rms_norm_ref(x, 1.0 + w.float(), None, 1e-6), unfused)
    adaptive = torch.addcmul(shift, rms_normalize(x, 1e-6), 1.0 + w.float()).to(dtype)
    assert torch.equal(rms_norm_ref(x, 1.0 + w.float(), shift, 1e-6), adaptive)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
def test_add_rms_norm_ref_is_the_residual_then_the_norm(dtype, gated):
    x, y, w, gate, shift = _data(dtype)
    gate = gate if gated else None
    s, n = add_rms_norm_ref(x, y, gate, 1.0 + w, shift, 1e-6)
    assert torch.equal(s, gated_residual(x, y, gate))
    assert torch.equal(n, torch.addcmul(shift, rms_normalize(s, 1e-6), 1.0 + w).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [8, 0])
def test_rope_qkv_ref_rotates_q_k_into_strided_slots(dtype, heads):
    g = torch.Generator().manual_seed(1)
    b, length, kv, d = 2, 5, 1, 16
    qkv = torch.randn(b, length, heads + 2 * kv, d, generator=g).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(3, 3 + length).expand(b, -1), d, dtype=dtype)
    cache_k, cache_v = torch.zeros(b, kv, 9, d, dtype=dtype), torch.zeros(b, kv, 9, d, dtype=dtype)
    k_slot, v_slot = cache_k[:, :, 2:7].transpose(1, 2), cache_v[:, :, 2:7].transpose(1, 2)  # strided
    q = rope_qkv_ref(qkv, cos, sin, k_slot, v_slot, heads)
    assert q.shape == (b, length, heads, d)
    if heads:
        assert torch.equal(q, apply_rope(qkv[:, :, :heads], cos, sin))
    assert torch.equal(k_slot, apply_rope(qkv[:, :, heads:heads + kv], cos, sin))
    assert torch.equal(v_slot, qkv[:, :, heads + kv:])
    assert cache_k[:, :, :2].abs().sum() == 0 and cache_k[:, :, 7:].abs().sum() == 0  # only the slots


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_mul_ref_is_the_unfused_geglu_product(dtype):
    gate_up = torch.randn(3, 4, 20).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(gelu_mul_ref(gate_up), F.gelu(gate, approximate="tanh") * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_ref_is_the_unfused_swiglu_product(dtype):
    gate_up = torch.randn(3, 4, 20).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_mul_ref(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_first_rms_norm_ref_is_the_llama_form(dtype):
    """transformers' Llama / Qwen3 RMSNorm: ``w * normalize(x).to(dtype)``, w in the model dtype."""
    x, y, w, _, _ = _data(dtype)
    w = w.to(dtype)
    llama = w * rms_normalize(x, 1e-5).to(dtype)
    assert torch.equal(rms_norm_ref(x, w.float(), None, 1e-5, True), llama)
    s, n = add_rms_norm_ref(x, y, None, w.float(), None, 1e-5, True)
    assert torch.equal(s, x + y) and torch.equal(n, w * rms_normalize(x + y, 1e-5).to(dtype))


# ------------------------------------------------------------------------------ the custom ops on the CPU
def _op_cases(dtype):
    x, y, w, gate, shift = _data(dtype)
    qkv = torch.randn(1, 4, 10, 8).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(4)[None], 8, dtype=dtype)
    k, v = torch.zeros(1, 1, 6, 8, dtype=dtype), torch.zeros(1, 1, 6, 8, dtype=dtype)
    slots = (k[:, :, 1:5].transpose(1, 2), v[:, :, 1:5].transpose(1, 2))
    return {"rms_norm": (x, 1.0 + w, shift, 1e-6), "add_rms_norm": (x, y, gate, 1.0 + w, None, 1e-6),
            "rope_qkv": (qkv, cos, sin, *slots, 8), "gelu_mul": (torch.randn(3, 12).to(dtype),),
            "silu_mul": (torch.randn(3, 12).to(dtype),),
            "rms_norm cast_first": (x, w, None, 1e-5, True),
            "add_rms_norm cast_first": (x, y, None, w, None, 1e-5, True)}


OPS = ["rms_norm", "add_rms_norm", "rope_qkv", "gelu_mul", "silu_mul", "rms_norm cast_first",
       "add_rms_norm cast_first"]


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", OPS)
def test_custom_op_equals_its_reference_and_passes_opcheck(dtype, case):
    args, name = _op_cases(dtype)[case], case.split()[0]
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    got, want = getattr(torch.ops.flashrt, name)(*args), REFERENCES[name](*ref_args)
    for a, b in zip(_tuple(got), _tuple(want)):
        assert torch.equal(a, b)
    for a, b in zip(args, ref_args):  # the mutated K/V slots too
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b)
    torch.library.opcheck(getattr(torch.ops.flashrt, name).default, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("case", OPS)
def test_on_meta_a_custom_op_is_one_kernel_with_the_reference_shapes(case):
    args, name = _op_cases(torch.bfloat16)[case], case.split()[0]
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    want = REFERENCES[name](*args)
    count = count_kernels(lambda: getattr(torch.ops.flashrt, name)(*meta))
    assert count.total == 1 and dict(count.by_op) == {f"flashrt.{name}.default": 1}
    got = getattr(torch.ops.flashrt, name)(*meta)
    for a, b in zip(_tuple(got), _tuple(want)):
        assert a.shape == b.shape and a.dtype == b.dtype


# ------------------------------------------------------------------------------ a Gemma stack on each row
W, DEPTH, MLP, H, KV, D = 24, 3, 40, 4, 1, 8


def _stack(adaptive: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    model = Gemma(W, DEPTH, MLP, H, KV, D, cond_dim=W if adaptive else None).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    reset_derived(model, "cpu")
    return model


@torch.no_grad()
def _run(model, x, dtype):
    b, p = x.shape[:2]
    kv = StaticKV(torch.zeros(DEPTH, b, KV, p, D, dtype=dtype), torch.zeros(DEPTH, b, KV, p, D, dtype=dtype))
    valid = torch.ones(b, p, dtype=torch.bool)
    mods = model.modulation(torch.randn(W, generator=torch.Generator().manual_seed(5))) if model.adaptive \
        else None
    rope = rope_cos_sin(valid.cumsum(1) - 1, D, dtype=dtype)
    out = model(x, rope, kv, 0, key_padding_bias(valid, dtype), mods=mods)
    return out, kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adaptive", [False, True])
def test_gemma_on_the_fused_row_equals_the_aten_row(adaptive, dtype):
    model = _stack(adaptive, dtype)
    x = torch.randn(2, 6, W).to(dtype)
    want, kv_want = _run(model, x, dtype)
    choices = ops.select(model, "cpu", prefer={"decoder": "fused", "mlp": "aten"})
    assert choices["rms_norm"] == {"fused": DEPTH + 1} and choices["rope_qkv"] == {"fused": DEPTH}
    assert model.rms_norm.run is torch.ops.flashrt.rms_norm
    got, kv_got = _run(model, x, dtype)
    assert torch.equal(got, want) and torch.equal(kv_got.k, kv_want.k) and torch.equal(kv_got.v, kv_want.v)


def test_fused_gemma_launches_nine_kernels_per_layer():
    """norm, then per layer: qkv GEMM, rope_qkv, attention, o GEMM, add_rms_norm, gate|up GEMM,
    gelu_mul, down GEMM, add_rms_norm (the next layer's input norm)."""
    model = _stack(False)
    ops.select(model, "cpu", prefer={"decoder": "fused", "mlp": "aten"})
    x, valid = torch.randn(1, 5, W), torch.ones(1, 5, dtype=torch.bool)
    kv = StaticKV(torch.zeros(DEPTH, 1, KV, 5, D), torch.zeros(DEPTH, 1, KV, 5, D))
    rope, bias = rope_cos_sin(valid.cumsum(1) - 1, D), key_padding_bias(valid, torch.float32)
    count = count_kernels(lambda: model(x, rope, kv, 0, bias))
    assert count.total == 1 + 9 * DEPTH
    assert count.by_op["flashrt.add_rms_norm.default"] == 2 * DEPTH
    prefill = count_kernels(lambda: model(x, rope, kv, 0, bias, kv_only_last=True))
    assert prefill.total == 1 + 9 * (DEPTH - 1) + 2  # the last layer: its K/V GEMM and rope_qkv only


def test_decoder_prefer_and_the_auto_choice_on_the_cpu():
    assert decoder_prefer("auto") == {} and decoder_prefer("fused") == {"decoder": "fused"}
    with pytest.raises(ConfigError, match="kernels="):
        decoder_prefer("triton")
    model = _stack(False)
    assert ops.choices(model) == {"add_rms_norm": {"aten": DEPTH}, "geglu": {"aten": DEPTH},
                                  "gelu_mul": {"aten": DEPTH}, "rms_norm": {"aten": DEPTH + 1},
                                  "rope_qkv": {"aten": DEPTH}, "token_rope": {"aten": DEPTH}}  # references
    ops.select(model, "cpu")  # "auto" on the CPU: the references (the fused form is a CUDA form)
    assert all(set(c) == {"aten"} for n, c in ops.choices(model).items() if n != "geglu")
    with pytest.raises(ConfigError, match="no form 'triton'"):
        ops.select(model, "cpu", prefer={"decoder": "triton"})


# ------------------------------------------------------------------------------ a Llama / Qwen3 stack
def _llama(qk_norm: bool, dtype):
    g = torch.Generator().manual_seed(7)
    shape = LayerShape(W, MLP, H, 2, D, eps=1e-5, qkv_bias=qk_norm, qk_norm=qk_norm)
    model = Llama(shape, DEPTH, 50, tied=True).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    reset_derived(model, "cpu")
    return model


@torch.no_grad()
def _llama_steps(model, dtype):
    """A prefill of 5 tokens at slot 0 (B 2), a decode token at slot 5, one per row at slots (6, 7)."""
    kv = StaticKV(torch.zeros(DEPTH, 2, 2, 9, D, dtype=dtype), torch.zeros(DEPTH, 2, 2, 9, D, dtype=dtype))
    tokens = torch.arange(10).view(2, 5) % 50
    rope = rope_cos_sin(torch.arange(9)[None].expand(2, 9), D, dtype=dtype)
    out = [model.hidden(tokens, (rope[0][:, :5], rope[1][:, :5]), kv, 0, causal_bias(5, dtype, "cpu"))]
    at = torch.tensor([5])
    out.append(model.hidden(tokens[:, :1], (rope[0][:, 5:6], rope[1][:, 5:6]), kv, at,
                            decode_bias(at, 9, dtype)))
    rows = torch.tensor([6, 7])
    row_rope = tuple(t[torch.arange(2), rows][:, None] for t in rope)  # (2, 1, 1, D): each row's position
    out.append(model.hidden(tokens[:, 1:2], row_rope, kv, RowPositions(rows), decode_bias(rows, 9, dtype)))
    return out, kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_llama_on_the_fused_row_equals_the_aten_row(qk_norm, dtype):
    model = _llama(qk_norm, dtype)
    want, kv_want = _llama_steps(model, dtype)
    choices = ops.select(model, "cpu", prefer={"decoder": "fused", "decode_attention": "sdpa"})
    assert choices == {"add_rms_norm": {"fused": DEPTH}, "rms_norm": {"fused": DEPTH + 1},
                       "rope_qkv": {"fused": DEPTH}, "silu_mul": {"fused": DEPTH},
                       "token_rope": {"fused": DEPTH}, "decode_attention": {"sdpa": DEPTH}}
    got, kv_got = _llama_steps(model, dtype)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(kv_got.k, kv_want.k) and torch.equal(kv_got.v, kv_want.v)


def test_fused_llama_launches_nine_kernels_per_layer():
    """embedding, norm, then per layer: qkv GEMM, rope_qkv, attention, o GEMM, add_rms_norm, gate|up
    GEMM, silu_mul, down GEMM, add_rms_norm (the next layer's input norm or the final norm)."""
    model = _llama(False, torch.float32)
    kv = StaticKV(torch.zeros(DEPTH, 1, 2, 5, D), torch.zeros(DEPTH, 1, 2, 5, D))
    tokens, rope = torch.arange(5)[None], rope_cos_sin(torch.arange(5)[None], D)
    bias = causal_bias(5, torch.float32, "cpu")
    aten = count_kernels(lambda: model.hidden(tokens, rope, kv, 0, bias))
    ops.select(model, "cpu", prefer={"decoder": "fused"})
    count = count_kernels(lambda: model.hidden(tokens, rope, kv, 0, bias))
    assert count.total == 2 + 9 * DEPTH < aten.total
    assert count.by_op["flashrt.add_rms_norm.default"] == 2 * DEPTH
    assert count.by_op["flashrt.silu_mul.default"] == count.by_op["flashrt.rope_qkv.default"] == DEPTH


def test_qwen3_q_k_norms_of_the_fused_projection_are_one_kernel_each_on_the_cuda_path():
    """q and k are head splits of the qkv GEMM's output (rows in groups, not contiguous): the norm kernel
    takes them (`row_layout`), so on the CUDA path each is one kernel, not its reference op by op."""
    from flashrt.ops.csrc_ops import CUDA_FORMS

    model = _llama(True, torch.bfloat16)
    ops.select(model, "cpu", prefer={"decoder": "fused"})
    layer, x = model.layers[0], torch.randn(2, 5, W).bfloat16()
    rope = rope_cos_sin(torch.arange(5)[None], D, dtype=torch.bfloat16)
    count = count_kernels(lambda: layer.causal(x, rope), custom=CUDA_FORMS)
    assert count.by_op["flashrt.rms_norm.default"] == 3 and "aten.mean.dim" not in count.by_op
    with torch.no_grad():
        want = _llama(True, torch.bfloat16).layers[0].causal(x, rope)
        assert torch.equal(layer.causal(x, rope), want)  # the references on the CPU: the aten row's result
