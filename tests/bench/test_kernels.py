"""`flashrt kernels`: the per-model table (meta-device counts), one JSON line last."""

import json

from typer.testing import CliRunner

from flashrt.bench.kernels import count_card, release_cards
from flashrt.cli import app


def test_table_and_json_line_for_named_cards():
    res = CliRunner().invoke(app, ["kernels", "pi05-tiny", "hifigan-v1", "--precision", "fp32", "--top", "3"])
    assert res.exit_code == 0, res.output
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert line["kind"] == "kernels" and line["precision"] == "fp32" and set(line["models"]) == {
        "pi05-tiny", "hifigan-v1"}
    assert line["models"]["pi05-tiny"]["total"] == count_card("pi05-tiny", "fp32").total
    assert len(line["models"]["hifigan-v1"]["top"]) == 12


def test_release_cards_leave_out_the_tiny_ones():
    cards = release_cards()
    assert {"pi0-base", "pi05-base", "hifigan-v1"} <= set(cards) and not any(c.endswith("-tiny") for c in cards)


def test_bf16_adds_casts_and_cameras_share_the_vision_batch():
    fp32, bf16 = count_card("pi0-tiny", "fp32"), count_card("pi0-tiny", "bf16")
    assert bf16.by_op["aten._to_copy.default"] > fp32.by_op["aten._to_copy.default"]
    assert count_card("pi0-tiny", "fp32", cams=3).total == fp32.total  # cameras are one batched pass
