"""Pi0 frontend: declared buffers, one graph per prompt bucket, trace == eager bit for bit, noise."""

from __future__ import annotations

import pytest
import torch
from support import pi0_e2e

from flashrt.errors import InputError
from flashrt.frontends.pi0.checkpoint import load_checkpoint
from flashrt.frontends.pi0.frontend import Pi0Frontend, default_buckets
from flashrt.frontends.pi0.weights import load_pi0

E2E = pi0_e2e


def _model(name: str):
    ck = load_checkpoint(E2E.case(name).policy_dir, tokenizer=E2E.TOKENIZER)
    return ck, load_pi0(ck.model_config, ck.weights)


def _feed(frontend: Pi0Frontend, seed: int, n_tokens: int) -> None:
    """Random valid inputs (the same for every frontend fed with the same seed)."""
    g = torch.Generator().manual_seed(seed)
    b, c = frontend.buffers, frontend.config
    b["vision_images"].copy_(torch.rand(b["vision_images"].shape, generator=g) * 2 - 1)
    b["vision_masks"].fill_(True)
    b["vision_masks"][0, -1] = seed % 2 == 0  # sometimes a missing camera
    b["vision_masks"][0, 0] = True
    tokens = torch.randint(0, c.vlm.vocab_size, (1, frontend.max_len), generator=g)
    mask = torch.arange(frontend.max_len)[None] < n_tokens
    b.populate({"prefix_tokens": tokens, "prefix_token_masks": mask}, partial=True)
    if c.has_state_token:
        b["expert_state"].copy_(torch.randn(b["expert_state"].shape, generator=g))
    frontend.write_noise(seed=seed)


def test_default_buckets():
    assert default_buckets(48) == (8, 16, 32, 48)
    assert default_buckets(200) == (8, 16, 32, 64, 128, 200)
    assert default_buckets(10) == (8, 10)
    assert default_buckets(8) == (8,)
    assert default_buckets(64) == (8, 16, 32, 64)


@pytest.mark.parametrize("name", ["pi0_cam3", "pi05_cam2"])
def test_trace_replay_equals_eager_bit_for_bit(name):
    """The trace backend records the step (refusing host syncs, data-dependent shapes, RNG) and its
    replays equal eager runs exactly, for every bucket and for changing inputs."""
    _, model = _model(name)
    eager = Pi0Frontend(model, len(E2E.case(name).info["cameras"]), (16, 32), backend="eager")
    trace = Pi0Frontend(model, len(E2E.case(name).info["cameras"]), (16, 32), backend="trace")
    report = trace.capture()
    assert report["captured"] == [16, 32] and report["buffers_bytes"] == trace.buffers.nbytes()
    eager.capture()
    for seed, n_tokens in ((0, 9), (1, 30), (2, 16), (3, 5)):
        bucket = trace.bucket_for(n_tokens)
        assert bucket == eager.bucket_for(n_tokens) == (16 if n_tokens <= 16 else 32)
        for frontend in (trace, eager):
            _feed(frontend, seed, n_tokens)
            frontend.run(bucket)
        assert torch.equal(trace.actions(), eager.actions()), (seed, n_tokens)


def test_replay_runs_in_inference_mode_and_leaks_no_inference_tensor():
    """The step is wrapped in inference_mode (its temporaries skip autograd bookkeeping), yet every
    buffer it writes stays an ordinary tensor: callers may still update them in place afterwards."""
    _, model = _model("pi0_cam2")
    frontend = Pi0Frontend(model, 2, (16,))
    frontend.capture()
    seen = []
    sample_actions = model.sample_actions
    model.sample_actions = lambda *a, **k: (seen.append(torch.is_inference_mode_enabled()),
                                            sample_actions(*a, **k))
    try:
        _feed(frontend, 0, 9)
        frontend.run(16)
    finally:
        del model.sample_actions
    assert seen == [True] and not torch.is_inference_mode_enabled()
    for name, tensor in frontend.buffers.tensors.items():
        assert not tensor.is_inference(), name
    frontend.buffers["expert_actions"].add_(0.0)  # would raise for an inference tensor


def test_bucket_choice_does_not_change_actions():
    """A prompt padded to 16 or to 64 tokens (masked padding) gives the same actions."""
    _, model = _model("pi0_cam2")
    small = Pi0Frontend(model, 2, (16, 64))
    large = Pi0Frontend(model, 2, (64,))
    for frontend in (small, large):
        _feed(frontend, 5, 12)
        frontend.run(frontend.bucket_for(12))
    assert small.bucket_for(12) == 16 and large.bucket_for(12) == 64
    assert torch.allclose(small.actions(), large.actions(), atol=1e-5)


def test_prompt_longer_than_largest_bucket():
    _, model = _model("pi05_cam1")
    frontend = Pi0Frontend(model, 1, (16, 32))
    with pytest.raises(InputError, match="33 tokens exceeds the largest bucket 32"):
        frontend.bucket_for(33)


def test_noise_is_a_static_input():
    _, model = _model("pi05_cam1")
    frontend = Pi0Frontend(model, 1, (16,))
    noise = frontend.buffers["expert_noise"]
    frontend.write_noise(seed=7)
    first = noise.clone()
    frontend.write_noise(seed=7)
    assert torch.equal(noise, first)
    frontend.write_noise(seed=8)
    assert not torch.equal(noise, first)
    frontend.write_noise()
    drawn = noise.clone()
    frontend.write_noise()
    assert not torch.equal(noise, drawn)
    h, a = noise.shape[1:]
    given = torch.randn(h, a)
    frontend.write_noise(frontend.check_noise(given))
    assert torch.equal(noise[0], given)
    assert torch.equal(frontend.check_noise(given[None].numpy())[0], given)
    with pytest.raises(InputError, match="expert_noise: expected shape"):
        frontend.check_noise(torch.randn(h + 1, a))
    with pytest.raises(InputError, match="float"):
        frontend.check_noise(torch.zeros(h, a, dtype=torch.int64))
    with pytest.raises(InputError, match="NaN"):
        frontend.check_noise(torch.full((h, a), float("nan")))


@pytest.mark.parametrize("name", ["pi0_cam3", "pi05_cam2"])
def test_kernels_per_replay_on_meta_equal_the_cpu_steps_op_for_op(name):
    """The meta twin's count (what describe() reports) is the real step's: run on the CPU with the ATen
    kernels (the CUDA path), every op name counted the same number of times."""
    from flashrt import ops
    from flashrt.profile.kernels import count_kernels

    _, model = _model(name)
    ops.select(model, "cpu", prefer={"mlp": "aten"})
    frontend = Pi0Frontend(model, len(E2E.case(name).info["cameras"]), (16, 32), backend="eager")
    meta = frontend.kernels_per_replay(32)
    assert meta.by_op == count_kernels(frontend.raw_step(32)).by_op and meta.total > 100
    assert frontend.kernels_per_replay() is meta  # computed once per bucket


@pytest.mark.parametrize("name", ["pi0_cam3", "pi05_cam2"])
def test_fused_kernels_trace_and_equal_the_aten_step_bit_for_bit(name):
    """The ``flashrt::`` custom ops (the decoder ops' "fused" forms) are recorded by the trace backend
    like any aten op (no refusal; the K/V slots they mutate are static tensors) and, on the CPU, where
    they run their references, the step equals the ATen row's eager run exactly; one replay launches
    fewer kernels."""
    from flashrt import ops

    _, model = _model(name)
    cams = len(E2E.case(name).info["cameras"])
    eager = Pi0Frontend(model, cams, (16,), backend="eager")
    _feed(eager, 7, 11)
    eager.run(16)
    aten_count = eager.kernels_per_replay().total
    ops.select(model, "cpu", prefer={"decoder": "fused"})
    try:
        trace = Pi0Frontend(model, cams, (16,), backend="trace")
        trace.capture()
        assert any(op.startswith("flashrt.") for op in trace.graphs._graphs[16].op_names())
        _feed(trace, 7, 11)
        trace.run(16)
        assert torch.equal(trace.actions(), eager.actions())
        assert trace.kernels_per_replay().total < aten_count
    finally:
        ops.select(model, "cpu")


@pytest.mark.parametrize("name", ["pi0_cam3", "pi05_cam2"])
@pytest.mark.parametrize("cams", [1, 2, 3])
def test_every_gemma_attention_takes_its_bias_without_a_per_call_pad(name, cams):
    """The key bias is allocated with rows a multiple of 8 apart (`key_padding_bias`), so on the CUDA path
    torch's memory-efficient attention never re-pads it, whatever the prefix length (cameras, bucket)."""
    _, model = _model(name)
    frontend = Pi0Frontend(model, cams, (16, 32), backend="eager")
    c = model.config
    for bucket in (16, 32):
        count = frontend.kernels_per_replay(bucket)
        gemma = (c.vlm.depth - 1) + (c.expert.depth - 1) * c.has_state_token + c.num_steps * c.expert.depth
        vision = c.vision.depth  # float32: SigLIP's unmasked attention takes memory-efficient too
        assert count.by_op["sdpa.efficient"] == gemma + vision
        assert "sdpa.efficient pad bias" not in count.by_op
