"""flashrt/io/checkpoint.py: formats, directory detection, refusal of truncated/corrupt/unsafe files."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from flashrt.errors import CheckpointError
from flashrt.io import Checkpoint, open_checkpoint, save_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(4, 3, generator=g),
        "a.bias": torch.randn(4, generator=g).to(torch.bfloat16),
        "b.idx": torch.arange(5, dtype=torch.int64),
        "c.empty": torch.zeros(0, 2),
    }


def _assert_same(ckpt: Checkpoint, ref: dict[str, torch.Tensor]) -> None:
    assert sorted(ckpt) == sorted(ref)
    for k, v in ref.items():
        assert ckpt.shape(k) == v.shape and ckpt.dtype(k) == v.dtype
        torch.testing.assert_close(ckpt[k], v, rtol=0, atol=0)


def _write_sharded(tmp_path, ref, name="model.safetensors.index.json"):
    keys = list(ref)
    shards = {"model-00001-of-00002.safetensors": keys[:2], "model-00002-of-00002.safetensors": keys[2:]}
    weight_map = {}
    for file, ks in shards.items():
        save_safetensors({k: ref[k] for k in ks}, tmp_path / file)
        weight_map.update(dict.fromkeys(ks, file))
    index = tmp_path / name
    index.write_text(json.dumps({"metadata": {"total_size": 123}, "weight_map": weight_map}))
    return index


def test_single_safetensors_roundtrip_with_metadata(tmp_path):
    ref = _tensors()
    path = save_safetensors(ref, tmp_path / "m.safetensors", metadata={"format": "pt", "x": "1"})
    with open_checkpoint(path) as ckpt:
        _assert_same(ckpt, ref)
        assert ckpt.metadata == {"format": "pt", "x": "1"}
        assert ckpt.files == (path,)
        info = ckpt.info("a.weight")
        assert info.data_offsets[1] - info.data_offsets[0] == 4 * 3 * 4
        assert ckpt.nbytes() == sum(v.numel() * v.element_size() for v in ref.values())
        assert "nope" not in ckpt
        with pytest.raises(KeyError):
            ckpt["nope"]


def test_save_safetensors_is_atomic_and_clones_shared(tmp_path):
    base = torch.arange(6.0)
    path = save_safetensors({"x": base, "y": base[:3]}, tmp_path / "s.safetensors")
    ckpt = open_checkpoint(path)
    assert ckpt["y"].tolist() == [0.0, 1.0, 2.0]
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]  # no temp file left behind


def test_sharded_index(tmp_path):
    ref = _tensors()
    index = _write_sharded(tmp_path, ref)
    ckpt = open_checkpoint(index)
    _assert_same(ckpt, ref)
    assert ckpt.metadata == {"total_size": 123}
    assert len(ckpt.files) == 2
    assert ckpt.info("b.idx").file.name == "model-00002-of-00002.safetensors"


def test_sharded_missing_shard_file(tmp_path):
    index = _write_sharded(tmp_path, _tensors())
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="missing.*model-00002-of-00002"):
        open_checkpoint(index)


def test_sharded_index_disagreeing_with_shard(tmp_path):
    index = _write_sharded(tmp_path, _tensors())
    data = json.loads(index.read_text())
    data["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="listed but absent.*ghost"):
        open_checkpoint(index)


def test_directory_detection_order(tmp_path):
    ref = _tensors()
    torch.save(ref, tmp_path / "pytorch_model.bin")
    assert open_checkpoint(tmp_path).files[0].name == "pytorch_model.bin"
    save_safetensors(ref, tmp_path / "other.safetensors")
    assert open_checkpoint(tmp_path).files[0].name == "other.safetensors"
    _write_sharded(tmp_path, ref)  # an index beats loose *.safetensors
    assert len(open_checkpoint(tmp_path).files) == 2
    save_safetensors(ref, tmp_path / "model.safetensors")
    assert open_checkpoint(tmp_path).files[0].name == "model.safetensors"


def test_directory_ambiguous_and_empty(tmp_path):
    with pytest.raises(CheckpointError, match=r"no checkpoint file found.*\(empty\)"):
        open_checkpoint(tmp_path)
    save_safetensors({"x": torch.ones(1)}, tmp_path / "a.safetensors")
    save_safetensors({"x": torch.ones(1)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match="ambiguous.*a.safetensors, b.safetensors"):
        open_checkpoint(tmp_path)


def test_missing_path_and_unknown_suffix(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        open_checkpoint(tmp_path / "nothing.safetensors")
    (tmp_path / "w.npz").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="unknown checkpoint format"):
        open_checkpoint(tmp_path / "w.npz")


def test_suffixless_files_are_sniffed(tmp_path):
    ref = _tensors()
    torch.save({"generator": ref}, tmp_path / "g_02500000")  # HiFi-GAN's naming
    _assert_same(open_checkpoint(tmp_path / "g_02500000", subkey="generator"), ref)
    torch.save(ref, tmp_path / "legacy", _use_new_zipfile_serialization=False)
    _assert_same(open_checkpoint(tmp_path / "legacy"), ref)
    save_safetensors(ref, tmp_path / "weights")
    _assert_same(open_checkpoint(tmp_path / "weights"), ref)


@pytest.mark.parametrize("cut", [1, 100, 4 * 12])
def test_truncated_safetensors_detected_at_open(tmp_path, cut):
    path = save_safetensors(_tensors(), tmp_path / "t.safetensors")
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(size - cut)
    with pytest.raises(CheckpointError, match=r"t\.safetensors.*truncated") as err:
        open_checkpoint(path)
    if cut < 60:  # data area cut: the message gives both byte counts
        assert f"expects {size} bytes, file has {size - cut} bytes" in str(err.value)


def test_tiny_truncated_file_and_trailing_bytes(tmp_path):
    path = save_safetensors(_tensors(), tmp_path / "t.safetensors")
    raw = path.read_bytes()
    path.write_bytes(raw + b"\0" * 8)
    with pytest.raises(CheckpointError, match="trailing bytes"):
        open_checkpoint(path)
    path.write_bytes(raw[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        open_checkpoint(path)


def test_corrupt_header(tmp_path):
    path = save_safetensors(_tensors(), tmp_path / "c.safetensors")
    raw = bytearray(path.read_bytes())
    raw[8] = ord("#")  # the header's opening brace
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupt safetensors header.*JSON"):
        open_checkpoint(path)
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(CheckpointError, match="'x' spans 8 bytes"):
        open_checkpoint(path)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointError, match="corrupt or truncated safetensors header"):
        open_checkpoint(path)


def test_corrupt_index_json(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match="shard index .* not valid JSON"):
        open_checkpoint(index)
    index.write_text("{}")
    with pytest.raises(CheckpointError, match="no 'weight_map'"):
        open_checkpoint(index)


def test_torch_bin_flat_and_legacy_format(tmp_path):
    ref = _tensors()
    torch.save(ref, tmp_path / "flat.bin")
    _assert_same(open_checkpoint(tmp_path / "flat.bin"), ref)
    torch.save(ref, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)  # not mmap-able
    _assert_same(open_checkpoint(tmp_path / "legacy.pt"), ref)


def test_torch_nested_subkey_explicit_and_auto(tmp_path):
    ref = _tensors()
    torch.save({"generator": ref, "steps": 10}, tmp_path / "g.pt")
    ckpt = open_checkpoint(tmp_path / "g.pt", subkey="generator")
    _assert_same(ckpt, ref)
    auto = open_checkpoint(tmp_path / "g.pt")
    assert auto.subkey == "generator"
    _assert_same(auto, ref)
    with pytest.raises(CheckpointError, match="no subkey 'gen'.*'generator' \\(dict\\)"):
        open_checkpoint(tmp_path / "g.pt", subkey="gen")


def test_torch_two_nested_dicts_needs_subkey(tmp_path):
    torch.save({"mpd": _tensors(), "mrd": _tensors()}, tmp_path / "d.pt")
    with pytest.raises(CheckpointError, match="not all tensors.*pass subkey="):
        open_checkpoint(tmp_path / "d.pt")
    assert open_checkpoint(tmp_path / "d.pt", subkey="mrd").subkey == "mrd"


def test_subkey_refused_for_safetensors(tmp_path):
    path = save_safetensors({"x": torch.ones(1)}, tmp_path / "x.safetensors")
    with pytest.raises(CheckpointError, match="subkey"):
        open_checkpoint(path, subkey="generator")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_malicious_pickle_refused(tmp_path):
    torch.save({"x": torch.ones(1), "evil": _Evil()}, tmp_path / "evil.bin")
    with pytest.raises(CheckpointError, match="not a weights-only state dict"):
        open_checkpoint(tmp_path / "evil.bin")


def test_truncated_torch_file(tmp_path):
    torch.save(_tensors(), tmp_path / "t.pt")
    raw = (tmp_path / "t.pt").read_bytes()
    (tmp_path / "t.pt").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="t.pt"):
        open_checkpoint(tmp_path / "t.pt")


def test_from_tensors_is_a_mapping():
    ref = _tensors()
    ckpt = Checkpoint.from_tensors(ref)
    _assert_same(ckpt, ref)
    assert len(ckpt) == 4 and "memory" in repr(ckpt)


def test_tensors_outlive_close_and_closed_reads_fail(tmp_path):
    path = save_safetensors(_tensors(), tmp_path / "m.safetensors")
    with open_checkpoint(path) as ckpt:
        kept = ckpt["a.weight"]
    assert kept.shape == (4, 3) and torch.isfinite(kept).all()
    with pytest.raises(CheckpointError, match="closed"):
        ckpt["a.bias"]
    assert ckpt.shape("a.bias") == (4,)  # header facts stay available
