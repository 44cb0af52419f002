"""The docs site (mkdocs.yml, docs/) builds with `mkdocs build --strict`: a broken link, a page left out
of the nav or an API page whose module is gone fails the suite, and every public module has its API page.

Needs the `docs` extra's tools (they are in the `test` extra too, so `bootstrap.py test` installs them);
skipped only where mkdocs itself is missing.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 180
API_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", flags=re.M)
# public modules beyond the ones `flashrt.__getattr__` exports names from
PUBLIC_PACKAGES = ("flashrt.profile", "flashrt.chain", "flashrt.runtime.frontend", "flashrt.quant.precision")


def build(config: Path, out: Path) -> subprocess.CompletedProcess:
    pytest.importorskip("mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env=env,
                          cwd=config.parent)


def copy_site(tmp_path: Path) -> Path:
    """mkdocs.yml and docs/ copied into tmp_path (the package linked beside them for the API pages)."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "flashrt").symlink_to(ROOT / "flashrt", target_is_directory=True)
    return tmp_path / "mkdocs.yml"


def test_site_builds_strictly(tmp_path):
    result = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "api" / "policies" / "index.html").is_file()
    html = (tmp_path / "site" / "api" / "policies" / "index.html").read_text()
    assert "load_policy" in html  # the API page was generated from the docstrings, not left empty


@pytest.mark.parametrize("page, line, expected", [
    ("cli.md", "[a page that is not there](no-such-page.md)", "no-such-page.md"),
    ("cli.md", "[a heading that is not there](profiling.md#no-such-heading)", "no-such-heading"),
    ("api/errors.md", "::: flashrt.no_such_module", "flashrt.no_such_module"),
])
def test_a_broken_link_or_api_page_fails_the_build(tmp_path, page, line, expected):
    config = copy_site(tmp_path)
    with open(tmp_path / "docs" / page, "a") as f:
        f.write(f"\n{line}\n")
    result = build(config, tmp_path / "site")
    assert result.returncode != 0
    assert expected in result.stdout + result.stderr


def test_a_page_left_out_of_the_nav_fails_the_build(tmp_path):
    config = copy_site(tmp_path)
    (tmp_path / "docs" / "orphan.md").write_text("# not in the nav\n")
    result = build(config, tmp_path / "site")
    assert result.returncode != 0
    assert "orphan.md" in result.stdout + result.stderr


def test_every_public_module_has_an_api_page():
    import flashrt

    documented = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        documented.update(API_DIRECTIVE.findall(page.read_text()))
    public = set(flashrt._LAZY.values()) | set(PUBLIC_PACKAGES)
    assert not public - documented, f"modules without an API page: {sorted(public - documented)}"
