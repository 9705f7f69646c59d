"""Resolving an ``eviction_policy`` setting to a policy class: the one resolver every entry uses.

A setting names a policy in one of four ways. With ``module_path`` (vLLM's spelling:
``eviction_policy: "MyPolicy"`` plus ``cache_policy_module_path: "pkg.mod"``) it is
the class ``MyPolicy`` of that module, whatever the name (as vLLM reads it). Without
one, these are tried in this order:

1. a built-in name: ``"lru"``, ``"arc"``, ``"kvaware"``, ``"adaptive"`` (case-insensitive);
2. the name of an entry point in the group ``kv_tiering.policies``;
3. an import path ``"pkg.mod:Class"``.

and may carry options, the policy class's keyword arguments: a mapping
``{"name": "kvaware", "probation_ghosts": 2}``, or in text (the CLI)
``"kvaware(probation_ghosts=2)"``. :func:`resolve_policy` checks the name, imports
the class and builds one small instance with the options, so every mistake is a
:class:`~tiering.core.errors.ConfigError` naming the key, at configuration time.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from tiering.core.errors import ConfigError
from tiering.policies.adaptive import AdaptivePolicy
from tiering.policies.arc import ARCPolicy
from tiering.policies.base import EvictionPolicy
from tiering.policies.kvaware import KVAwarePolicy
from tiering.policies.lru import LRUPolicy

#: Entry-point group third-party packages use to publish eviction policies.
ENTRY_POINT_GROUP = "kv_tiering.policies"

#: Policies shipped with the framework, by the name a config uses.
BUILTIN_POLICIES: Mapping[str, type[EvictionPolicy[Any]]] = MappingProxyType(
    {"lru": LRUPolicy, "arc": ARCPolicy, "kvaware": KVAwarePolicy, "adaptive": AdaptivePolicy}
)

#: The default set ``tiering sweep`` compares: every built-in policy.
POLICY_NAMES = ("lru", "arc", "kvaware", "adaptive")

PolicyFactory = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class PolicyKind:
    """One family of pluggable policies: what they subclass, built-ins and entry-point group."""

    noun: str  # "eviction policy", "admission policy"
    base: type
    builtins: Mapping[str, type]
    group: str
    doc: str  # where users read how to write one


EVICTION = PolicyKind(
    "eviction policy",
    EvictionPolicy,
    BUILTIN_POLICIES,
    ENTRY_POINT_GROUP,
    "docs/writing-a-policy.md",
)

_NAME_KEY = "name"
_TEXT_FORM = re.compile(r"^\s*([^()\s]+)\s*(?:\((.*)\))?\s*$", re.DOTALL)


@dataclass(frozen=True, slots=True)
class PolicyChoice:
    """A resolved policy setting: the class (or factory) and its keyword options.

    ``name`` is the setting as written (lower case for built-ins). Build a
    policy for a tier of ``capacity`` keys with :meth:`build`.
    """

    name: str
    factory: PolicyFactory
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def build(self, capacity: int) -> Any:
        """A fresh policy for ``capacity`` keys (``ConfigError`` for a bad capacity).

        An :class:`EvictionPolicy` for choices :func:`resolve_policy` made (an
        admission policy for those of :func:`~tiering.policies.admission.resolve_admission`).
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ConfigError(f"policy capacity must be a positive int, got {capacity!r}")
        return self.factory(capacity, **self.options)

    @property
    def label(self) -> str:
        """``name`` plus options, in the text form the CLI accepts: ``kvaware(x=1)``."""
        if not self.options:
            return self.name
        shown = ",".join(f"{k}={json.dumps(v)}" for k, v in self.options.items())
        return f"{self.name}({shown})"

    def to_json(self) -> Any:
        """The setting as a config would write it: the name, or a mapping with options."""
        if not self.options:
            return self.name
        return {_NAME_KEY: self.name, **self.options}

    def __str__(self) -> str:
        return self.label


def known_policy_names(kind: PolicyKind = EVICTION) -> list[str]:
    """Names resolvable without a path: the built-ins, then entry points."""
    names = list(kind.builtins)
    for entry_point in importlib.metadata.entry_points(group=kind.group):
        if entry_point.name not in names:
            names.append(entry_point.name)
    return names


def resolve_policy(
    setting: object,
    *,
    module_path: object = None,
    key: str = "eviction_policy",
    options: Mapping[str, Any] | None = None,
    kind: PolicyKind = EVICTION,
) -> PolicyChoice:
    """Resolve an ``eviction_policy`` setting (see the module docstring) to a :class:`PolicyChoice`.

    ``setting`` is a name, a ``"name(k=v,...)"`` text, a mapping with a
    ``"name"`` key and options, or an already resolved :class:`PolicyChoice`.
    ``options`` are added to those the setting carries. ``key`` names the
    setting in error messages (``"secondary_tiers[0].eviction_policy"``).
    Raises :class:`ConfigError` for an unknown name, a class that is not an
    :class:`EvictionPolicy`, or options its constructor rejects.
    """
    if isinstance(setting, PolicyChoice) and not options and module_path is None:
        return setting
    name, given = _split_setting(setting, key, kind)
    merged = {**given, **(options or {})}
    if module_path is not None:
        if not isinstance(module_path, str) or not module_path.strip():
            raise ConfigError(
                f"cache_policy_module_path must be a module name like 'pkg.mod', "
                f"got {module_path!r}"
            )
        factory = _load(f"{module_path.strip()}:{name}", name, key, kind)
    else:
        factory = _factory_for(name, key, kind)
        if name.lower() in kind.builtins:
            name = name.lower()
    choice = PolicyChoice(name, factory, MappingProxyType(merged))
    _check_options(choice, key, kind)
    return choice


def make_policy(setting: object, capacity: int) -> EvictionPolicy[Any]:
    """Build the policy ``setting`` names (read as :func:`resolve_policy` does) for ``capacity``.

    Raises :class:`ConfigError` for a bad setting or a capacity that is not a
    positive int.
    """
    choice = resolve_policy(setting)
    policy: object = choice.build(capacity)
    if not isinstance(policy, EvictionPolicy):  # e.g. an admission policy's resolved choice
        raise ConfigError(
            f"eviction_policy {choice.label!r} builds a {type(policy).__name__}, which is not an "
            "EvictionPolicy"
        )
    return policy


def parse_policy_text(text: str, *, key: str = "eviction_policy") -> dict[str, Any]:
    """``"name"`` or ``"name(k=v,k=v)"`` as a mapping ``{"name": ..., k: v}``.

    Values are read as JSON where they parse (numbers, true/false, quoted
    strings) and kept as strings otherwise.
    """
    match = _TEXT_FORM.match(text)
    if match is None or not match.group(1):
        raise ConfigError(f"{key}: cannot read {text!r}; write NAME or NAME(key=value,...)")
    setting: dict[str, Any] = {_NAME_KEY: match.group(1)}
    body = match.group(2)
    for item in filter(None, (part.strip() for part in (body or "").split(","))):
        option, sep, raw = item.partition("=")
        option = option.strip()
        if not sep or not option.isidentifier():
            raise ConfigError(f"{key}: option {item!r} in {text!r} must look like key=value")
        try:
            setting[option] = json.loads(raw)
        except ValueError:
            setting[option] = raw.strip()
    return setting


def split_policy_list(text: str) -> list[str]:
    """Split a comma-separated list of policies, keeping commas inside ``(...)``."""
    items: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "," and depth == 0:
            items.append("".join(current).strip())
            current = []
            continue
        depth += (char == "(") - (char == ")")
        current.append(char)
    items.append("".join(current).strip())
    return [item for item in items if item]


# -- internals --------------------------------------------------------------------------------


def _split_setting(setting: object, key: str, kind: PolicyKind) -> tuple[str, dict[str, Any]]:
    if isinstance(setting, PolicyChoice):
        return setting.name, dict(setting.options)
    if isinstance(setting, str):
        if "(" in setting:
            setting = parse_policy_text(setting, key=key)
        else:
            return _check_name(setting, key, kind), {}
    if isinstance(setting, Mapping):
        if _NAME_KEY not in setting:
            raise ConfigError(
                f"{key}: a mapping needs a 'name' key naming the policy, e.g. "
                f'{{"name": "kvaware", "probation_ghosts": 2}}; got {dict(setting)!r}'
            )
        options = {k: v for k, v in setting.items() if k != _NAME_KEY}
        bad = [k for k in options if not isinstance(k, str) or not k.isidentifier()]
        if bad:
            raise ConfigError(f"{key}: option names must be identifiers, got {bad[0]!r}")
        return _check_name(setting[_NAME_KEY], key, kind), options
    raise ConfigError(_unknown_message(key, setting, kind))


def _check_name(name: object, key: str, kind: PolicyKind) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(_unknown_message(key, name, kind))
    return name.strip()


def _factory_for(name: str, key: str, kind: PolicyKind) -> PolicyFactory:
    builtin = kind.builtins.get(name.lower())
    if builtin is not None:
        return builtin
    for entry_point in importlib.metadata.entry_points(group=kind.group):
        if entry_point.name == name:
            try:
                loaded = entry_point.load()
            except Exception as exc:
                raise ConfigError(
                    f"{key}: policy {name!r} (entry point {entry_point.value!r}) failed to "
                    f"import: {exc!r}"
                ) from exc
            return _check_factory(loaded, name, key, kind)
    if ":" in name:
        return _load(name, name, key, kind)
    raise ConfigError(_unknown_message(key, name, kind))


def _unknown_message(key: str, name: object, kind: PolicyKind) -> str:
    return (
        f"{key} must be one of {', '.join(known_policy_names(kind))}, a 'package.module:Class' "
        f"import path or an entry point in group {kind.group!r}; got {name!r}"
    )


def _load(path: str, name: str, key: str, kind: PolicyKind) -> PolicyFactory:
    module_name, _, attribute = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{key}: cannot import policy {path!r}: {exc}") from exc
    return _check_factory(obj, name, key, kind)


def _check_factory(obj: object, name: str, key: str, kind: PolicyKind) -> PolicyFactory:
    if isinstance(obj, type) and issubclass(obj, kind.base):
        return obj
    raise ConfigError(
        f"{key}: {name!r} names {obj!r}, which is not an {kind.base.__name__} subclass "
        f"(see {kind.doc})"
    )


def _check_options(choice: PolicyChoice, key: str, kind: PolicyKind) -> None:
    """Build one tiny instance: unknown or bad options fail now, naming the key."""
    try:
        probe = choice.factory(1, **choice.options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key}: policy {choice.label} rejected its options: {exc}") from exc
    if not isinstance(probe, kind.base):
        raise ConfigError(f"{key}: {choice.name!r} did not build an {kind.base.__name__}")
