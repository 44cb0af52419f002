"""Where `load_policy` / `load_vocoder` / `load_tts` find the families: one line per family.

A new family is a new folder plus one line here: ``"name": "module:ATTRIBUTE"``, the module holding
the family's registry entry (a `flashrt.runtime.frontend.PolicyFamily` for policies). Modules are
imported on first use, so `import flashrt` stays light and a family whose optional dependencies are
missing does not break the others. Tests and users may add entries at run time with
`register_policy_family` (a toy family in a test, a private family in an application).
"""

from __future__ import annotations

import importlib

from flashrt.errors import ConfigError
from flashrt.runtime.frontend import PolicyFamily

__all__ = ["POLICY_FAMILIES", "policy_families", "register_policy_family", "unregister_policy_family"]

POLICY_FAMILIES: dict[str, str] = {
    "pi0": "flashrt.frontends.pi0.family:FAMILY",
    "groot": "flashrt.frontends.groot.family:FAMILY",
}

_LOADED: dict[str, PolicyFamily] = {}


def _resolve(name: str, target: str) -> PolicyFamily | None:
    module, attr = target.split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:  # a family not written (or not installed) yet is not available
        if exc.name is not None and module.startswith(exc.name):
            return None
        raise
    family = getattr(mod, attr)
    if not isinstance(family, PolicyFamily) or family.name != name:
        raise ConfigError(f"{target} is not the PolicyFamily {name!r}")
    return family


def policy_families() -> dict[str, PolicyFamily]:
    """Every available policy family, by name, in registry order (run-time registrations last)."""
    for name, target in POLICY_FAMILIES.items():
        if name not in _LOADED:
            family = _resolve(name, target)
            if family is not None:
                _LOADED[name] = family
    return dict(_LOADED)


def register_policy_family(family: PolicyFamily, replace: bool = False) -> PolicyFamily:
    """Add a family at run time (ConfigError if the name is taken, unless replace=True)."""
    known = policy_families()
    if family.name in known and known[family.name] is not family and not replace:
        raise ConfigError(f"policy family {family.name!r} is already registered")
    _LOADED[family.name] = family
    return family


def unregister_policy_family(name: str) -> None:
    """Remove a family registered at run time (tests clean up with this)."""
    if name in POLICY_FAMILIES:
        raise ConfigError(f"policy family {name!r} is built in; it cannot be removed")
    _LOADED.pop(name, None)
