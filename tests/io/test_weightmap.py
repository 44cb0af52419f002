"""flashrt/io/weightmap.py: templates, strictness (one error for everything), aliases, tied weights."""

from __future__ import annotations

import logging

import pytest
import torch

from flashrt.errors import CheckpointError, ConfigError
from flashrt.io import Alt, Checkpoint, Rule, WeightMap, transforms


def _ckpt(**shapes) -> Checkpoint:
    g = torch.Generator().manual_seed(1)
    tensors = {k.replace("__", "."): torch.randn(*s, generator=g) for k, s in shapes.items()}
    return Checkpoint.from_tensors(tensors)


def _layers(n=2, prefix="model."):
    g = torch.Generator().manual_seed(2)
    out = {}
    for i in range(n):
        out[f"{prefix}layers.{i}.up.weight"] = torch.randn(6, 4, generator=g)
        out[f"{prefix}layers.{i}.down.weight"] = torch.randn(4, 6, generator=g)
    out[f"{prefix}norm.weight"] = torch.randn(4, generator=g)
    return out


LAYER_MAP = WeightMap([
    Rule("model.layers.{i}.up.weight", "blocks.{i}.w1.weight"),
    Rule("model.layers.{i}.down.weight", "blocks.{i}.w2.weight", transforms.transpose()),
    Rule("model.norm.weight", "norm.weight"),
])


def test_templates_map_every_layer():
    src = _layers()
    out = LAYER_MAP.apply(src)
    assert sorted(out) == sorted(["blocks.0.w1.weight", "blocks.1.w1.weight", "blocks.0.w2.weight",
                                  "blocks.1.w2.weight", "norm.weight"])
    torch.testing.assert_close(out["blocks.1.w2.weight"], src["model.layers.1.down.weight"].T)
    assert out["blocks.1.w2.weight"].is_contiguous()
    assert out["norm.weight"] is src["model.norm.weight"]  # identity: no copy


def test_fields_match_one_segment_only():
    src = {"model.layers.0.x.up.weight": torch.ones(1)}
    with pytest.raises(CheckpointError, match="unexpected"):
        WeightMap([Rule("model.layers.{i}.up.weight", "l.{i}")]).apply(src)


def test_repeated_field_must_repeat_value():
    wm = WeightMap([Rule("enc.{i}.to.{i}", "e.{i}")], ignore=("enc.*",))
    out = wm.apply({"enc.1.to.1": torch.ones(1), "enc.1.to.2": torch.ones(1)})
    assert list(out) == ["e.1"]


@pytest.mark.parametrize("source,target", [
    ("a.{i}.w", "b.w"),                 # target lacks a source field
    ("a.w", "b.{i}.w"),                 # target field not bound by the source
    (("a.{i}.g", "a.v"), "b.{i}"),      # tuple element missing the field
    (Alt("a.{i}", "b.{j}"), "c.{i}"),   # alternative with another field
])
def test_field_consistency_checked_at_construction(source, target):
    with pytest.raises(ConfigError, match="fields"):
        Rule(source, target, transform=transforms.concat() if isinstance(source, tuple) else None)


def test_bad_rules_refused():
    with pytest.raises(ConfigError, match="no transform"):
        Rule(("a", "b"), "c")
    with pytest.raises(ConfigError, match="at least two"):
        Alt("a")
    with pytest.raises(ConfigError, match="look like"):
        Rule("a.{0}", "b.{0}")


def test_all_three_failures_in_one_error():
    expected = {"blocks.0.w1.weight": torch.Size([6, 4]), "blocks.0.w2.weight": torch.Size([4, 6]),
                "norm.weight": torch.Size([4]), "blocks.0.extra.weight": torch.Size([2])}
    src = _layers(n=1)
    src["model.layers.0.down.weight"] = torch.ones(4, 5)  # mis-shaped after transpose
    src["model.stray.bias"] = torch.ones(3)                # unexpected
    with pytest.raises(CheckpointError) as err:
        LAYER_MAP.apply(src, expected)
    msg = str(err.value)
    assert "1 missing, 1 unexpected, 1 mis-shaped" in msg
    assert "blocks.0.extra.weight" in msg
    assert "model.stray.bias" in msg
    assert "model.layers.0.down.weight -> blocks.0.w2.weight: checkpoint gives (5, 4), " \
           "module expects (4, 6)" in msg


def test_shapes_checked_before_reading_data():
    class Counting(dict):
        reads = 0

        def __getitem__(self, k):
            Counting.reads += 1
            return super().__getitem__(k)

        def shape(self, k):
            return dict.__getitem__(self, k).shape

        def dtype(self, k):
            return dict.__getitem__(self, k).dtype

    src = Counting(_layers(n=1))
    expected = {"blocks.0.w1.weight": (6, 4), "blocks.0.w2.weight": (4, 4), "norm.weight": (4,)}
    with pytest.raises(CheckpointError, match="mis-shaped"):
        LAYER_MAP.apply(src, expected)
    assert Counting.reads == 0


def test_long_lists_are_truncated():
    src = {f"junk.{i}": torch.ones(1) for i in range(45)}
    with pytest.raises(CheckpointError, match=r"unexpected \[45\]:[\s\S]*\.\.\. and 25 more"):
        WeightMap([Rule("w", "w")]).apply({**src, "w": torch.ones(1)})


def test_produced_target_not_in_module_is_unexpected():
    msg = "model.norm.weight -> norm.weight \\(module has no such slot\\)"
    with pytest.raises(CheckpointError, match=msg):
        LAYER_MAP.apply(_layers(n=1), {"blocks.0.w1.weight": (6, 4), "blocks.0.w2.weight": (6, 4)})


def test_literal_rule_without_source_is_missing_without_expected():
    src = _layers(n=1)
    del src["model.norm.weight"]
    with pytest.raises(CheckpointError, match="missing.*\n  norm.weight \\(no source"):
        LAYER_MAP.apply(src)


def test_templated_rule_matching_nothing_is_fine_unless_required():
    wm = LAYER_MAP + WeightMap([Rule("model.adapters.{i}.w", "adapters.{i}.w")])
    assert len(wm.apply(_layers(n=1))) == 3


def test_ignore_patterns():
    src = {**_layers(n=1), "model.layers.0.rotary.inv_freq": torch.ones(2), "optimizer.state": torch.ones(1)}
    wm = WeightMap(LAYER_MAP.rules, ignore=("model.layers.{i}.rotary.inv_freq", "optimizer.*"))
    assert len(wm.apply(src)) == 3
    assert wm.is_ignored("optimizer.a.b") and not wm.is_ignored("model.layers.0.x")


def test_tuple_sources_all_required():
    wm = WeightMap([Rule(("{p}.weight_g", "{p}.weight_v"), "{p}.weight", transforms.weight_norm())])
    src = _ckpt(c0__weight_g=(3, 1, 1), c0__weight_v=(3, 2, 5), c1__weight_g=(3, 1, 1))
    with pytest.raises(CheckpointError) as err:
        wm.apply(src, {"c0.weight": (3, 2, 5), "c1.weight": (3, 2, 5)})
    msg = str(err.value)
    assert "c1.weight (source c1.weight_v absent from checkpoint)" in msg
    assert "no rule produced it" not in msg  # one line per problem, not two
    assert "unexpected" not in msg  # the present g is explained by the missing line


def test_alt_first_present_wins(caplog):
    wm = WeightMap([Rule(Alt("time_mlp_in.{x}", "action_time_mlp_in.{x}"), "time_in.{x}")])
    new, old = torch.ones(2), torch.zeros(2)
    assert wm.apply({"time_mlp_in.weight": new})["time_in.weight"] is new
    with caplog.at_level(logging.INFO, logger="flashrt.io.weightmap"):
        assert wm.apply({"action_time_mlp_in.weight": old})["time_in.weight"] is old
    assert "alternative key 'action_time_mlp_in.weight'" in caplog.text
    with pytest.raises(CheckpointError, match="unexpected.*\n  action_time_mlp_in.weight"):
        wm.apply({"time_mlp_in.weight": new, "action_time_mlp_in.weight": old})


def test_tied_weights_share_one_read():
    wm = WeightMap([Rule("embed.weight", "embed.weight"), Rule("embed.weight", "lm_head.weight"),
                    Rule("embed.weight", "lm_head_t.weight", transforms.transpose())])
    src = _ckpt(embed__weight=(5, 3))
    out = wm.apply(src, {"embed.weight": (5, 3), "lm_head.weight": (5, 3), "lm_head_t.weight": (3, 5)})
    assert out["embed.weight"] is out["lm_head.weight"]
    torch.testing.assert_close(out["lm_head_t.weight"], src["embed.weight"].T)


def test_two_rules_same_target_conflict():
    wm = WeightMap([Rule("a", "x"), Rule("b", "x")])
    with pytest.raises(CheckpointError, match="conflicting.*\n  x <- a\n  x <- b"):
        wm.apply({"a": torch.ones(1), "b": torch.ones(1)})


def test_fused_qkv_split():
    qkv = torch.arange(12.0).reshape(6, 2)
    wm = WeightMap([Rule("attn.qkv", f"attn.{n}", transforms.split(i, 3)) for i, n in enumerate("qkv")])
    out = wm.apply({"attn.qkv": qkv})
    torch.testing.assert_close(out["attn.k"], qkv[2:4])
    with pytest.raises(CheckpointError, match="not divisible"):
        wm.apply({"attn.qkv": torch.ones(5, 2)})  # meta cannot tell, the real run raises


def test_prefix_helpers():
    plain = {k.removeprefix("model."): v for k, v in _layers(n=1).items()}
    bare = WeightMap([Rule(r.source.removeprefix("model."), r.target, r.transform) for r in LAYER_MAP.rules])
    assert len(bare.with_prefix("model.").apply(_layers(n=1))) == 3
    assert len(bare.auto_prefix(plain, ("model.", "")).apply(plain)) == 3
    assert len(bare.auto_prefix(_layers(n=1), ("", "model.")).apply(_layers(n=1))) == 3


def test_dtype_rule_then_slot_then_checkpoint():
    src = {"a": torch.ones(2), "b": torch.ones(2), "c": torch.ones(2, dtype=torch.float16)}
    wm = WeightMap([Rule("a", "a", dtype=torch.bfloat16), Rule("b", "b"), Rule("c", "c")])
    slots = {"a": torch.empty(2, dtype=torch.float64, device="meta"),
             "b": torch.empty(2, dtype=torch.float64, device="meta"), "c": torch.Size([2])}
    out = wm.apply(src, slots)
    assert (out["a"].dtype, out["b"].dtype, out["c"].dtype) == (torch.bfloat16, torch.float64, torch.float16)


def test_star_field_spans_segments():
    wm = WeightMap([Rule(("{*p}.weight_g", "{*p}.weight_v"), "{*p}.weight", transforms.weight_norm()),
                    Rule("{*p}.bias", "{*p}.bias")], ignore=("{*p}.num_batches_tracked",))
    src = _ckpt(ups__0__weight_g=(3, 1, 1), ups__0__weight_v=(3, 2, 4), ups__0__bias=(2,),
                resblocks__1__convs1__2__weight_g=(2, 1, 1), resblocks__1__convs1__2__weight_v=(2, 2, 3))
    src_keys = dict(src)
    src_keys["bn.num_batches_tracked"] = torch.tensor(3)
    out = wm.apply(src_keys)
    assert sorted(out) == ["resblocks.1.convs1.2.weight", "ups.0.bias", "ups.0.weight"]
    with pytest.raises(ConfigError, match="fields"):
        Rule("{*p}.x", "y")


def test_alternative_forms_of_one_literal_target():
    forms = [Rule("conv.weight", "conv.weight"),
             Rule(("conv.weight_g", "conv.weight_v"), "conv.weight", transforms.weight_norm())]
    wm = WeightMap(forms)
    assert list(wm.apply({"conv.weight": torch.ones(2, 1)})) == ["conv.weight"]
    legacy = {"conv.weight_g": torch.ones(2, 1), "conv.weight_v": torch.ones(2, 1)}
    assert list(wm.apply(legacy)) == ["conv.weight"]
    with pytest.raises(CheckpointError, match=r"conv.weight \(no source 'conv.weight' or \('conv.weight_g'"):
        wm.apply({"other": torch.ones(1)})


def test_partial_form_ignored_when_another_form_fills_the_target():
    forms = [Rule("{p}.weight", "{p}.weight"),
             Rule(("{p}.weight_g", "{p}.weight_v"), "{p}.weight", transforms.weight_norm())]
    src = {"conv.weight": torch.ones(2, 1), "conv.weight_g": torch.ones(2, 1)}
    with pytest.raises(CheckpointError) as err:
        WeightMap(forms).apply(src)
    assert "missing" not in str(err.value) and "unexpected [1]:\n  conv.weight_g" in str(err.value)


def test_device_move_keeps_ties():
    wm = WeightMap([Rule("embed.weight", "embed.weight"), Rule("embed.weight", "lm_head.weight")])
    out = wm.apply(_ckpt(embed__weight=(5, 3)), device="meta")  # meta stands in for an accelerator
    assert out["embed.weight"].is_meta and out["embed.weight"] is out["lm_head.weight"]


@pytest.mark.parametrize("level, layers, bar", [(logging.INFO, 40, True), (logging.WARNING, 40, False),
                                                (logging.INFO, 2, False)])
def test_progress_bar_while_loading_a_large_checkpoint_only_when_verbose(capsys, level, layers, bar):
    """`flashrt -v` (INFO) shows a bar on stderr while a release-size checkpoint's tensors are mapped;
    quiet by default, and never for a small checkpoint."""
    logger = logging.getLogger("flashrt.io.weightmap")
    saved = logger.level
    logger.setLevel(level)
    try:
        out = LAYER_MAP.apply(_layers(layers))
    finally:
        logger.setLevel(saved)
    assert len(out) == 2 * layers + 1
    assert ("loading" in capsys.readouterr().err) == bar


def test_device_move_never_mistakes_a_freed_tensor_for_a_tie(tmp_path):
    """Each tensor read from a file is a new host tensor, freed after its move: Python may give the
    next one the same id(). Caught on the first GPU run: a Pi0 checkpoint loaded onto CUDA came back
    with other slots' tensors (`vision.pos` holding a bias). Meta stands in for the accelerator."""
    from safetensors.torch import save_file

    from flashrt.io.checkpoint import open_checkpoint

    g = torch.Generator().manual_seed(3)
    tensors = {f"layer{i}.weight": torch.randn(i + 1, 2 * i + 3, generator=g) for i in range(40)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    wm = WeightMap([Rule(k, k) for k in tensors])
    out = wm.apply(open_checkpoint(tmp_path / "model.safetensors"), device="meta")
    assert {k: tuple(t.shape) for k, t in out.items()} == {k: tuple(t.shape) for k, t in tensors.items()}
    assert len({id(t) for t in out.values()}) == len(tensors)
