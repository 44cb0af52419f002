"""`flashrt kernels`: CUDA-path kernel counts per family on the meta device, pinned; table + JSON line."""

import json

import pytest
from typer.testing import CliRunner

from flashrt.bench.kernels import count_card, count_family, release_cards
from flashrt.cli import app, main

# CUDA-path kernels per full-size step (bf16, 2 cameras), exactly as counted: a change that adds kernels
# fails here; one that removes some updates the numbers (and the bench docs).
PINNED = {
    ("pi0", "cuda"): {"pi0-base": 2391},
    ("pi05", "cuda"): {"pi05-base": 2203},
    ("pi0", "cuda-aten"): {"pi0-base": 7403},
    ("pi05", "cuda-aten"): {"pi05-base": 6814},
    ("groot", "cuda"): {"groot-n1.7": 2381},
    ("groot", "cuda-aten"): {"groot-n1.7": 2861},
    ("pi0-fast", "cuda"): {"pi0-fast prefill": 560, "pi0-fast decode/token": 253},  # prefill samples: +4
    ("pi0-fast", "cuda-aten"): {"pi0-fast prefill": 981, "pi0-fast decode/token": 417},
    # the sampled token by its inverse CDF (2026-12-04, runtime/sampling.py): 4 kernels more than Gumbel-max
    # the slot decoder's variates tabulated at join (runtime/slots.py, step_uniforms): a decode step
    # gathers its u (-48 kernels), the prefill fills the row's table (+2); then a top-k normalizer shared
    # by any number of ranks (runtime/sampling.py `draw`): +3 per draw
    ("lm", "cuda"): {"orpheus-lm prefill": 790, "orpheus-lm decode/token @1": 403,
                     "orpheus-lm decode/step @8": 403},
    ("lm", "cuda-aten"): {"orpheus-lm prefill": 1413, "orpheus-lm decode/token @1": 1026,
                          "orpheus-lm decode/step @8": 1026},
}


@pytest.mark.parametrize("family,path", sorted(PINNED))
def test_each_family_launches_its_pinned_kernel_count(family, path):
    counts = count_family(family, "bf16", 2, path)
    assert {name: c.total for name, c in counts.items()} == PINNED[family, path]
    for c in counts.values():  # no attention bias re-padded per call (rows allocated 8-aligned)
        assert "sdpa.efficient pad bias" not in c.by_op and sum(c.by_stage.values()) == c.total


@pytest.mark.parametrize("card,budget", [("pi0-base", 2500), ("pi05-base", 2300)])
def test_release_size_pi0_stays_within_its_kernel_budget(card, budget):
    """Full-size Pi0 / Pi0.5, 2 cameras, 10 steps, bf16, the fused row (a CUDA install with csrc)."""
    fused = count_card(card, "bf16")
    assert fused.total <= budget
    assert fused.by_op["aten._to_copy.default"] <= 40  # casts once at load, not per norm
    assert fused.by_stage["vision"] and fused.by_stage["prefix"] and fused.by_stage["expert"]
    assert 0.3 < fused.fused_share < 1 and fused.fused == sum(
        n for op, n in fused.by_op.items() if op.startswith("flashrt."))
    assert count_card(card, "bf16", kernels="aten").total > 2 * fused.total


def test_table_and_json_line_for_families_and_cards():
    res = CliRunner().invoke(app, ["kernels", "pi05", "pi05-tiny", "hifigan-v1", "--path", "cuda",
                                   "--precision", "fp32", "--top", "3"])
    assert res.exit_code == 0, res.output
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert (line["kind"], line["path"], line["precision"], line["cams"]) == ("kernels", "cuda", "fp32", 2)
    assert set(line["models"]) == {"pi05-base", "pi05-tiny", "hifigan-v1"}
    tiny = line["models"]["pi05-tiny"]
    assert tiny["total"] == count_card("pi05-tiny", "fp32").total < count_card("pi05-tiny", "fp32",
                                                                                kernels="aten").total
    assert tiny["fused"] > 0 and tiny["fused_share"] == round(tiny["fused"] / tiny["total"], 4)
    assert set(tiny["stages"]) <= {"vision", "prefix", "expert", "other"}
    assert sum(tiny["stages"].values()) == tiny["total"]
    assert line["models"]["hifigan-v1"]["fused"] == 0 and len(line["models"]["hifigan-v1"]["top"]) == 12
    assert "pi05-base" in res.stderr and "share" in res.stderr


def test_the_aten_path_counts_no_fused_kernel():
    res = CliRunner().invoke(app, ["kernels", "pi0-tiny", "--path", "cuda-aten"])
    assert res.exit_code == 0, res.output
    row = json.loads(res.stdout.strip().splitlines()[-1])["models"]["pi0-tiny"]
    assert row["fused"] == 0 and row["total"] == count_card("pi0-tiny", "bf16", kernels="aten").total


@pytest.mark.parametrize("args", [["pi0x"], ["pi0", "--path", "cpu"], ["pi0", "--precision", "fp8"]])
def test_bad_names_are_one_line_errors(args, capsys):
    assert main(["kernels", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flashrt: error:")


def test_release_cards_leave_out_the_tiny_ones():
    cards = release_cards()
    assert {"pi0-base", "pi05-base", "hifigan-v1"} <= set(cards)
    assert not any(c.endswith("-tiny") for c in cards)


def test_bf16_adds_casts_and_cameras_share_the_vision_batch():
    fp32, bf16 = count_card("pi0-tiny", "fp32"), count_card("pi0-tiny", "bf16")
    assert bf16.by_op["aten._to_copy.default"] > fp32.by_op["aten._to_copy.default"]
    assert count_card("pi0-tiny", "fp32", cams=3).total == fp32.total  # cameras are one batched pass
