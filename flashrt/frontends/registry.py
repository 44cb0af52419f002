"""Where `load_policy` / `load_vocoder` / `load_tts` find the families: one line per family.

A new family is a new folder plus one line here: ``"name": "module:ATTRIBUTE"``, the module holding
the family's registry entry (a `flashrt.runtime.frontend.PolicyFamily` for policies, a `TtsFamily`
for text-to-speech). Modules are imported on first use, so `import flashrt` stays light and a family
whose optional dependencies are missing does not break the others. Tests and users may add entries at
run time with `register_policy_family` / `register_tts_family` (a toy family in a test, a private
family in an application).

A `TtsFamily` loads a speech model: an object with ``sample_rate`` (Hz), ``__call__(text, **options)``
-> float32 audio (N,) in [-1, 1], and ``stream(text, **options)`` -> an iterator of such chunks whose
concatenation is the one-shot audio; it checks the text before yielding anything (InputError). Options
every family accepts: ``seed``, ``speed``. ``describe()`` says what was loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashrt.errors import ConfigError
from flashrt.runtime.frontend import PolicyFamily

__all__ = ["POLICY_FAMILIES", "policy_families", "register_policy_family", "unregister_policy_family",
           "TTS_FAMILIES", "TtsFamily", "tts_families", "register_tts_family", "unregister_tts_family"]

POLICY_FAMILIES: dict[str, str] = {
    "pi0": "flashrt.frontends.pi0.family:FAMILY",
    "pi0_fast": "flashrt.frontends.pi0_fast.family:FAMILY",
    "groot": "flashrt.frontends.groot.family:FAMILY",
}

TTS_FAMILIES: dict[str, str] = {
    "vits": "flashrt.frontends.vits.family:FAMILY",
    "orpheus": "flashrt.runner.orpheus:FAMILY",  # load needs the vocoder runner; the rest: frontends/orpheus
}


@dataclass(frozen=True)
class TtsFamily:
    """A TTS registry entry: `detect(source)` returns None when `source` (a folder, a file or a name) is
    this family's and raises `CheckpointError` saying why not otherwise; `load(source, **options)`
    returns a speech model (module docstring). Options every family accepts: device, precision,
    backend; a family lists its own extras in `options`."""

    name: str
    detect: Callable[[str | Path], None]
    load: Callable[..., Any]
    options: tuple[str, ...] = ()
    doc: str = ""


class Registry:
    """One kind of family (policies, TTS): the built-in table plus run-time registrations, each module
    imported on first use and checked to hold an entry of `kind` under its own name."""

    def __init__(self, what: str, table: dict[str, str], kind: type) -> None:
        self.what, self.table, self.kind = what, table, kind
        self._loaded: dict[str, Any] = {}

    def families(self) -> dict[str, Any]:
        """Every available family, by name, in table order (run-time registrations last)."""
        for name, target in self.table.items():
            if name not in self._loaded:
                family = self._resolve(name, target)
                if family is not None:
                    self._loaded[name] = family
        return dict(self._loaded)

    def _resolve(self, name: str, target: str) -> Any:
        module, attr = target.split(":")
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:  # a family not written (or not installed) yet is not available
            if exc.name is not None and module.startswith(exc.name):
                return None
            raise
        family = getattr(mod, attr)
        if not isinstance(family, self.kind) or family.name != name:
            raise ConfigError(f"{target} is not the {self.kind.__name__} {name!r}")
        return family

    def register(self, family: Any, replace: bool = False) -> Any:
        """Add a family at run time (ConfigError if the name is taken, unless replace=True)."""
        known = self.families()
        if family.name in known and known[family.name] is not family and not replace:
            raise ConfigError(f"{self.what} family {family.name!r} is already registered")
        self._loaded[family.name] = family
        return family

    def unregister(self, name: str) -> None:
        """Remove a family registered at run time (tests clean up with this)."""
        if name in self.table:
            raise ConfigError(f"{self.what} family {name!r} is built in; it cannot be removed")
        self._loaded.pop(name, None)


POLICIES = Registry("policy", POLICY_FAMILIES, PolicyFamily)
TTS = Registry("tts", TTS_FAMILIES, TtsFamily)


def policy_families() -> dict[str, PolicyFamily]:
    return POLICIES.families()


def register_policy_family(family: PolicyFamily, replace: bool = False) -> PolicyFamily:
    return POLICIES.register(family, replace)


def unregister_policy_family(name: str) -> None:
    POLICIES.unregister(name)


def tts_families() -> dict[str, TtsFamily]:
    return TTS.families()


def register_tts_family(family: TtsFamily, replace: bool = False) -> TtsFamily:
    return TTS.register(family, replace)


def unregister_tts_family(name: str) -> None:
    TTS.unregister(name)
