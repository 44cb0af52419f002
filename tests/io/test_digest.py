"""Content digests and the file-digest memo (flashrt/io/digest.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import safetensors.torch
import torch

from flashrt.io import digest
from flashrt.io.digest import MEMO_FILENAME, file_digest, tensor_digest


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.arange(5, dtype=torch.int32)}


def test_tensor_digest_is_deterministic_and_order_free():
    t = _tensors()
    assert tensor_digest(t) == tensor_digest(dict(reversed(list(t.items()))))
    assert tensor_digest(t) == tensor_digest({k: v.clone() for k, v in t.items()})
    assert len(tensor_digest(t)) == 64


def test_tensor_digest_pins_its_encoding():
    """Independent re-implementation of the documented encoding with numpy bytes (keeps keys stable)."""
    t = {"x": torch.tensor([[1.0, 2.0]]), "a": torch.tensor([7], dtype=torch.int16)}
    h = hashlib.sha256(b"flashrt.tensor_digest.v1\0")
    for name in ("a", "x"):
        raw = t[name].numpy().tobytes()
        header = json.dumps([name, str(t[name].dtype), list(t[name].shape), len(raw)]).encode()
        h.update(len(header).to_bytes(8, "little") + header + raw)
    assert tensor_digest(t) == h.hexdigest()


@pytest.mark.parametrize("change", ["value", "dtype", "shape", "name", "extra"])
def test_tensor_digest_sees_every_change(change):
    t = _tensors()
    base = tensor_digest(t)
    w = t["a.weight"]
    if change == "value":
        w = w.clone()
        w[3, 2] = torch.nextafter(w[3, 2], torch.tensor(10.0))
        t["a.weight"] = w
    elif change == "dtype":
        t["a.weight"] = w.view(torch.int32)  # same bytes, other dtype
    elif change == "shape":
        t["a.weight"] = w.reshape(3, 4)  # same bytes, other shape
    elif change == "name":
        t["a.weights"] = t.pop("a.weight")
    else:
        t["c"] = torch.zeros(0)
    assert tensor_digest(t) != base


def test_tensor_digest_chunking_and_layout_do_not_matter():
    x = torch.randn(64, 33)
    assert tensor_digest({"x": x}, chunk_bytes=7) == tensor_digest({"x": x})
    assert tensor_digest({"x": x.T.contiguous().T}) == tensor_digest({"x": x})  # non-contiguous input


@pytest.mark.parametrize("t", [torch.tensor(3.5), torch.zeros(0, 3), torch.ones(3, dtype=torch.bfloat16),
                               torch.ones(3).to(torch.float8_e4m3fn), torch.tensor([True, False])])
def test_tensor_digest_handles_odd_tensors(t):
    assert len(tensor_digest({"t": t})) == 64


# ------------------------------------------------------------------------------------------ file digest


@pytest.fixture
def counted_opens(monkeypatch):
    """Count reads of data files by the digest module (it opens them through `open_regular`)."""
    calls: list[str] = []
    real = digest.open_regular

    def counting_open(path, *args, **kwargs):
        calls.append(os.path.basename(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(digest, "open_regular", counting_open)
    return calls


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_file_digest_is_the_sha256_of_the_bytes(tmp_path):
    p = _write(tmp_path / "ckpt.bin", os.urandom(100_000))
    assert file_digest(p, memo_dir=tmp_path / "memo") == hashlib.sha256(p.read_bytes()).hexdigest()
    assert file_digest(p, memo=False, chunk_bytes=4096) == hashlib.sha256(p.read_bytes()).hexdigest()


def test_memo_avoids_rereading(tmp_path, counted_opens):
    p = _write(tmp_path / "ckpt.bin", b"x" * 5000)
    memo = tmp_path / "memo"
    first = file_digest(p, memo_dir=memo)
    assert counted_opens == ["ckpt.bin"]
    for _ in range(3):
        assert file_digest(p, memo_dir=memo) == first
    assert counted_opens == ["ckpt.bin"]
    entry = json.loads((memo / MEMO_FILENAME).read_text())["entries"][os.path.realpath(p)]
    assert entry["digest"] == first and entry["size"] == 5000
    assert file_digest(p, memo=False) == first
    assert counted_opens == ["ckpt.bin", "ckpt.bin"]


def test_memo_is_invalidated_by_content_change(tmp_path, counted_opens):
    p = _write(tmp_path / "ckpt.bin", b"a" * 4096)
    memo = tmp_path / "memo"
    old = file_digest(p, memo_dir=memo)
    st = os.stat(p)
    with open(p, "r+b") as f:  # same size, new content
        f.write(b"b")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    new = file_digest(p, memo_dir=memo)
    assert new != old and new == hashlib.sha256(p.read_bytes()).hexdigest()
    assert counted_opens == ["ckpt.bin", "ckpt.bin"]


def test_memo_is_invalidated_by_mtime_or_inode(tmp_path, counted_opens):
    p = _write(tmp_path / "ckpt.bin", b"c" * 1000)
    memo = tmp_path / "memo"
    d = file_digest(p, memo_dir=memo)
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000))  # touched: re-read, same digest
    assert file_digest(p, memo_dir=memo) == d
    copy = tmp_path / "copy.bin"
    shutil.copy2(p, copy)  # keeps size and mtime, new inode
    os.replace(copy, p)
    assert file_digest(p, memo_dir=memo) == d
    assert counted_opens == ["ckpt.bin"] * 3


def test_swapped_checkpoint_gives_a_new_digest(tmp_path):
    p = _write(tmp_path / "model.safetensors", b"A" * 2048)
    memo = tmp_path / "memo"
    a = file_digest(p, memo_dir=memo)
    other = _write(tmp_path / "other", b"B" * 2048)
    os.replace(other, p)
    assert file_digest(p, memo_dir=memo) != a


def test_corrupt_memo_is_ignored_and_rewritten(tmp_path, caplog):
    p = _write(tmp_path / "ckpt.bin", b"z" * 10)
    memo = tmp_path / "memo"
    memo.mkdir()
    (memo / MEMO_FILENAME).write_text("{not json")
    assert file_digest(p, memo_dir=memo) == hashlib.sha256(b"z" * 10).hexdigest()
    assert "unreadable digest memo" in caplog.text
    assert json.loads((memo / MEMO_FILENAME).read_text())["version"] == 1


def test_directory_digest(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "sub").mkdir(parents=True)
    _write(ckpt / "model-00001.safetensors", b"one")
    _write(ckpt / "sub" / "config.json", b"{}")
    memo = tmp_path / "memo"
    d = file_digest(ckpt, memo_dir=memo)
    _write(ckpt / ".cache", b"ignored")
    assert file_digest(ckpt, memo_dir=memo) == d
    os.rename(ckpt / "sub" / "config.json", ckpt / "sub" / "config2.json")
    renamed = file_digest(ckpt, memo_dir=memo)
    assert renamed != d
    _write(ckpt / "model-00001.safetensors", b"two")
    assert file_digest(ckpt, memo_dir=memo) not in (d, renamed)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        file_digest(tmp_path / "absent.bin", memo_dir=tmp_path)


def test_tensor_digest_of_a_lazy_checkpoint(tmp_path):
    """The io contract: an open Checkpoint is a Mapping[str, Tensor]; its digest equals the eager one."""
    from flashrt.io import open_checkpoint

    tensors = {**_tensors(), "h": torch.ones(2, 3, dtype=torch.bfloat16)}
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(tensors, path)
    assert tensor_digest(open_checkpoint(path)) == tensor_digest(tensors)
