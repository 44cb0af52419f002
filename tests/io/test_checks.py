"""Weights at load (flashrt/io/checks.py through WeightMap.apply / load_module): finite values, no implicit
cast across dtype kinds, missing weights named by their checkpoint key; hostile weight files."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flashrt.errors import CheckpointError
from flashrt.io import Checkpoint, Rule, WeightMap, load_module, open_checkpoint, save_safetensors
from flashrt.io.checks import dtype_kind, first_nonfinite, kind_problem
from flashrt.io.digest import file_digest
from flashrt.testing.hostile import HOSTILE_KINDS, bounded_call, make_hostile

pytestmark = pytest.mark.timeout(120)


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))


WMAP = WeightMap([Rule("w", "lin.weight"), Rule("b", "lin.bias"), Rule("n", "count")])


def _good() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(3, generator=g),
            "n": torch.tensor(2, dtype=torch.int64)}


def _load(tensors, dtype=None, wmap=WMAP):
    return load_module(Two, Checkpoint.from_tensors(tensors, "ckpt.safetensors"), wmap, dtype=dtype)


def test_good_weights_load_bit_exact():
    m = _load(_good())
    assert torch.equal(m.lin.weight, _good()["w"]) and int(m.count) == 2


NONFINITE = {
    "nan in weight": ("w", (1, 2), float("nan")),
    "inf in weight": ("w", (0, 0), float("inf")),
    "-inf in bias": ("b", (2,), float("-inf")),
    "nan last element": ("w", (2, 3), float("nan")),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("case", NONFINITE)
def test_nonfinite_weights_are_refused(case, dtype):
    key, pos, value = NONFINITE[case]
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in _good().items()}
    tensors[key][pos] = value
    with pytest.raises(CheckpointError, match="non-finite") as err:
        _load(tensors)
    msg = str(err.value)
    assert f"{key} -> lin." in msg and f"at {list(pos)}" in msg and "ckpt.safetensors" in msg


def test_overflow_on_the_cast_is_caught():
    tensors = _good()
    tensors["w"][0, 1] = 70_000.0  # finite in float32, inf in float16
    _load(tensors, dtype=torch.bfloat16)  # bf16 keeps the exponent range: fine
    with pytest.raises(CheckpointError, match=r"w -> lin.weight: inf at \[0, 1\]"):
        _load(tensors, dtype=torch.float16)


def test_every_nonfinite_tensor_is_listed_once():
    tensors = _good()
    tensors["w"][0, 0] = float("nan")
    tensors["b"][0] = float("nan")
    with pytest.raises(CheckpointError, match="2 non-finite") as err:
        _load(tensors)
    assert "w -> lin.weight" in str(err.value) and "b -> lin.bias" in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("where", [0, 9, 10, 11, 29])
def test_first_nonfinite_across_chunks(dtype, where):
    t = torch.zeros(30, dtype=torch.float32)
    assert first_nonfinite(t.to(dtype), chunk=10) is None
    t[where] = float("nan")
    assert first_nonfinite(t.to(dtype), chunk=10) == where


def test_first_nonfinite_ignores_integers_and_empty():
    assert first_nonfinite(torch.arange(5)) is None
    assert first_nonfinite(torch.empty(0)) is None
    assert first_nonfinite(torch.tensor(float("inf"))) == 0


WRONG_KIND = {
    "int in float slot": ("w", torch.int64, "int tensor in a float slot"),
    "int32 in float slot": ("b", torch.int32, "int tensor in a float slot"),
    "bool in float slot": ("w", torch.bool, "bool tensor in a float slot"),
    "uint8 in float slot": ("b", torch.uint8, "int tensor in a float slot"),
    "fp8 without scales": ("w", torch.float8_e4m3fn, "needs its scales"),
    "fp8 e5m2 without scales": ("b", torch.float8_e5m2, "needs its scales"),
    "float in int slot": ("n", torch.float32, "float tensor in a int slot"),
    "bool in int slot": ("n", torch.bool, "bool tensor in a int slot"),
    "complex in float slot": ("w", torch.complex64, "complex tensor in a float slot"),
}


@pytest.mark.parametrize("case", WRONG_KIND)
def test_wrong_dtype_kind_is_refused_not_cast(case):
    key, dtype, match = WRONG_KIND[case]
    tensors = _good()
    tensors[key] = tensors[key].to(dtype)
    with pytest.raises(CheckpointError, match="wrong dtype") as err:
        _load(tensors)
    assert match in str(err.value) and f"{key} -> " in str(err.value)


def test_float_widths_still_cast():
    tensors = {k: (v.half() if v.is_floating_point() else v) for k, v in _good().items()}
    assert _load(tensors).lin.weight.dtype == torch.float32
    tensors["n"] = tensors["n"].to(torch.int32)  # int widths too
    assert _load(tensors).count.dtype == torch.int64


def test_an_explicit_rule_dtype_may_change_the_kind():
    wmap = WeightMap([Rule("w", "lin.weight"), Rule("b", "lin.bias"), Rule("n", "count", dtype=torch.int64)])
    tensors = _good()
    tensors["n"] = torch.tensor(3.0)
    assert int(_load(tensors, wmap=wmap).count) == 3


def test_fp8_slot_refuses_a_float_tensor():
    assert "quantized with scales" in kind_problem(torch.float32, torch.float8_e4m3fn)
    assert kind_problem(torch.float8_e5m2, torch.float8_e4m3fn) is None
    assert [dtype_kind(d) for d in (torch.bool, torch.uint8, torch.float8_e4m3fn, torch.bfloat16)] == [
        "bool", "int", "fp8", "float"]


MISSING = {"weight": ("w", "'w' (for slot lin.weight): not in the checkpoint"),
           "bias": ("b", "'b' (for slot lin.bias): not in the checkpoint"),
           "buffer": ("n", "'n' (for slot count): not in the checkpoint")}


@pytest.mark.parametrize("case", MISSING)
def test_missing_weight_names_the_checkpoint_key(case):
    key, line = MISSING[case]
    tensors = {f"model.{k}": v for k, v in _good().items() if k != key}
    with pytest.raises(CheckpointError, match="1 missing") as err:
        _load(tensors, wmap=WMAP.with_prefix("model."))  # the key is named with its prefix
    assert line.replace(f"'{key}'", f"'model.{key}'") in str(err.value)


def test_missing_weight_names_the_checkpoint_key_through_a_template():
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(2, 2, bias=False) for _ in range(2))

    wmap = WeightMap([Rule("blocks.{i}.w", "layers.{i}.weight")])
    ckpt = Checkpoint.from_tensors({"blocks.0.w": torch.ones(2, 2)})
    with pytest.raises(CheckpointError, match=r"'blocks.1.w' \(for slot layers.1.weight\)"):
        load_module(Stack, ckpt, wmap)


# ------------------------------------------------------------------------------ hostile weight files

def _save(folder, name="model.safetensors"):
    return save_safetensors(_good(), folder / name)


PLACES = {
    "single safetensors": lambda d: d / "model.safetensors",
    "pytorch file": lambda d: d / "pytorch_model.bin",
    "suffix-less file": lambda d: d / "g_02500000",
}


@pytest.mark.parametrize("kind", [k for k in HOSTILE_KINDS if k != "dangling"])
@pytest.mark.parametrize("place", PLACES)
def test_hostile_weight_file(tmp_path, place, kind):
    path = make_hostile(PLACES[place](tmp_path), kind)
    exc = bounded_call(lambda: open_checkpoint(path), fifos=[path])
    assert isinstance(exc, CheckpointError), repr(exc)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_hostile_file_in_a_checkpoint_folder(tmp_path, kind):
    path = make_hostile(tmp_path / "model.safetensors", kind)
    exc = bounded_call(lambda: open_checkpoint(tmp_path), fifos=[path])
    assert isinstance(exc, CheckpointError) and "regular" in str(exc), repr(exc)


def _index(folder, weight_map):
    import json

    path = folder / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.mark.parametrize("kind", HOSTILE_KINDS)
def test_hostile_shard(tmp_path, kind):
    shard = make_hostile(tmp_path / "s1.safetensors", kind)
    index = _index(tmp_path, {"w": "s1.safetensors"})
    exc = bounded_call(lambda: open_checkpoint(index), fifos=[shard])
    assert isinstance(exc, CheckpointError), repr(exc)


@pytest.mark.parametrize("kind", HOSTILE_KINDS)
def test_hostile_index(tmp_path, kind):
    index = make_hostile(tmp_path / "model.safetensors.index.json", kind)
    exc = bounded_call(lambda: open_checkpoint(index), fifos=[index])
    assert isinstance(exc, CheckpointError), repr(exc)


SHARD_ESCAPES = {"absolute": "{outside}/s.safetensors", "parent": "../outside/s.safetensors",
                 "symlink out": "link/s.safetensors", "not a string": 7, "empty": ""}


@pytest.mark.parametrize("case", SHARD_ESCAPES)
def test_shard_names_stay_inside_the_folder(tmp_path, case):
    folder, outside = tmp_path / "ckpt", tmp_path / "outside"
    folder.mkdir(), outside.mkdir()
    _save(outside, "s.safetensors")
    (folder / "link").symlink_to(outside)
    name = SHARD_ESCAPES[case]
    name = name.format(outside=outside) if isinstance(name, str) else name
    index = _index(folder, {"w": name, "b": name, "n": name})
    with pytest.raises(CheckpointError, match=r"weight_map\['w'\]"):
        open_checkpoint(index)


def test_shard_in_a_subfolder_is_fine(tmp_path):
    (tmp_path / "shards").mkdir()
    _save(tmp_path / "shards", "s.safetensors")
    ckpt = open_checkpoint(_index(tmp_path, dict.fromkeys(_good(), "shards/s.safetensors")))
    assert torch.equal(ckpt["w"], _good()["w"])


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_hostile_file_digest(tmp_path, kind):
    path = make_hostile(tmp_path / "model.safetensors", kind)
    exc = bounded_call(lambda: file_digest(path, memo=False), fifos=[path])
    assert isinstance(exc, CheckpointError), repr(exc)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_hostile_digest_memo_is_ignored(tmp_path, kind):
    _save(tmp_path)
    memo = make_hostile(tmp_path / "memo" / "file-digests.json", kind)
    digest = bounded_call(lambda: file_digest(tmp_path / "model.safetensors", memo_dir=memo.parent),
                          fifos=[memo])
    assert digest is None


JUNK = {"text": b"hello\n", "binary": bytes(range(256)) * 4, "empty": b"",
        "zip header only": b"PK\x03\x04" + b"\0" * 60, "pickle opcode only": b"\x80\x02",
        "safetensors header only": (8).to_bytes(8, "little") + b"{}"}


@pytest.mark.parametrize("junk", JUNK)
@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.safetensors", "g_02500000"])
def test_junk_weight_file_is_a_checkpoint_error(tmp_path, name, junk):
    path = tmp_path / name
    path.write_bytes(JUNK[junk])
    with pytest.raises(CheckpointError, match=str(path)):
        open_checkpoint(path)


HEADER_EDITS = {  # (key, field, value): every one is a CheckpointError at open or first read
    "dtype unknown": ("w", "dtype", "F99"),
    "dtype not a string": ("w", "dtype", 5),
    "shape a string": ("w", "shape", "3,4"),
    "shape float dims": ("w", "shape", [3.0, 4.0]),
    "shape string dims": ("w", "shape", ["3", "4"]),
    "shape bool dim": ("w", "shape", [True, 12]),
    "shape negative dims": ("w", "shape", [-3, -4]),
    "shape huge dim": ("w", "shape", [2**70, 1]),
    "shape nested": ("w", "shape", [[3], 4]),
    "offsets three": ("w", "data_offsets", [0, 48, 48]),
    "offsets strings": ("w", "data_offsets", ["0", "48"]),
    "offsets floats": ("w", "data_offsets", [0.0, 48.0]),
    "offsets huge": ("w", "data_offsets", [0, 2**70]),
    "offsets negative": ("w", "data_offsets", [-48, 0]),
    "entry not an object": ("w", None, 5),
    "metadata not an object": ("__metadata__", None, 5),
    "metadata a list": ("__metadata__", None, [["a", "b"]]),
}


@pytest.mark.parametrize("case", HEADER_EDITS)
def test_malformed_safetensors_header(tmp_path, case):
    import json
    import struct

    key, field, value = HEADER_EDITS[case]
    good = _save(tmp_path, "good.safetensors").read_bytes()
    n = struct.unpack("<Q", good[:8])[0]
    header = json.loads(good[8:8 + n])
    if field is None:
        header[key] = value
    else:
        header[key][field] = value
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + good[8 + n:])
    with pytest.raises(CheckpointError, match=str(path)), open_checkpoint(path) as ckpt:
        for k in ckpt:
            ckpt[k]


TORCH_OBJECTS = {
    "a list": [torch.ones(2)],
    "a tensor": torch.ones(2),
    "int keys": {0: torch.ones(2), 1: torch.ones(2)},
    "mixed keys": {"w": torch.ones(2), 3: torch.ones(2)},
    "non-tensor values": {"w": torch.ones(2), "step": 3},
    "nested without subkey": {"a": {"w": torch.ones(2)}, "b": {"w": torch.ones(2)}},
}


@pytest.mark.parametrize("case", TORCH_OBJECTS)
def test_torch_file_that_is_not_a_state_dict(tmp_path, case):
    path = tmp_path / "pytorch_model.bin"
    torch.save(TORCH_OBJECTS[case], path)
    with pytest.raises(CheckpointError, match=str(path)):
        open_checkpoint(path)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float8_e4m3fn])
@pytest.mark.parametrize("which", ["g", "v"])
def test_a_transform_does_not_launder_a_wrong_source_kind(which, dtype):
    from flashrt.io import transforms

    class Conv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(2, 3, 1, bias=False)

    wmap = WeightMap([Rule(("g", "v"), "conv.weight", transforms.weight_norm(0))])
    tensors = {"g": torch.ones(3, 1, 1), "v": torch.ones(3, 2, 1)}
    tensors[which] = tensors[which].to(dtype)  # the fold's float32 math would turn it into floats
    with pytest.raises(CheckpointError, match=f"wrong dtype.*\n  {which} -> conv.weight"):
        load_module(Conv, Checkpoint.from_tensors(tensors), wmap)
