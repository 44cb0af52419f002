"""Ops, their forms, the slots modules hold them in, and the one load-time choice between forms.

    op = register(Op("gelu_mul", reference=gelu_mul_ref, group="decoder",
                     forms={"fused": Form(torch.ops.flashrt.gelu_mul, device="cuda", available=csrc_loads)},
                     portable=gelu_mul_ref))
    self.gelu_mul = OpSlot(op)               # in a block's __init__: the reference until a choice is made
    y = self.gelu_mul.run(x)                 # in its forward: the chosen form, no lookup per call
    choices = select(model, "cuda", torch.bfloat16)   # at load, once: {"gelu_mul": {"fused": 18}, ...}

An `Op` is one computation with several forms: its **reference** (always there, the parity anchor every
other form is tested against), platform forms (a CPU oneDNN or native-library kernel, a CUDA custom
op), and its **portable** form, what an exported program records (`portable_forms`). A form names the
device type it runs on, whether the platform has it (``available``: a library loads, torch ships the
op; asked once per `select` pass) and whether a slot's owner takes it (``fits``: its weights' dtype and
layout), and the compute dtypes it runs (``dtypes``).

`select` walks a module's op slots (`OpSlot` attributes of any submodule) and sets each to the first of
its op's forms, in the op's order, that runs on the device, is available, takes the precision and fits
the owner; the reference where none does. ``prefer`` forces a form per op or per group of ops (a load
option such as ``kernels="fused"``), ahead of the device and availability checks (a form forced onto a
device it does not run on must itself fall back, as the ``flashrt::`` custom ops do); the form must
still fit the owner. No environment variable decides anything: the choice is a function of the module,
the device, the precision and ``prefer``, and it is returned (`Choices`, what ``describe()["ops"]``
reports) and readable at any time (`choices`).

This package is the floor under `flashrt.nn`, `flashrt.quant` and `flashrt.runtime`: it knows no block
and no model. Ops whose forms need a block (a GeGLU over a layer's weights, a conv's plans) are defined
by that block's module and registered here; `runtime` asks this registry for portable forms and export
translations instead of importing the blocks.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from flashrt.errors import ConfigError

__all__ = ["Choices", "Form", "Op", "OpSlot", "choices", "export_ops", "export_translations", "get",
           "portable_forms", "register", "registered", "select", "slots", "using"]

Choices = dict[str, dict[str, int]]  # op name -> {form name: number of slots running it}


def _always(*_: Any) -> bool:
    return True


@dataclass(frozen=True)
class Form:
    """One platform form of an op: ``fn`` (the op's signature), where it runs and when it applies."""

    fn: Callable[..., Any]
    device: str | None = None                       # device type it runs on; None: any
    available: Callable[[], bool] = _always         # the platform has it (asked once per select pass)
    fits: Callable[[Any], bool] = _always           # the slot's owner module takes it
    dtypes: tuple[torch.dtype, ...] | None = None   # compute dtypes it runs; None: any


@dataclass(frozen=True)
class Op:
    """One op: its reference (named ``reference_name``), its platform forms in preference order, its
    ``group`` (ops chosen together by one load option, e.g. "decoder"), its portable form (what an export
    records; None: the form chosen at load is already portable), ``translations``: ONNX forms of
    torch ops it records ({torch op overload: onnxscript function}, `export_translations`), and
    ``export_ops``: aten compositions an exported program runs in place of ops its forms record that an
    exporter cannot take ({op overload: function}, `export_ops`; a custom op's reference)."""

    name: str
    reference: Callable[..., Any]
    forms: Mapping[str, Form] = field(default_factory=dict)
    group: str | None = None
    reference_name: str = "aten"
    portable: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    translations: Callable[[], Mapping[Any, Callable[..., Any]]] | None = None
    export_ops: Callable[[], Mapping[Any, Callable[..., Any]]] | None = None

    @property
    def form_names(self) -> tuple[str, ...]:
        return (self.reference_name, *self.forms)

    def fn(self, form: str) -> Callable[..., Any]:
        if form == self.reference_name:
            return self.reference
        if form not in self.forms:
            raise ConfigError(f"op {self.name!r} has no form {form!r}; forms: {list(self.form_names)}")
        return self.forms[form].fn

    def choose(self, owner: Any, device: str, dtype: torch.dtype | None, forced: str | None,
               available: Callable[[Form], bool]) -> str:
        """The form a slot of ``owner`` runs (module docstring)."""
        if forced is not None:
            return self.forced(owner, forced)
        for name, form in self.forms.items():
            if form.device not in (None, device) or (form.dtypes and dtype is not None
                                                      and dtype not in form.dtypes):
                continue
            if form.fits(owner) and available(form):  # fits first: a platform check may build a library
                return name
        return self.reference_name

    def forced(self, owner: Any, form: str) -> str:
        """``form`` where it fits ``owner``, else the reference; ConfigError for a form it does not have."""
        self.fn(form)
        return form if form == self.reference_name or self.forms[form].fits(owner) else self.reference_name


_REGISTRY: dict[str, Op] = {}


def register(op: Op) -> Op:
    """Add ``op`` to the registry (by name; registering the same name again replaces it: a reload)."""
    _REGISTRY[op.name] = op
    return op


def get(name: str) -> Op:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"no op {name!r}; registered: {sorted(_REGISTRY)}") from None


def registered() -> dict[str, Op]:
    """Every registered op by name (those of the modules imported so far)."""
    return dict(_REGISTRY)


class OpSlot:
    """A module's seat for one op: ``run`` is the chosen form's callable (the reference until `select`
    or `use` picks another), ``form`` its name."""

    __slots__ = ("op", "form", "run")

    def __init__(self, op: Op, form: str | None = None) -> None:
        self.op = op
        self.use(op.reference_name if form is None else form)

    def use(self, form: str) -> None:
        self.run = self.op.fn(form)
        self.form = form

    def __repr__(self) -> str:
        return f"OpSlot({self.op.name}: {self.form})"

    def __copy__(self) -> OpSlot:
        return OpSlot(self.op, self.form)

    def __deepcopy__(self, memo: dict[int, Any]) -> OpSlot:
        return OpSlot(self.op, self.form)

    def __reduce__(self) -> tuple[Any, ...]:
        return _slot, (self.op.name, self.form)


def _slot(name: str, form: str) -> OpSlot:
    return OpSlot(get(name), form)


def slots(module: torch.nn.Module) -> Iterator[tuple[str, Any, OpSlot]]:
    """(qualified slot name, owner, slot) of every op slot of ``module`` and its submodules."""
    for prefix, owner in module.named_modules():
        for attr, value in vars(owner).items():
            if isinstance(value, OpSlot):
                yield (f"{prefix}.{attr}" if prefix else attr), owner, value


def select(module: torch.nn.Module, device: torch.device | str, precision: torch.dtype | str | None = None,
           prefer: Mapping[str, str] | None = None) -> Choices:
    """Set every op slot of ``module`` to its form for ``device`` and ``precision`` (module docstring);
    ``prefer``: {op name or group: form} forced. Returns the choices (`Choices`)."""
    dev = torch.device(device).type
    dtype = getattr(torch, precision) if isinstance(precision, str) else precision
    prefer = dict(prefer or {})
    asked: dict[int, bool] = {}

    def available(form: Form) -> bool:
        if id(form) not in asked:
            asked[id(form)] = bool(form.available())
        return asked[id(form)]

    for _, owner, slot in slots(module):
        op = slot.op
        forced = prefer.get(op.name, prefer.get(op.group) if op.group is not None else None)
        slot.use(op.choose(owner, dev, dtype if isinstance(dtype, torch.dtype) else None, forced, available))
    return choices(module)


def choices(module: torch.nn.Module) -> Choices:
    """What ``module``'s op slots run now: {op: {form: count}}, sorted."""
    counts: dict[str, Counter[str]] = {}
    for _, _, slot in slots(module):
        counts.setdefault(slot.op.name, Counter())[slot.form] += 1
    return {name: dict(sorted(c.items())) for name, c in sorted(counts.items())}


@contextlib.contextmanager
def using(module: torch.nn.Module, prefer: Mapping[str, str]) -> Iterator[None]:
    """Inside the block the slots of the ops (or groups) in ``prefer`` run the named form (where it fits
    the owner, else the reference); every slot's previous form is restored after."""
    saved = [(slot, slot.form) for _, _, slot in slots(module)]
    try:
        for _, owner, slot in slots(module):
            forced = prefer.get(slot.op.name, prefer.get(slot.op.group) if slot.op.group else None)
            if forced is not None:
                slot.use(slot.op.forced(owner, forced))
        yield
    finally:
        for slot, form in saved:
            slot.use(form)


@contextlib.contextmanager
def portable_forms() -> Iterator[None]:
    """Every registered op runs its portable form inside the block (an export records it)."""
    with contextlib.ExitStack() as stack:
        for op in list(_REGISTRY.values()):
            if op.portable is not None:
                stack.enter_context(op.portable())
        yield


def export_ops() -> dict[Any, Callable[..., Any]]:
    """What an exported program runs for the ops registered ops record ({op overload: composition})."""
    table: dict[Any, Callable[..., Any]] = {}
    for op in list(_REGISTRY.values()):
        if op.export_ops is not None:
            table.update(op.export_ops())
    return table


def export_translations() -> dict[Any, Callable[..., Any]]:
    """The ONNX translations of every registered op ({torch op overload: onnxscript function})."""
    table: dict[Any, Callable[..., Any]] = {}
    for op in list(_REGISTRY.values()):
        if op.translations is not None:
            table.update(op.translations())
    return table
