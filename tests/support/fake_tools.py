"""A stand-in compiler for the native libraries' cache-key tests: a script that prints a version."""

from pathlib import Path


def fake_tool(folder: Path, name: str, version: str) -> str:
    """``folder/name``, an executable that prints ``version`` (what `flashrt.ops.native.tool_version`
    reads); the folder is made."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(0o755)
    return str(path)
