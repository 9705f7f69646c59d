"""Which tier class a ``secondary_tiers`` entry's ``type`` names.

This module owns the names of tier types: those given to
:func:`register_tier_type`, the built-in ones (:data:`BUILTIN_TIERS`, imported
only when used), entry points of the group :data:`ENTRY_POINT_GROUP`, a
``"package.module:Class"`` path and vLLM's ``{"type": "Class", "module_path":
...}`` spelling, looked up in that order by :func:`resolve_tier_class` (see
:mod:`tiering.registry` for the whole story of an entry). Everything here is
importable from :mod:`tiering.registry` too.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Mapping
from typing import Any

from tiering.core.errors import ConfigError
from tiering.tier import AsyncTier

#: Built-in tier names and the classes they import lazily ("module:Class").
BUILTIN_TIERS: Mapping[str, str] = {
    "memory": "tiers.memory:MemoryTier",
    "example": "tiers.memory:ExampleTier",
    "fs": "tiers.fs:FileSystemTier",
    "redis": "tiers.redis:RedisTier",
    "directory": "tiers.directory:DirectoryTier",
}

#: Entry-point group third-party packages use to publish tier types.
ENTRY_POINT_GROUP = "kv_tiering.tiers"

_registered: dict[str, str | type[AsyncTier]] = {}


def register_tier_type(name: str, target: str | type[AsyncTier], *, replace: bool = False) -> None:
    """Make ``{"type": name}`` build ``target``: an AsyncTier subclass or a ``"module:Class"`` path.

    Raises ``ValueError`` if ``name`` is already registered or built in,
    unless ``replace`` is True, and ``TypeError`` for a target that is
    neither. A string target is imported only when a tier of that type is
    created.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tier type name must be a non-empty string, got {name!r}")
    if isinstance(target, str):
        if ":" not in target:
            raise ValueError(f"tier target {target!r} must look like 'package.module:Class'")
    elif not (isinstance(target, type) and issubclass(target, AsyncTier)):
        raise TypeError(f"tier target must be an AsyncTier subclass or a path, got {target!r}")
    if not replace and (name in _registered or name in BUILTIN_TIERS):
        raise ValueError(f"tier type {name!r} is already defined (pass replace=True to override)")
    _registered[name] = target


def unregister_tier_type(name: str) -> None:
    """Forget a name given to :func:`register_tier_type` (no error if unknown)."""
    _registered.pop(name, None)


def known_tier_types() -> list[str]:
    """Every type name resolvable without a path: registered, built in, entry points."""
    names = set(_registered) | set(BUILTIN_TIERS)
    names.update(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def resolve_tier_class(type_name: str, module_path: str | None = None) -> type[AsyncTier]:
    """The tier class a ``type`` (and optional vLLM-style ``module_path``) names.

    Raises :class:`~tiering.core.errors.ConfigError` for an unknown name, a path
    that does not import, or something that is not an AsyncTier subclass.
    """
    if not isinstance(type_name, str) or not type_name:
        raise ConfigError(f"'type' must be a non-empty string, got {type_name!r}")
    if module_path is not None:
        if not isinstance(module_path, str) or not module_path:
            raise ConfigError(f"'module_path' must be a module name, got {module_path!r}")
        return _load(f"{module_path}:{type_name}", type_name)
    target = _registered.get(type_name) or BUILTIN_TIERS.get(type_name)
    if target is not None:
        return target if isinstance(target, type) else _load(target, type_name)
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name == type_name:
            try:
                loaded = entry_point.load()
            except Exception as exc:
                raise ConfigError(
                    f"tier type {type_name!r} (entry point {entry_point.value!r}) "
                    f"failed to import: {exc!r}"
                ) from exc
            return _check_class(loaded, type_name)
    if ":" in type_name:
        return _load(type_name, type_name)
    raise ConfigError(
        f"unknown tier type {type_name!r}; known types: {', '.join(known_tier_types())}, "
        "or a 'package.module:Class' path"
    )


def _load(path: str, type_name: str) -> type[AsyncTier]:
    module_name, _, attribute = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"tier type {type_name!r}: cannot import {path!r}: {exc}") from exc
    return _check_class(obj, type_name)


def _check_class(obj: object, type_name: str) -> type[AsyncTier]:
    if not (isinstance(obj, type) and issubclass(obj, AsyncTier)):
        raise ConfigError(f"tier type {type_name!r} names {obj!r}, which is not an AsyncTier")
    return obj
