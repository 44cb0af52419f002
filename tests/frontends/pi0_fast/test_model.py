"""Pi0-FAST network under the decode runner: the trace backend's decode step equals eager bit for bit,
and the model's greedy ids equal lerobot's on the trace backend too (the graph rules hold)."""

from __future__ import annotations

import torch
from support.pi0_fast import ROOT, case, observation, reference_tokens

from flashrt import ops
from flashrt.frontends.pi0_fast.checkpoint import load_checkpoint
from flashrt.frontends.pi0_fast.model import Pi0FastDecodeModel
from flashrt.frontends.pi0_fast.weights import load_pi0_fast
from flashrt.runtime.decode import Decoder, Sampling

STEPS = 24


def _decoder(backend: str) -> tuple[Pi0FastDecodeModel, Decoder]:
    ck = load_checkpoint(ROOT / "cam2" / "policy", tokenizer=ROOT / "tokenizer.model")
    net = load_pi0_fast(ck.model_config, ck.weights)
    model = Pi0FastDecodeModel(net, len(ck.cameras), 64 + STEPS, net.lm_head.weight.device)
    return model, Decoder(model, (64,), max_new_tokens=STEPS, backend=backend).capture()


def _write_obs(model: Pi0FastDecodeModel, i: int) -> list[int]:
    from flashrt.frontends.pi0.preprocess import ImagePreprocessor

    info, io = case("cam2")
    pre = ImagePreprocessor(tuple(info["cameras"]), info["resolution"])
    pre.write(pre.check(observation("cam2", i)["images"]), model.buffers["vision_images"][0],
              model.buffers["vision_masks"][0])
    return io[f"obs{i}.tokens"][io[f"obs{i}.token_mask"]].tolist() + [2]  # + the bos the model appends


def _state(model: Pi0FastDecodeModel, dec: Decoder) -> dict[str, torch.Tensor]:
    return {**{f"io.{k}": v.clone() for k, v in dec.io.buffers.tensors.items()},
            **{f"m.{k}": v.clone() for k, v in model.buffers.tensors.items()}}


def _restore(model: Pi0FastDecodeModel, dec: Decoder, saved: dict[str, torch.Tensor]) -> None:
    for k, v in saved.items():
        (dec.io.buffers if k.startswith("io.") else model.buffers)[k.split(".", 1)[1]].copy_(v)


def test_trace_decode_step_equals_eager_bit_for_bit_and_tokens_match_lerobot():
    model, dec = _decoder("trace")
    ids = _write_obs(model, 5)
    dec.write(64, torch.tensor([ids]), Sampling())
    with torch.inference_mode():
        dec.prefills.replay(64)
        for _ in range(3):
            dec.steps["greedy"].replay()
        saved = _state(model, dec)
        dec.steps["greedy"].replay()
        traced = _state(model, dec)
        _restore(model, dec, saved)
        dec._decode_body("greedy")()
        eager = _state(model, dec)
    assert traced.keys() == eager.keys()
    for k in traced:
        assert torch.equal(traced[k], eager[k]), k
    assert not torch.equal(traced["io.logits"], saved["io.logits"])  # the step did something
    end = 331
    got = list(dec.generate(ids, STEPS, stop=(end,)))
    assert got == reference_tokens("cam2", 5, end)
    assert dec.report()["decode_captures"] == {"greedy": 1, "sample": 1}


def test_decoder_without_penalty_refuses_a_penalty():
    import pytest

    from flashrt.errors import InputError

    model, _ = _decoder("eager")
    dec = Decoder(model, (64,), max_new_tokens=STEPS, backend="eager", penalty=False)
    with pytest.raises(InputError, match="repetition_penalty"):
        dec.check([2, 3], STEPS, Sampling(repetition_penalty=1.2))
    assert dec.check([2, 3], STEPS, Sampling())[0] == 64


def test_the_fused_row_decodes_lerobots_greedy_ids():
    """"fused" (what the loader picks on a CUDA device with csrc) runs the prefill and the token form of
    the decode step on the ``flashrt::`` ops (their references on the CPU): the same greedy ids."""
    model, dec = _decoder("eager")
    assert model.describe()["kernels"] == "aten" and model.describe()["ops"]["decode_tokens"] == {"aten": 1}
    ops.select(model.net, "cpu", prefer={"decoder": "fused"})
    described = model.describe()
    assert described["kernels"] == "fused" and described["ops"]["decode_tokens"] == {"fused": 1}
    end = 331
    assert list(dec.generate(_write_obs(model, 5), STEPS, stop=(end,))) == reference_tokens("cam2", 5, end)
