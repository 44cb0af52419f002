"""The lerobot helpers shipped in the package (`flashrt.bench.reference.lerobot_pi0`): they import
without lerobot, `--vs lerobot` says lerobot is missing (not that a checkout file is), `shrink` makes a
lerobot-like modeling module build the sizes asked, `lerobot_batch` converts an observation."""

import types

import numpy as np
import pytest
import torch

from flashrt.bench.reference import lerobot_pi0


def test_lerobot_batch_is_float_chw_over_255_with_state_and_task():
    image = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    batch = lerobot_pi0.lerobot_batch({"images": {"top": image}, "state": np.ones(4, np.float32),
                                       "prompt": "pick"})
    pixels = batch["observation.images.top"]
    assert pixels.shape == (3, 2, 3) and pixels.dtype == torch.float32
    assert torch.equal(pixels, torch.from_numpy(image).permute(2, 0, 1).float() / 255.0)
    assert batch["task"] == "pick" and torch.equal(batch["observation.state"], torch.ones(4))


def test_shrink_makes_the_modeling_module_build_the_sizes_asked():
    made = {}

    def vlm(config):
        made["vlm"] = config
        return "vlm"

    def expert(config):
        made["expert"] = config
        return "expert"

    modeling = types.SimpleNamespace(GemmaConfig=lambda **kw: kw, PiGemmaForCausalLM=expert,
                                     PaliGemmaForConditionalGenerationWithPiGemma=vlm)
    lerobot_pi0.shrink(modeling, 300, {"width": 64}, {"width": 32}, {"hidden_size": 16, "patch_size": 14})
    assert modeling.get_gemma_config("gemma_2b") == {"width": 64}
    assert modeling.get_gemma_config("gemma_300m") == {"width": 32}
    text = types.SimpleNamespace(hidden_size=64)
    config = types.SimpleNamespace(vision_config=types.SimpleNamespace(), text_config=text)
    assert modeling.PaliGemmaForConditionalGenerationWithPiGemma(config) == "vlm"
    assert config.vision_config.hidden_size == 16 and config.vision_config.projection_dim == 64
    assert config.hidden_size == 64 and text.vocab_size == 300
    expert_config = types.SimpleNamespace()
    assert modeling.PiGemmaForCausalLM(expert_config) == "expert" and expert_config.vocab_size == 300


def test_vs_lerobot_without_lerobot_names_lerobot_not_a_checkout_file(tmp_path, monkeypatch):
    try:
        import lerobot  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("lerobot is installed here: the comparison itself runs (bench/pi0_vs_lerobot.py)")
    from flashrt.bench.adapters.pi0 import _lerobot_gen
    from flashrt.bench.registry import ReferenceUnavailable

    monkeypatch.chdir(tmp_path)  # not a checkout
    with pytest.raises(ReferenceUnavailable, match="lerobot 0.6.1 is not importable"):
        _lerobot_gen()
