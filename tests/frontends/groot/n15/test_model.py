"""GR00T N1.5 model level vs the lerobot 0.5.1 source (fixtures from tests/fixtures/gen/gen_groot_n15.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashrt.errors import CheckpointError
from flashrt.frontends.groot.n15.model import load_n15, n15_config
from flashrt.io import open_checkpoint
from flashrt.runtime.graphs import get_backend

FIX = Path(__file__).resolve().parents[3] / "fixtures" / "groot"
IO = load_file(str(FIX / "n15_io.safetensors"))
CASES = ("one_image", "two_images")


@pytest.fixture(scope="module")
def model(one_thread):
    config = n15_config(FIX / "n15_tiny")
    with open_checkpoint(FIX / "n15_tiny") as ckpt:
        return load_n15(config, ckpt)


def _run(model, case: str, bucket: int | None = None, backend: str = "eager") -> torch.Tensor:
    ids = IO[f"{case}/eagle_input_ids"]
    n = ids.shape[1]
    bucket = bucket or n
    tokens = torch.zeros(1, bucket, dtype=torch.long)
    tokens[:, :n] = ids
    mask = torch.arange(bucket)[None] < n
    slots = (ids[0] == model.config.eagle.image_token).nonzero()[:, 0]
    out = torch.zeros(1, *IO[f"{case}/noise"].shape)
    tables = model.tables(bucket)
    args = (
        IO[f"{case}/eagle_pixel_values"],
        tokens,
        mask,
        slots,
        IO[f"{case}/state"],
        IO[f"{case}/noise"][None],
        out,
        tables,
        int(IO[f"{case}/embodiment_id"][0]),
    )

    def step():
        with torch.inference_mode():
            model.sample_actions(*args)

    get_backend(backend).capture(step).replay()
    return out[0]


@pytest.mark.parametrize("case", CASES)
def test_matches_lerobot_051(model, case):
    assert (_run(model, case) - IO[f"{case}/action_pred"]).abs().max().item() <= 1e-4


def test_padded_bucket_and_trace_bit_for_bit(model):
    """Right padding to a bucket changes nothing (causal text, padding keys masked); trace == eager."""
    ref = IO["two_images/action_pred"]
    eager = _run(model, "two_images", bucket=24)
    assert (eager - ref).abs().max().item() <= 1e-4
    assert torch.equal(_run(model, "two_images", bucket=24, backend="trace"), eager)


def test_wrong_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "Gr00tN1d7"}')
    with pytest.raises(CheckpointError, match="gr00t_n1_5"):
        n15_config(tmp_path)
