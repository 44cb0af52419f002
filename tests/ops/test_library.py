"""The one native-library builder (`flashrt.ops.library`): a recipe's commands are tried in order and the
first that succeeds is published under the key of its fields, with its sidecar; a verified file of the
same key is reused without compiling; the CUDA and CPU libraries are two recipes of it."""

import hashlib
from pathlib import Path

from flashrt.ops import csrc, csrc_cpu, library, native


def _recipe(tmp_path: Path, log: Path) -> library.Recipe:
    source = tmp_path / "k.c"
    source.write_text("int k(void) { return 1; }\n")
    script = tmp_path / "fakecc"
    script.write_text(f'#!/bin/sh\necho "$1" >> {log}\n[ "$1" = --second ] || exit 1\n'
                      'shift; shift; printf built > "$1"\n')
    script.chmod(0o755)

    def commands(cc, fields):
        return [[cc, "--first", "-o", native.OUT], [cc, "--second", "-o", native.OUT]]

    return library.Recipe("flashrt_test", "test kernels", "the fake compiler", lambda: [source], commands)


def test_the_first_command_that_succeeds_is_published_once(tmp_path):
    log = tmp_path / "calls"
    recipe = _recipe(tmp_path, log)
    fields = {"library": recipe.library, "sources": library.sources_digest(recipe.sources())}
    out = tmp_path / "cache"
    path = library.build(recipe, out, str(tmp_path / "fakecc"), fields, 30.0)
    assert path == out / library.library_name(recipe, fields) and path.name.startswith("flashrt_test-")
    data, recorded = native.read_verified(path, fields)
    assert data == b"built" and recorded == fields
    assert log.read_text().split() == ["--first", "--second"]
    assert library.build(recipe, out, str(tmp_path / "fakecc"), fields, 30.0) == path  # reused
    assert log.read_text().split() == ["--first", "--second"]


def test_sources_digest_covers_names_contents_and_the_headers_once(tmp_path):
    a, h = tmp_path / "a.c", tmp_path / "a.h"
    a.write_text("int a;"), h.write_text("#define A 1")
    want = hashlib.sha256(b"a.c\0int a;\0a.h\0#define A 1\0").hexdigest()
    assert library.sources_digest([a], [h]) == library.sources_digest([a, h], [h]) == want


def test_the_cuda_and_cpu_libraries_are_recipes_of_the_one_builder():
    fields = {"library": "x"}
    assert csrc.library_name(fields) == library.library_name(csrc.RECIPE, fields)
    assert csrc.RECIPE.library == "flashrt_csrc" and csrc_cpu.RECIPE.library == "flashrt_cpu"
    assert csrc_cpu.library_name(fields) == library.library_name(csrc_cpu.RECIPE, fields)
    sm = csrc.RECIPE.commands("nvcc", {"arch": "sm_90"})
    assert len(sm) == 1 and "-gencode=arch=compute_90,code=sm_90" in sm[0] and native.OUT in sm[0]
    cpu = csrc_cpu.RECIPE.commands("cc", {})
    assert [("-fopenmp" in c, "-march=native" in c) for c in cpu] == [(True, True), (False, True),
                                                                      (False, False)]
