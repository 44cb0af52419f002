"""Declarative, strict checkpoint → module key maps.

A `WeightMap` is a table of `Rule(source, target, transform=None, dtype=None)`:

- Templates. ``source`` and ``target`` are key templates whose ``{name}`` fields match one key segment
  (``[^.]+``), e.g. ``"model.layers.{i}.mlp.up_proj.weight" -> "layers.{i}.up.weight"``; a ``{*name}``
  field matches one or more segments (``"{*p}.weight_g"`` matches ``"ups.0.weight_g"``). Every source
  template of a rule must use exactly the same fields as its target (else ConfigError at construction),
  so each match produces exactly one target.
- Several sources. ``source=("{p}.weight_g", "{p}.weight_v")`` passes all tensors, in order, to
  ``transform``; all of them are required (a binding with one of them absent is reported as missing).
- Aliases. A source element may be ``Alt("a.{i}", "b.{i}")``: the first alternative present in the
  checkpoint wins (later ones are back-compat names, logged at INFO when used). If both are present the
  loser stays unconsumed and is reported as unexpected unless ignored.
- Tied weights. One checkpoint key may feed any number of targets (several rules may read it); the
  tensor is read once and shared when no transform or cast changes it.
- ``ignore`` holds patterns of checkpoint keys deliberately unused: ``*`` matches anything (dots too),
  ``?`` one character, ``{name}`` one segment, ``{*name}`` one or more.
- Prefixes. ``with_prefix("model.")`` prefixes every source and ignore pattern; ``auto_prefix(ckpt,
  ("", "model."))`` picks the candidate under which the map consumes the most checkpoint keys (lerobot
  files come with and without ``model.``).

Strictness (``apply(checkpoint, expected)``), all problems reported in ONE CheckpointError:

- missing: expected slots that no rule produced, plus bindings whose tuple sources are incomplete. A rule
  that matches nothing is fine unless its target is required; with ``expected=None`` the required
  targets are the literal (field-free) ones, so several rules may offer alternative forms of one target;
- unexpected: checkpoint keys no rule consumed and no pattern ignores, plus produced targets that the
  module does not have;
- mis-shaped: produced shape != expected shape, naming source key(s), target and both shapes.
  Shapes are checked before any data is read, by running transforms on meta tensors.
- conflicts: two productions writing the same target.

dtype: ``Rule.dtype`` casts after the transform; else the expected slot's dtype when ``expected`` maps
to tensors (what `load_module` passes); else the checkpoint's dtype. Outputs are made contiguous.
"""

from __future__ import annotations

import bisect
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from flashrt.errors import CheckpointError, ConfigError
from flashrt.io.checks import describe_nonfinite, first_nonfinite, kind_problem

log = logging.getLogger(__name__)

__all__ = ["Alt", "Rule", "WeightMap", "MapPlan", "Production"]

Expected = Mapping[str, "torch.Size | torch.Tensor"]
_FIELD = re.compile(r"\{(\*?)([A-Za-z_][A-Za-z0-9_]*)\}")
_LIST_LIMIT = 20


class _Template:
    """A key template: literal text with ``{name}`` (one dot-free segment) and ``{*name}`` (any) fields."""

    def __init__(self, text: str) -> None:
        if not isinstance(text, str) or not text:
            raise ConfigError(f"weight-map template must be a non-empty string, got {text!r}")
        leftover = _FIELD.sub("", text)
        if "{" in leftover or "}" in leftover:
            raise ConfigError(f"weight-map template {text!r}: fields must look like {{name}} or {{*name}}")
        self.text = text
        self.fields = tuple(dict.fromkeys(m.group(2) for m in _FIELD.finditer(text)))
        self.prefix = text.split("{", 1)[0]
        self.regex = re.compile(_template_regex(text, lambda lit: re.escape(lit)))

    def match(self, key: str) -> dict[str, str] | None:
        m = self.regex.fullmatch(key)
        return m.groupdict() if m else None

    def format(self, binding: Mapping[str, str]) -> str:
        return _FIELD.sub(lambda m: binding[m.group(2)], self.text)


def _template_regex(text: str, literal: Callable[[str], str]) -> str:
    """Regex for a template; a field seen twice must repeat its first value (a backreference)."""
    parts, seen, pos = [], set(), 0
    for m in _FIELD.finditer(text):
        parts.append(literal(text[pos:m.start()]))
        name = m.group(2)
        pattern = ".+" if m.group(1) else "[^.]+"
        parts.append(f"(?P={name})" if name in seen else f"(?P<{name}>{pattern})")
        seen.add(name)
        pos = m.end()
    parts.append(literal(text[pos:]))
    return "".join(parts)


def _glob_literal(text: str) -> str:
    return "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in text)


@dataclass(frozen=True, init=False)
class Alt:
    """Alternative source names for one source element; the first present in the checkpoint wins."""

    options: tuple[str, ...]

    def __init__(self, *options: str) -> None:
        if len(options) < 2:
            raise ConfigError(f"Alt needs at least two alternatives, got {options!r}")
        object.__setattr__(self, "options", tuple(options))


SourceElement = str | Alt


@dataclass(frozen=True)
class Rule:
    """One line of a weight map: ``source`` template(s) → ``target`` template, optional transform and cast."""

    source: SourceElement | tuple[SourceElement, ...]
    target: str
    transform: Callable[..., torch.Tensor] | None = None
    dtype: torch.dtype | None = None
    _elements: tuple[tuple[_Template, ...], ...] = field(init=False, repr=False, compare=False)
    _target: _Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sources = self.source if isinstance(self.source, tuple) else (self.source,)
        if not sources:
            raise ConfigError(f"rule for {self.target!r} has no source")
        elements = tuple(_element_templates(s) for s in sources)
        target = _Template(self.target)
        for tpl in (t for el in elements for t in el):
            if set(tpl.fields) != set(target.fields):
                raise ConfigError(f"rule {tpl.text!r} -> {self.target!r}: source fields {sorted(tpl.fields)} "
                                  f"differ from target fields {sorted(target.fields)}")
        if len(elements) > 1 and self.transform is None:
            raise ConfigError(f"rule for {self.target!r} has {len(elements)} sources but no transform")
        object.__setattr__(self, "_elements", elements)
        object.__setattr__(self, "_target", target)

    def with_prefix(self, prefix: str) -> Rule:
        return replace(self, source=_prefixed(self.source, prefix))

    def describe(self) -> str:
        return f"{self.source!r} -> {self.target!r}"


def _element_templates(element: SourceElement) -> tuple[_Template, ...]:
    if isinstance(element, Alt):
        return tuple(_Template(o) for o in element.options)
    return (_Template(element),)


def _prefixed(source: Any, prefix: str) -> Any:
    if isinstance(source, tuple):
        return tuple(_prefixed(s, prefix) for s in source)
    if isinstance(source, Alt):
        return Alt(*(prefix + o for o in source.options))
    return prefix + source


@dataclass(frozen=True)
class Production:
    """One target tensor to build: from ``sources`` (checkpoint keys, in order) through ``rule``."""

    target: str
    sources: tuple[str, ...]
    rule: Rule


@dataclass
class MapPlan:
    """The resolved key mapping of one checkpoint, before any tensor data is read."""

    productions: list[Production]
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    misshaped: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    wrong_dtype: list[str] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)
    deferred: list[Production] = field(default_factory=list)  # shapes known only after the transform runs

    @property
    def ok(self) -> bool:
        return not any(items for _, items in self._sections())

    def error(self, name: str) -> CheckpointError:
        counts = ", ".join(f"{len(v)} {k}" for k, v in self._sections() if v)
        lines = [f"checkpoint {name} does not match the weight map: {counts}"]
        for label, items in self._sections():
            if items:
                lines.append(f"{label} [{len(items)}]:")
                lines += [f"  {item}" for item in items[:_LIST_LIMIT]]
                if len(items) > _LIST_LIMIT:
                    lines.append(f"  ... and {len(items) - _LIST_LIMIT} more")
        return CheckpointError("\n".join(lines))

    def _sections(self) -> list[tuple[str, list[str]]]:
        return [("missing", self.missing), ("unexpected", self.unexpected),
                ("mis-shaped", self.misshaped), ("conflicting", self.conflicts),
                ("wrong dtype", self.wrong_dtype), ("non-finite", self.nonfinite)]


class _KeyIndex:
    """Checkpoint keys sorted once, so each template only scans keys sharing its literal prefix."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = sorted(keys)
        self.present = set(self.keys)

    def with_prefix(self, prefix: str) -> list[str]:
        lo = bisect.bisect_left(self.keys, prefix)
        hi = bisect.bisect_left(self.keys, prefix + "\U0010ffff")
        return self.keys[lo:hi]


class WeightMap:
    """An ordered table of rules plus ignore patterns, applied strictly (see module docstring)."""

    def __init__(self, rules: Sequence[Rule], ignore: Sequence[str] = ()) -> None:
        self.rules = tuple(rules)
        self.ignore = tuple(ignore)
        self._ignore = [re.compile(_template_regex(p, _glob_literal)) for p in self.ignore]

    def __add__(self, other: WeightMap) -> WeightMap:
        return WeightMap(self.rules + other.rules, self.ignore + other.ignore)

    def __repr__(self) -> str:
        return f"WeightMap({len(self.rules)} rules, {len(self.ignore)} ignore patterns)"

    def with_prefix(self, prefix: str) -> WeightMap:
        """The same map reading keys that start with ``prefix``."""
        return WeightMap([r.with_prefix(prefix) for r in self.rules], [prefix + p for p in self.ignore])

    def auto_prefix(self, checkpoint: Iterable[str], candidates: Sequence[str] = ("", "model.")) -> WeightMap:
        """``with_prefix(c)`` for the candidate that consumes the most checkpoint keys (ties: first)."""
        index = _KeyIndex(checkpoint)
        scores = [len(self.with_prefix(c)._resolve(index)[1]) for c in candidates]
        best = candidates[scores.index(max(scores))]
        log.debug("weight map prefix %r chosen (keys consumed per candidate: %s)", best, scores)
        return self.with_prefix(best)

    def is_ignored(self, key: str) -> bool:
        return any(p.fullmatch(key) for p in self._ignore)

    def plan(self, checkpoint: Any, expected: Expected | None = None) -> MapPlan:
        """Resolve keys and check names and shapes without reading tensor data."""
        productions, consumed, incomplete, unmatched = self._resolve(_KeyIndex(checkpoint))
        plan = MapPlan(productions, missing=list(incomplete.values()))
        plan.conflicts = _conflicts(productions)
        plan.unexpected = [k for k in checkpoint if k not in consumed and not self.is_ignored(k)]
        if expected is None:
            plan.missing += unmatched
        else:
            _check_expected(plan, checkpoint, expected, skip=incomplete.keys(), rules=self.rules)
        return plan

    def check(self, checkpoint: Any, expected: Expected | None = None) -> MapPlan:
        """`plan`, raising one CheckpointError if anything is missing, unexpected, mis-shaped or doubled."""
        plan = self.plan(checkpoint, expected)
        if not plan.ok and not plan.deferred:
            raise plan.error(_name(checkpoint))
        return plan

    def apply(
        self, checkpoint: Any, expected: Expected | None = None, device: torch.device | str | None = None
    ) -> dict[str, torch.Tensor]:
        """Strictly map ``checkpoint`` to ``{target: tensor}``; ``expected`` gives slot shapes/dtypes.

        With ``device``, each tensor moves there as soon as it is built (one host copy at a time);
        tied targets stay one tensor there too.
        """
        plan = self.check(checkpoint, expected)
        out = _materialize(plan, checkpoint, expected, device)
        if not plan.ok:
            raise plan.error(_name(checkpoint))
        return out

    # ------------------------------------------------------------------------------------ resolve

    def _resolve(self, index: _KeyIndex) -> tuple[list[Production], set[str], dict[str, str], list[str]]:
        """Productions, consumed keys, incomplete bindings (target → note), literal targets left unfilled."""
        productions: list[Production] = []
        partials: list[tuple[str, str, tuple[str, ...]]] = []
        literal: dict[str, list[str]] = {}  # literal target -> sources of the rules that could fill it
        for rule in self.rules:
            found, partial = _rule_productions(rule, index)
            if not rule._target.fields:
                literal.setdefault(rule.target, []).append(repr(rule.source))
            productions += found
            partials += partial
        consumed = {s for p in productions for s in p.sources}
        produced = {p.target for p in productions}
        incomplete: dict[str, str] = {}
        for target, note, present in partials:  # a target another rule filled needs no note
            if target not in produced:
                incomplete[target] = note
                consumed.update(present)  # reported once, as missing, not again as unexpected
        produced |= incomplete.keys()
        unmatched = [f"{t} (no source {' or '.join(srcs)} in checkpoint)"
                     for t, srcs in literal.items() if t not in produced]
        return productions, consumed, incomplete, unmatched


def _rule_productions(rule: Rule, index: _KeyIndex) -> tuple[list[Production], list[tuple[str, str, tuple]]]:
    """Productions of one rule, and (target, note, present sources) per incomplete tuple binding."""
    bindings: dict[tuple[tuple[str, str], ...], None] = {}
    for tpl in (t for el in rule._elements for t in el):
        for key in index.with_prefix(tpl.prefix):
            b = tpl.match(key)
            if b is not None:
                bindings[tuple(sorted(b.items()))] = None
    found, partial = [], []
    for items in bindings:
        binding = dict(items)
        sources = [_pick_option(el, binding, index) for el in rule._elements]
        target = rule._target.format(binding)
        if None in sources:
            absent = [el[0].format(binding) for el, s in zip(rule._elements, sources) if s is None]
            note = f"{target} (source {', '.join(absent)} absent from checkpoint)"
            partial.append((target, note, tuple(k for k in sources if k is not None)))
        else:
            found.append(Production(target, tuple(sources), rule))
    return found, partial


def _pick_option(element: tuple[_Template, ...], binding: Mapping[str, str], index: _KeyIndex) -> str | None:
    for i, tpl in enumerate(element):
        key = tpl.format(binding)
        if key in index.present:
            if i:
                log.info("weight map: using alternative key %r (preferred %r absent)", key,
                         element[0].format(binding))
            return key
    return None


def _conflicts(productions: list[Production]) -> list[str]:
    counts = Counter(p.target for p in productions)
    return [f"{p.target} <- {', '.join(p.sources)}" for p in productions if counts[p.target] > 1]


# ------------------------------------------------------------------------------------ shape checks

def _check_expected(
    plan: MapPlan, checkpoint: Any, expected: Expected, skip: Iterable[str], rules: Sequence[Rule] = ()
) -> None:
    produced = {p.target for p in plan.productions} | set(skip)
    plan.missing += [_missing_slot(k, rules) for k in expected if k not in produced]
    for prod in plan.productions:
        if prod.target not in expected:
            plan.unexpected.append(f"{', '.join(prod.sources)} -> {prod.target} (module has no such slot)")
            continue
        out = _meta_out(prod, checkpoint)
        if out is None:
            plan.deferred.append(prod)
        else:
            _note_shape(plan, prod, out.shape, _slot_shape(expected[prod.target]))
            _note_kind(plan, prod, out.dtype, expected, checkpoint)


def _missing_slot(slot: str, rules: Sequence[Rule]) -> str:
    """A missing slot, named by the checkpoint key(s) that would have filled it."""
    for rule in rules:
        binding = rule._target.match(slot)
        if binding is not None:
            keys = [" or ".join(repr(t.format(binding)) for t in el) for el in rule._elements]
            return f"{' + '.join(keys)} (for slot {slot}): not in the checkpoint"
    return f"{slot} (no rule produced it)"


def _note_kind(plan: MapPlan, prod: Production, got: torch.dtype, expected: Expected | None,
               checkpoint: Any) -> None:
    """No implicit change of dtype kind (see flashrt.io.checks): neither the produced tensor nor any of
    its sources (a transform such as a weight-norm fold would turn an integer source into floats) may
    differ in kind from the slot, unless the rule says ``dtype=``."""
    slot = None if expected is None else expected.get(prod.target)
    if prod.rule.dtype is not None or not isinstance(slot, torch.Tensor):
        return
    for source in prod.sources:
        problem = kind_problem(_source_dtype(checkpoint, source), slot.dtype)
        if problem:
            plan.wrong_dtype.append(f"{source} -> {prod.target}: {problem}")
            return
    problem = kind_problem(got, slot.dtype)
    if problem:
        plan.wrong_dtype.append(f"{', '.join(prod.sources)} -> {prod.target}: {problem}")


def _note_finite(plan: MapPlan, prod: Production, t: torch.Tensor) -> None:
    index = first_nonfinite(t)
    if index is not None:
        plan.nonfinite.append(f"{', '.join(prod.sources)} -> {prod.target}: {describe_nonfinite(t, index)} "
                              f"(shape {tuple(t.shape)}, {t.dtype}); the checkpoint is corrupt or was saved "
                              "after training diverged")


def _note_shape(plan: MapPlan, prod: Production, got: torch.Size, want: torch.Size) -> None:
    if tuple(got) != tuple(want):
        plan.misshaped.append(f"{', '.join(prod.sources)} -> {prod.target}: checkpoint gives {tuple(got)}, "
                              f"module expects {tuple(want)}")


def _slot_shape(slot: torch.Size | torch.Tensor) -> torch.Size:
    return slot.shape if isinstance(slot, torch.Tensor) else torch.Size(slot)


def _meta_out(prod: Production, checkpoint: Any) -> torch.Tensor | None:
    """Output (a meta tensor: shape and dtype) from headers only; None if a transform cannot run on meta."""
    metas = [torch.empty(_source_shape(checkpoint, s), dtype=_source_dtype(checkpoint, s), device="meta")
             for s in prod.sources]
    if prod.rule.transform is None:
        return metas[0]
    try:
        out = prod.rule.transform(*metas)
    except Exception:  # a transform that needs real data (e.g. calls .item()) is checked after loading
        return None
    return out if isinstance(out, torch.Tensor) else None


def _source_shape(checkpoint: Any, key: str) -> torch.Size:
    return checkpoint.shape(key) if hasattr(checkpoint, "shape") else checkpoint[key].shape


def _source_dtype(checkpoint: Any, key: str) -> torch.dtype:
    return checkpoint.dtype(key) if hasattr(checkpoint, "dtype") else checkpoint[key].dtype


def _name(checkpoint: Any) -> str:
    return repr(getattr(checkpoint, "name", type(checkpoint).__name__))


# ---------------------------------------------------------------------------------- materialize

def _materialize(
    plan: MapPlan, checkpoint: Any, expected: Expected | None, device: torch.device | str | None
) -> dict[str, torch.Tensor]:
    """Read, transform, cast and move every production; deferred shape checks are done here."""
    uses = Counter(s for p in plan.productions for s in p.sources)
    shared: dict[str, torch.Tensor] = {}
    moved = WeakIdKeyDictionary()  # host tensor -> its device copy, so ties survive the move (weak: a
    # freed host tensor's id() can be the next one's, and a plain id() key then hands out the wrong copy)
    deferred = {id(p) for p in plan.deferred}
    out: dict[str, torch.Tensor] = {}
    for prod in _progress(plan.productions if plan.ok else plan.deferred, _name(checkpoint)):
        tensors = [_read(checkpoint, s, shared if uses[s] > 1 else None) for s in prod.sources]
        result = _run_transform(plan, prod, tensors)
        if result is None:
            continue
        if id(prod) in deferred:
            _note_shape(plan, prod, result.shape, _slot_shape(expected[prod.target]))
            _note_kind(plan, prod, result.dtype, expected, checkpoint)
        result = _cast(result, prod.rule.dtype, expected, prod.target).contiguous()
        _note_finite(plan, prod, result)
        out[prod.target] = result if device is None else _move(result, device, moved)
    return out


PROGRESS_MIN_TENSORS = 64   # a bar for a release-size checkpoint (hundreds of tensors), none for tiny ones


def _progress(productions: list[Production], name: str) -> Iterable[Production]:
    """``productions``, with a progress bar on stderr when flashrt logs at INFO (`flashrt -v`) and the
    checkpoint is large enough for a load to take a while (quiet by default, like capture's bar)."""
    if not log.isEnabledFor(logging.INFO) or len(productions) < PROGRESS_MIN_TENSORS:
        return productions
    from tqdm import tqdm

    return tqdm(productions, desc=f"loading {name}"[:60], unit="tensor", leave=False)


def _move(t: torch.Tensor, device: torch.device | str, moved: WeakIdKeyDictionary) -> torch.Tensor:
    copy = moved.get(t)
    if copy is None:
        copy = moved[t] = t.to(device)
    return copy


def _run_transform(plan: MapPlan, prod: Production, tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The transform's result, or None with the failure noted as a mis-shaped entry."""
    if prod.rule.transform is None:
        return tensors[0]
    try:
        return prod.rule.transform(*tensors)
    except Exception as exc:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        plan.misshaped.append(f"{', '.join(prod.sources)} -> {prod.target}: {prod.rule.transform!r} failed "
                              f"on shapes {shapes}: {exc}")
        return None


def _read(checkpoint: Any, key: str, cache: dict[str, torch.Tensor] | None) -> torch.Tensor:
    if cache is None:
        return checkpoint[key]
    if key not in cache:
        cache[key] = checkpoint[key]
    return cache[key]


def _cast(
    t: torch.Tensor, rule_dtype: torch.dtype | None, expected: Expected | None, target: str
) -> torch.Tensor:
    dtype = rule_dtype
    if dtype is None and expected is not None and isinstance(expected[target], torch.Tensor):
        dtype = expected[target].dtype
    return t if dtype is None or t.dtype == dtype else t.to(dtype)
