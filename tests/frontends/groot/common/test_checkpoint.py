"""GR00T checkpoint folders made wrong one field at a time: each is a CheckpointError naming the file
or field (never a raw KeyError, a hang on a FIFO, or a silently wrong policy)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from flashrt.errors import CheckpointError
from flashrt.frontends.groot import family

CKPT = Path(__file__).resolve().parents[3] / "fixtures" / "groot" / "n17_tiny"


def _json(folder: Path, name: str, edit) -> None:
    data = json.loads((folder / name).read_text())
    edit(data)
    (folder / name).write_text(json.dumps(data))


def _fifo(folder: Path, name: str) -> None:
    (folder / name).unlink()
    os.mkfifo(folder / name)


CASES = {
    "no statistics": (lambda f: (f / "statistics.json").unlink(), "statistics.json"),
    "statistics not JSON": (lambda f: (f / "statistics.json").write_text("{nope"), "statistics.json"),
    "statistics a FIFO": (lambda f: _fifo(f, "statistics.json"), "statistics.json"),
    "config a FIFO": (lambda f: _fifo(f, "config.json"), "config.json"),
    "missing max": (
        lambda f: _json(f, "statistics.json", lambda d: d["tag_a"]["action"]["arm"].pop("max")),
        "tag_a.action.arm",
    ),
    "id out of range": (
        lambda f: _json(f, "embodiment_id.json", lambda d: d.update(tag_a=99)),
        "embodiment_id",
    ),
    "relative stats missing": (
        lambda f: _json(f, "statistics.json", lambda d: d["tag_rel"].pop("relative_action")),
        "relative_action",
    ),
    "no select_layer": (lambda f: _json(f, "config.json", lambda d: d.pop("select_layer")), "select_layer"),
    "DiT heads": (
        lambda f: _json(f, "config.json", lambda d: d["diffusion_model_cfg"].update(num_attention_heads=3)),
        "input_embedding_dim",
    ),
    "letter box": (
        lambda f: _json(
            f, "processor_config.json", lambda d: d["processor_kwargs"].update(letter_box_transform=True)
        ),
        "letter-box",
    ),
    "weights missing a tensor": (lambda f: _drop_tensor(f), "missing"),
}


def _drop_tensor(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(folder / "model.safetensors"))
    sd.pop("action_head.vlln.weight")
    save_file(sd, str(folder / "model.safetensors"))


@pytest.mark.parametrize("name", list(CASES))
def test_bad_checkpoint_is_a_checkpoint_error(tmp_path, name):
    folder = tmp_path / "ckpt"
    shutil.copytree(CKPT, folder)
    mutate, match = CASES[name]
    mutate(folder)
    tag = "tag_rel" if "relative" in name else "tag_a"
    with pytest.raises(CheckpointError, match=match):
        family.load(folder, embodiment=tag)


def test_missing_tokenizer_names_the_option_and_the_cli_flag(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(CKPT, folder)
    (folder / "backbone" / "tokenizer.json").unlink()
    _json(folder, "config.json", lambda d: d.update(model_name=str(folder / "backbone")))
    with pytest.raises(CheckpointError, match=r"tokenizer=PATH \(CLI: --tokenizer PATH"):
        family.load(folder, embodiment="tag_a")
    with pytest.raises(CheckpointError, match="--tokenizer PATH"):
        family.load(folder, embodiment="tag_a", tokenizer=tmp_path / "absent.json")
