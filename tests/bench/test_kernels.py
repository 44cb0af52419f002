"""`flashrt kernels`: the per-model table (meta-device counts), one JSON line last."""

import json

import pytest
from typer.testing import CliRunner

from flashrt.bench.kernels import count_card, release_cards
from flashrt.cli import app


def test_table_and_json_line_for_named_cards():
    res = CliRunner().invoke(app, ["kernels", "pi05-tiny", "hifigan-v1", "--precision", "fp32", "--top", "3"])
    assert res.exit_code == 0, res.output
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert line["kind"] == "kernels" and line["precision"] == "fp32" and set(line["models"]) == {
        "pi05-tiny", "hifigan-v1"}
    pi05 = line["models"]["pi05-tiny"]
    assert pi05["fused"]["total"] == count_card("pi05-tiny", "fp32").total
    aten = count_card("pi05-tiny", "fp32", kernels="aten").total
    assert pi05["aten"]["total"] == aten > pi05["fused"]["total"]
    assert line["models"]["hifigan-v1"]["aten"] == line["models"]["hifigan-v1"]["fused"]
    assert len(line["models"]["hifigan-v1"]["fused"]["top"]) == 12


def test_release_cards_leave_out_the_tiny_ones():
    cards = release_cards()
    assert {"pi0-base", "pi05-base", "hifigan-v1"} <= set(cards)
    assert not any(c.endswith("-tiny") for c in cards)


def test_bf16_adds_casts_and_cameras_share_the_vision_batch():
    fp32, bf16 = count_card("pi0-tiny", "fp32"), count_card("pi0-tiny", "bf16")
    assert bf16.by_op["aten._to_copy.default"] > fp32.by_op["aten._to_copy.default"]
    assert count_card("pi0-tiny", "fp32", cams=3).total == fp32.total  # cameras are one batched pass


@pytest.mark.parametrize("card", ["pi0-base", "pi05-base"])
def test_release_size_pi0_launches_at_most_2500_kernels_per_replay(card):
    """Issue #17's target, by construction: full-size Pi0 / Pi0.5, 2 cameras, 10 steps, bf16, the fused
    row (what a CUDA install with the csrc kernels launches); the ATen row stays far above."""
    fused = count_card(card, "bf16")
    assert fused.total <= 2500
    assert fused.by_op["aten._to_copy.default"] <= 40  # casts once at load, not per norm
    assert count_card(card, "bf16", kernels="aten").total > 2 * fused.total
