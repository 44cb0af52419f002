"""Recipe fields of quantized models: which GEMMs (globs), activation mode, gate bounds; shipped recipes."""

import pytest

from flashrt.errors import ConfigError
from flashrt.quant.calibrate import Recipe, load_recipe, recipe_from_dict


def test_shipped_pi0_recipes_pick_their_layers():
    full, cpu = load_recipe("pi0"), load_recipe("pi0-cpu")
    for name in ("vision.layers.0.qkv", "projector", "vlm.layers.3.gate_up"):
        assert full.quantizes(name) and cpu.quantizes(name)
    assert full.quantizes("expert.layers.1.down") and not cpu.quantizes("expert.layers.1.down")
    for name in ("action_in", "action_out", "state_in", "time_in", "expert.layers.0.input_norm.dense"):
        assert not full.quantizes(name)


@pytest.mark.parametrize("bad", [{"include": "vision.*"}, {"activations": "per_channel"},
                                 {"scale_factor": 0}, {"min_cosine": 1.5}, {"max_layer_error": -1},
                                 {"holdout": -1}, {"max_abs_delta": "big"}])
def test_bad_quantization_fields_are_config_errors(bad):
    with pytest.raises(ConfigError):
        recipe_from_dict(bad)


def test_key_fields_cover_the_quantization_choices():
    a, b = Recipe().key_fields("d"), Recipe(exclude=("vlm.*",), scale_factor=0.5).key_fields("d")
    assert a != b and {"include", "exclude", "activations", "scale_factor", "holdout"} <= set(a)
