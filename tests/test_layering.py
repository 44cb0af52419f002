"""The package's floors (docs/architecture.md, "Layering"): every import of a flashrt module, at module
level or inside a function, goes to a lower floor or stays in its own package; so no import reaches up,
no two packages import each other, and `runtime` imports neither `nn` nor `quant` (it asks `ops`).

Read from the source with `ast` (nothing imported): ``import flashrt.x.y``, ``from flashrt.x import y``,
``from flashrt import x`` and relative imports all count; a name in a string or a docstring does not.
The bare package reaches further than its own file: its lazy names (``_LAZY`` in flashrt/__init__.py,
e.g. ``load_vocoder`` from the runner) and its sub-packages are one attribute away, so
``from flashrt import load_vocoder`` and, after ``import flashrt`` (or ``import flashrt as f``, or
``import flashrt.errors``, which binds ``flashrt`` too), ``flashrt.load_vocoder(...)`` or
``flashrt.runner.vocoder.load_vocoder(...)`` count as imports of the module the name resolves to."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import flashrt

ROOT = Path(flashrt.__file__).resolve().parent

# lower number = lower floor; a package imports only from strictly lower floors (and itself)
FLOORS = {
    "errors": 0, "paths": 0,
    "io": 1,
    "resources": 2, "profile": 2,
    "ops": 3, "chain": 3,  # the chain knows no model: a frontend may build its serving chain on it
    "runtime": 4,
    "nn": 5, "quant": 5,
    "frontends": 6,
    "runner": 8,
    "testing": 9,
}
# the applications on top: they may import any floor and each other (serve's CLI starts the Ray Serve
# integration; bench's CLI reuses the main one), nothing below imports them
TOP = {"bench", "serve", "integrations", "cli", "demo", "demo_talk", "export", "calibrate", "extras"}


def _unit(module: str) -> str | None:
    """The floor unit of a dotted flashrt module name: its package, or the top-level module."""
    parts = module.split(".")
    return parts[1] if parts[0] == "flashrt" and len(parts) > 1 else None


def _module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
    return ".".join(parts)


def lazy_names(root: Path = ROOT) -> dict[str, str]:
    """The bare package's lazily exported names -> the module each comes from (``_LAZY`` in
    flashrt/__init__.py, read with `ast`)."""
    for node in ast.parse((root / "__init__.py").read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in targets):
            return ast.literal_eval(node.value)
    return {}


def _in_flashrt(module: str) -> bool:
    return module == "flashrt" or module.startswith("flashrt.")


def _is_module(module: str, root: Path) -> bool:
    """Whether the dotted flashrt name is a package or a module file (not a name defined in one)."""
    folder = root.joinpath(*module.split(".")[1:])
    return folder.is_dir() or folder.with_suffix(".py").is_file()


def _member(module: str, name: str, root: Path, lazy: dict[str, str]) -> str | None:
    """The flashrt module that ``module.name`` is or comes from: a sub-module, or one of the bare
    package's lazy names; None for any other name (``__version__``, a class, a function)."""
    if _is_module(f"{module}.{name}", root):
        return f"{module}.{name}"
    return lazy.get(name) if module == "flashrt" else None


def _bound_modules(tree: ast.AST, package: str, root: Path) -> dict[str, str]:
    """Local names bound to a flashrt module by an import: ``import flashrt.x`` binds ``flashrt`` to
    the bare package, ``import flashrt.x as m`` and ``from flashrt import x as m`` bind ``m`` to x."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "flashrt":
                    bound[a.asname or "flashrt"] = a.name if a.asname else "flashrt"
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, package)
            for a in node.names:
                if _in_flashrt(base) and _is_module(f"{base}.{a.name}", root):
                    bound[a.asname or a.name] = f"{base}.{a.name}"
    return bound


def _from_base(node: ast.ImportFrom, package: str) -> str:
    """The absolute module of a ``from ... import`` (relative ones resolved against ``package``)."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, *([base] if base else [])])
    return base


def _attribute_uses(tree: ast.AST, bound: dict[str, str], root: Path, lazy: dict[str, str]) -> set[str]:
    """The flashrt modules reached through attributes of a bound module name: ``flashrt.load_vocoder``
    -> flashrt.runner.vocoder, ``flashrt.runner.policy.load_policy`` -> flashrt.runner.policy."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain: list[str] = []
        head: ast.AST = node
        while isinstance(head, ast.Attribute):
            chain.insert(0, head.attr)
            head = head.value
        if not isinstance(head, ast.Name) or head.id not in bound:
            continue
        module = bound[head.id]
        for name in chain:
            reached = _member(module, name, root, lazy)
            if reached is None:
                break
            found.add(reached)
            if not _is_module(f"{module}.{name}", root):
                break  # a lazy name: the module it comes from, and no further
            module = reached
    return found


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """The flashrt modules ``path`` imports (dotted names; ``from flashrt.p import x`` also as flashrt.p.x
    where x is a module or package, not a name such as ``__version__``; the bare package's lazy names
    and attributes as the modules they resolve to, see the module docstring)."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    lazy = lazy_names(root)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, package)
            found.add(base)
            if _in_flashrt(base):
                found.update(m for a in node.names if (m := _member(base, a.name, root, lazy)) is not None)
    found |= _attribute_uses(tree, _bound_modules(tree, package, root), root, lazy)
    return {m for m in found if m.startswith("flashrt.")}


def unit_edges(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the files that import across, for every flashrt file."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        src = _unit(_module_name(path, root))
        if src is None:
            continue
        for module in imports_of(path, root):
            dst = _unit(module)
            if dst is not None and dst != src:
                edges.setdefault((src, dst), []).append(str(path.relative_to(root.parent)))
    return edges


def violations(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """Every import that is not from a higher floor to a strictly lower one (the applications on top
    may import anything)."""
    found = []
    for (src, dst), files in sorted(edges.items()):
        if src in TOP:
            continue
        if dst in TOP or src not in FLOORS or dst not in FLOORS or FLOORS[dst] >= FLOORS[src]:
            found.append(f"{src} -> {dst} ({', '.join(files)})")
    return found


def circles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The import circles between units below the applications (strongly connected, more than one)."""
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        if src not in TOP and dst not in TOP:
            graph.setdefault(src, set()).add(dst)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_unit_has_a_floor():
    units = {_unit(_module_name(p)) for p in ROOT.rglob("*.py")} - {None}
    assert units <= set(FLOORS) | TOP, sorted(units - set(FLOORS) - TOP)


def test_no_import_reaches_up_or_across_a_floor():
    assert violations(unit_edges()) == []


def test_no_import_circle_between_packages():
    assert circles(unit_edges()) == []


def test_runtime_imports_neither_nn_nor_quant_and_ops_knows_no_block():
    edges = unit_edges()
    assert not [e for e in edges if e[0] == "runtime" and e[1] in ("nn", "quant", "frontends")]
    assert {dst for src, dst in edges if src == "ops"} <= {"errors", "paths", "io", "resources"}


@pytest.mark.parametrize("planted, broken", [
    # the old circle: runtime's custom-op registry importing nn, nn's blocks loading runtime's libraries
    ({"runtime": "from flashrt.nn.gemma import Gemma\n", "nn": "from flashrt.runtime import graphs\n"},
     "runtime -> nn"),
    ({"runtime": "from flashrt import quant\n"}, "runtime -> quant"),          # as a package import
    ({"runtime": "def f():\n    from ..frontends import registry\n"}, "runtime -> frontends"),  # lazy
])
def test_the_checks_catch_an_upward_import(tmp_path, planted, broken):
    """A copy of the package with upward imports planted: the floor check names them and the circle
    check finds the circle they close (quant and frontends import runtime)."""
    copy = planted_copy(tmp_path, {f"{package}/planted.py": source for package, source in planted.items()})
    edges = unit_edges(copy)
    assert any(v.startswith(broken) for v in violations(edges))
    assert any(broken.split(" -> ")[1] in c and "runtime" in c for c in circles(edges))


def planted_copy(tmp_path: Path, planted: dict[str, str]) -> Path:
    """A copy of the package's sources with the planted files (path inside the package -> source)."""
    copy = tmp_path / "flashrt"
    for path in ROOT.rglob("*.py"):
        target = copy / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    for rel, source in planted.items():
        (copy / rel).write_text(source, encoding="utf-8")
    return copy


@pytest.mark.parametrize("source", [
    "import flashrt\n\n\ndef f(path):\n    return flashrt.load_vocoder(path)\n",   # a lazy name, called
    "import flashrt as fr\n\nLOAD = fr.load_tts\n",                               # aliased, not called
    "def f(path):\n    import flashrt\n    return flashrt.load_policy(path)\n",     # lazy import
    "from flashrt import load_vocoder\n",                                          # the lazy name imported
    "import flashrt.errors\n\n\ndef f(p):\n    return flashrt.runner.vocoder.load_vocoder(p)\n",  # modules
    "from flashrt import runner as r\n\n\ndef f(p):\n    return r.policy.load_policy(p)\n",
])
def test_the_floor_check_sees_through_the_bare_package(tmp_path, source):
    """A frontend that reaches the runner through an attribute of the bare package (or its lazy name) is
    an upward import like any other."""
    edges = unit_edges(planted_copy(tmp_path, {"frontends/planted.py": source}))
    assert "frontends/planted.py" in " ".join(edges.get(("frontends", "runner"), []))
    assert any(v.startswith("frontends -> runner") for v in violations(edges))


@pytest.mark.parametrize("source", [
    "import flashrt\n\nERR = flashrt.InputError\nV = flashrt.__version__\n",     # lazy names of lower floors
    "import flashrt.runtime\n\n\ndef f(x):\n    return flashrt.runtime.graphs.capture(x)\n",
    "def f(flashrt):\n    return flashrt.load_policy\n",                      # a parameter, not the package
])
def test_the_bare_package_reaches_only_what_its_names_resolve_to(tmp_path, source):
    """Attributes that resolve to a lower floor, or to nothing in flashrt, add no upward edge."""
    edges = unit_edges(planted_copy(tmp_path, {"frontends/planted.py": source}))
    assert violations(edges) == []


GROOT = "flashrt.frontends.groot"
# GR00T's versions over its shared code: common imports no version, a version imports common (N1.5 also
# N1.6's Eagle pieces, never the reverse), and only the registry entry (family) dispatches to them all
GROOT_MAY_IMPORT = {
    "common": {"common"},
    "n15": {"common", "n15", "n16"},
    "n16": {"common", "n16"},
    "n17": {"common", "n17"},
    "family": {"common", "n15", "n16", "n17"},
}


def _groot_part(module: str) -> str | None:
    """The part of GR00T's folder a dotted module is in (its sub-package, or ``family``)."""
    if module != GROOT and not module.startswith(GROOT + "."):
        return None
    parts = module.removeprefix(GROOT).lstrip(".").split(".")
    return parts[0] or None


def groot_violations(root: Path = ROOT) -> list[str]:
    """Every import between GR00T's parts (module level or lazy) that `GROOT_MAY_IMPORT` does not allow,
    and every file of the folder outside the parts it names."""
    found = []
    for path in sorted((root / "frontends" / "groot").rglob("*.py")):
        src = _groot_part(_module_name(path, root))
        if src is None:
            continue
        if src not in GROOT_MAY_IMPORT:
            found.append(f"{src}: not a known part of {GROOT}")
            continue
        for module in sorted(imports_of(path, root)):
            dst = _groot_part(module)
            if dst is not None and dst not in GROOT_MAY_IMPORT[src]:
                found.append(f"{src} -> {dst} ({path.relative_to(root.parent)})")
    return found


def test_groot_common_imports_no_version_and_versions_no_later_one():
    assert groot_violations() == []


@pytest.mark.parametrize("planted, broken", [
    ({"common/planted.py": "def f():\n    from flashrt.frontends.groot.n15 import model\n"}, "common -> n15"),
    ({"n16/planted.py": "from .. import n15\n"}, "n16 -> n15"),
    ({"n17/planted.py": "from flashrt.frontends.groot import family\n"}, "n17 -> family"),
])
def test_the_groot_check_catches_a_version_import(tmp_path, planted, broken):
    copy = planted_copy(tmp_path, {f"frontends/groot/{rel}": source for rel, source in planted.items()})
    assert any(v.startswith(broken) for v in groot_violations(copy))
