"""flashrt/io/files.py: regular files only, capped reads, typed parse errors, paths kept inside their folder.

Every hostile read runs through `bounded_call` (a memory limit and a timeout), so a regression fails the
test instead of filling memory from /dev/zero or hanging on a FIFO.
"""

from __future__ import annotations

import os

import pytest

from flashrt.errors import CheckpointError, ConfigError
from flashrt.io import files
from flashrt.testing.hostile import HOSTILE_KINDS, bounded_call, make_hostile

pytestmark = pytest.mark.timeout(120)

READERS = {
    "open_regular": lambda p: files.open_regular(p, "weight file").__enter__(),
    "check_regular": lambda p: files.check_regular(p, "weight file"),
    "read_bytes_capped": lambda p: files.read_bytes_capped(p, "weight file"),
    "read_text": lambda p: files.read_text(p, "weight file"),
    "read_json": lambda p: files.read_json(p, "weight file"),
    "read_toml": lambda p: files.read_toml(p, "weight file", error=CheckpointError),
    "read_yaml": lambda p: files.read_yaml(p, "weight file"),
}
EXPECTED = {"dev-zero": "character device", "fifo": "FIFO", "directory": "directory", "dangling": "not found"}


@pytest.mark.parametrize("kind", HOSTILE_KINDS)
@pytest.mark.parametrize("reader", READERS)
def test_hostile_files_are_refused(tmp_path, reader, kind):
    path = make_hostile(tmp_path / "config.json", kind)
    exc = bounded_call(lambda: READERS[reader](path), fifos=[path])
    assert isinstance(exc, CheckpointError), repr(exc)
    assert "weight file" in str(exc) and str(path) in str(exc) and EXPECTED[kind] in str(exc)


def test_link_to_a_regular_file_is_read(tmp_path):
    (tmp_path / "real.json").write_text('{"a": 1}')
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert files.read_json(tmp_path / "link.json", "config") == {"a": 1}


def test_unreadable_file_is_typed(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{}")
    path.chmod(0)
    if os.access(path, os.R_OK):
        pytest.skip("running as a user who can read anything (root)")
    with pytest.raises(CheckpointError, match="permission denied"):
        files.read_json(path, "config")


def test_limit_is_checked_before_reading(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b" " * 1000)
    with pytest.raises(ConfigError, match="1000 bytes, more than the 999"):
        files.read_bytes_capped(path, "config", ConfigError, limit=999)
    assert len(files.read_bytes_capped(path, "config", ConfigError, limit=1000)) == 1000


BAD_JSON = {
    "not json": (b"{not json", "not valid JSON"),
    "NaN constant": (b'{"a": NaN}', "not valid JSON"),
    "Infinity constant": (b'{"a": -Infinity}', "not valid JSON"),
    "top-level list": (b"[1, 2]", "top level must be a mapping"),
    "top-level number": (b"3", "top level must be a mapping"),
    "not utf-8": (b'{"a": "\xff\xfe"}', "not UTF-8"),
    "binary": (bytes(range(256)), "not UTF-8"),
    "empty": (b"", "not valid JSON"),
    "deep nesting": (b"[" * 200_000 + b"]" * 200_000, "not valid JSON"),
}


@pytest.mark.parametrize("case", BAD_JSON)
def test_bad_json_is_typed_and_names_the_file(tmp_path, case):
    data, match = BAD_JSON[case]
    path = tmp_path / "config.json"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=match) as err:
        files.read_json(path, "policy config")
    assert str(path) in str(err.value) and "policy config" in str(err.value)


BAD_TOML = {"not toml": b"[profile\nx=", "binary": bytes(range(256)), "duplicate key": b"a = 1\na = 2"}


@pytest.mark.parametrize("case", BAD_TOML)
def test_bad_toml_is_a_config_error(tmp_path, case):
    path = tmp_path / "p.toml"
    path.write_bytes(BAD_TOML[case])
    with pytest.raises(ConfigError, match="profile .*p.toml"):
        files.read_toml(path, "profile")


BAD_YAML = {"not yaml": (b"a: [1, 2", "not valid YAML"), "a python object": (b"!!python/object:os.system {}",
            "not valid YAML"), "a list": (b"- 1\n- 2", "top level must be a mapping")}


@pytest.mark.parametrize("case", BAD_YAML)
def test_bad_yaml_is_typed(tmp_path, case):
    data, match = BAD_YAML[case]
    path = tmp_path / "config.yaml"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=match):
        files.read_yaml(path, "vocos config")


# ----------------------------------------------------------------------------------- resolve_inside

@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "ckpt"
    (root / "assets" / "trossen").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "escape").symlink_to(tmp_path / "outside")
    (root / "inner").symlink_to(root / "assets")
    return root


ESCAPES = {
    "absolute": "/etc/passwd",
    "absolute to inside": "{root}/assets",
    "parent": "../outside/x.json",
    "parent after a folder": "assets/../../outside/x.json",
    "deep parent": "assets/trossen/../../../x",
    "symlink out": "escape/x.json",
    "just ..": "..",
    "empty": "",
    "NUL byte": "a\0b",
    "not a string": 3,
    "None": None,
    "a list": ["a"],
}


@pytest.mark.parametrize("case", ESCAPES)
def test_names_escaping_the_folder_are_refused(folder, case):
    name = ESCAPES[case]
    name = name.format(root=folder) if isinstance(name, str) else name
    with pytest.raises(CheckpointError, match=r"assets\.asset_id"):
        files.resolve_inside(folder, name, "assets.asset_id")


INSIDE = {"plain": ("x.json", "x.json"), "nested": ("assets/trossen/n.json", "assets/trossen/n.json"),
          "dot": ("./x.json", "x.json"), "up and back in": ("assets/../x.json", "x.json"),
          "symlink inside": ("inner/trossen", "assets/trossen"), "the folder itself": (".", "")}


@pytest.mark.parametrize("case", INSIDE)
def test_names_inside_the_folder_resolve(folder, case):
    name, want = INSIDE[case]
    assert files.resolve_inside(folder, name, "f") == (folder / want).resolve()


def test_resolve_inside_takes_the_error_type(folder):
    with pytest.raises(ConfigError, match="state_file"):
        files.resolve_inside(folder, "../x", "state_file", error=ConfigError)


# ------------------------------------------------------------------- the harness catches regressions

def test_bounded_call_catches_an_unbounded_read(tmp_path):
    path = make_hostile(tmp_path / "w.bin", "dev-zero")

    def naive() -> None:
        with open(path, "rb") as f:
            f.read()  # what every reader did before: grows until memory runs out

    with pytest.raises(AssertionError, match="memory limit"):
        bounded_call(naive, headroom=256 << 20)


def test_bounded_call_catches_a_hang_and_releases_it(tmp_path):
    path = make_hostile(tmp_path / "w.bin", "fifo")
    with pytest.raises(AssertionError, match="did not finish"):
        bounded_call(lambda: open(path, "rb").close(), timeout_s=1.0, fifos=[path])


BAD_NAMES = {"NUL byte": "a\0b.json", "too long": "x" * 5000, "empty": ""}


@pytest.mark.parametrize("name", BAD_NAMES)
def test_unusable_names_are_typed(name):
    from flashrt.io import open_checkpoint

    with pytest.raises(CheckpointError):
        files.read_json(BAD_NAMES[name], "config")
    with pytest.raises(CheckpointError):
        open_checkpoint(BAD_NAMES[name])


@pytest.fixture
def hub_snapshot(tmp_path):
    """models--o--n/{blobs/<hash>, snapshots/<commit>/...} with every file a link into blobs, as
    huggingface_hub writes its cache."""
    repo = tmp_path / "hub" / "models--o--n"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("0" * 40)
    (snapshot / "assets" / "robot").mkdir(parents=True)
    for i, name in enumerate(["stats.safetensors", "assets/robot/norm_stats.json"]):
        blob = repo / "blobs" / f"{i:064x}"
        blob.write_text("{}")
        (snapshot / name).symlink_to(os.path.relpath(blob, (snapshot / name).parent))
    (tmp_path / "secret").write_text("x")
    (snapshot / "leak").symlink_to(tmp_path / "secret")
    return snapshot


def test_hub_cache_links_into_blobs_are_inside(hub_snapshot):
    for folder, name in [(hub_snapshot, "stats.safetensors"), (hub_snapshot, "assets/robot/norm_stats.json"),
                         (hub_snapshot / "assets", "robot/norm_stats.json")]:  # a folder below the snapshot
        target = files.resolve_inside(folder, name, "state_file")
        assert target.parent.name == "blobs" and files.read_json(target, "stats") == {}


@pytest.mark.parametrize("name", ["leak", "../../blobs/" + "0" * 64, "../" + "0" * 40 + "/stats.safetensors"])
def test_hub_cache_still_refuses_other_escapes(hub_snapshot, name):
    with pytest.raises(CheckpointError, match="state_file"):
        files.resolve_inside(hub_snapshot, name, "state_file")


def test_sharded_checkpoint_in_a_hub_cache(hub_snapshot):
    import json

    import torch

    from flashrt.io import open_checkpoint, save_safetensors

    blobs = hub_snapshot.parent.parent / "blobs"
    save_safetensors({"w": torch.ones(2)}, blobs / "shard-blob")
    (hub_snapshot / "s1.safetensors").symlink_to(os.path.relpath(blobs / "shard-blob", hub_snapshot))
    (blobs / "index-blob").write_text(json.dumps({"weight_map": {"w": "s1.safetensors"}}))
    (hub_snapshot / "model.safetensors.index.json").symlink_to(
        os.path.relpath(blobs / "index-blob", hub_snapshot))
    assert torch.equal(open_checkpoint(hub_snapshot)["w"], torch.ones(2))
