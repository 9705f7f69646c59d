"""Checking a ``secondary_tiers`` entry without building anything.

This module owns what an entry may say: the framework's keys
(:data:`FRAMEWORK_KEYS`, described in :mod:`tiering.registry`) and their values,
the options the tier class's constructor accepts and requires
(:func:`tier_options`, :meth:`~tiering.tier.AsyncTier.check_options`), a tier's
identity for request filters and events (:func:`tier_identity`), and the
reading of an entry written for vLLM with our adapter classes as our own
(:func:`from_vllm_entry`). :func:`check_tier_config` runs all of it and raises
:class:`~tiering.core.errors.ConfigError` naming the entry's position and type. Everything
here is importable from :mod:`tiering.registry` too.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from tiering.core.errors import ConfigError
from tiering.manager.filters import LOCALITIES, MEDIA
from tiering.registry.types import resolve_tier_class
from tiering.runtime.facade import check_runtime_options
from tiering.tier import AsyncTier
from tiering.tier.auth import AUTH_OPTION_NAMES, authenticator_from_options

#: Keys of a tier's config dict that configure the runtime, not the tier.
FRAMEWORK_KEYS = (
    "type",
    "module_path",
    "name",
    "job_timeout_s",
    "open_timeout_s",
    "shutdown_timeout_s",
    "cancel_grace_s",
    "shared_absent_ttl_s",
    "shared_present_ttl_s",
    "shared_max_known_keys",
    "max_events",
    "verify",
    "failed_load_backoff_s",
    "cpus",
    "max_gil_hold_ms",
    "gc_handoff",
    "isolation",
    "medium",
    "locality",
    "enable_kv_events",
)
#: Framework keys whose JSON ``null`` means "the default": all but those where null has a
#: meaning of its own (``verify`` automatic, ``cpus`` not pinned, ``max_gil_hold_ms`` off).
NULL_MEANS_DEFAULT = frozenset(FRAMEWORK_KEYS[3:]) - {"verify", "cpus", "max_gil_hold_ms"}
#: The framework keys passed on to the tier's runtime manager as keywords.
MANAGER_OPTIONS = FRAMEWORK_KEYS[3 : FRAMEWORK_KEYS.index("isolation")]
#: Where a tier's event loop may run (the ``isolation`` key).
ISOLATION_MODES = ("thread", "process")


def _options_with_defaults(tier_class: type[AsyncTier]) -> set[str]:
    """The keyword names of ``tier_class``'s constructor that have a default."""
    return {
        param.name
        for param in inspect.signature(tier_class).parameters.values()
        if param.default is not inspect.Parameter.empty
        and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
    }


def tier_options(tier_class: type[AsyncTier]) -> tuple[list[str], list[str], bool]:
    """``(accepted, required, takes_any)`` keyword names of ``tier_class``'s constructor."""
    signature = inspect.signature(tier_class)
    accepted: list[str] = []
    required: list[str] = []
    takes_any = False
    for param in signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            takes_any = True
        elif param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            accepted.append(param.name)
            if param.default is inspect.Parameter.empty:
                required.append(param.name)
        elif param.kind is inspect.Parameter.POSITIONAL_ONLY and param.default is param.empty:
            required.append(param.name)  # cannot be given by config: always reported missing
    return accepted, required, takes_any


#: The vLLM adapter classes (``tiering.integrations.vllm``) and the tier each runs.
_VLLM_ADAPTER_MODULE = "tiering.integrations.vllm"
_VLLM_ADAPTER_TIERS = {
    "KVTieringFileSystemTier": "fs",
    "KVTieringRedisTier": "redis",
    "KVTieringMemoryTier": "memory",
    "KVTieringTier": None,  # the ``tier`` option names it
}


def from_vllm_entry(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A ``secondary_tiers`` entry written for vLLM (our adapter classes) as our own entry.

    ``{"type": "KVTieringFileSystemTier", "module_path": "tiering.integrations.vllm",
    ...}`` becomes ``{"type": "fs", ...}`` (``KVTieringTier``'s ``tier`` option
    gives the type), so the same config file serves vLLM and ``tiering replay``
    without importing vLLM. Any other entry is returned as it is.
    """
    if not isinstance(config, Mapping) or config.get("module_path") != _VLLM_ADAPTER_MODULE:
        return config
    type_name = config.get("type")
    if type_name not in _VLLM_ADAPTER_TIERS:
        return config
    # vLLM's per-tier back-pressure detector is vLLM's: our manager applies its own
    # (cascade_max_pinned_fraction), so the entry keeps working in `tiering replay`.
    ours = {k: v for k, v in config.items() if k not in ("module_path", "backpressure")}
    fixed = _VLLM_ADAPTER_TIERS[type_name]
    ours["type"] = fixed if fixed is not None else ours.pop("tier", None)
    if not ours["type"]:
        raise ConfigError(f"{type_name} needs a 'tier' option naming the tier type to run")
    if fixed is not None and "tier" in ours:
        raise ConfigError(f"{type_name} always runs our {fixed!r} tier; drop the 'tier' option")
    return ours


def check_tier_config(
    config: Mapping[str, Any], *, position: int
) -> tuple[type[AsyncTier], dict[str, Any], Mapping[str, Any], str]:
    """Check a ``secondary_tiers`` entry without building anything.

    Resolves the type, checks the option names against the tier class's
    constructor (unknown options, missing required ones) and lets the class
    check values that must fail early (:meth:`AsyncTier.check_options`). Returns the class,
    the tier's own options, the entry as our own (see below) and the entry's
    description for messages. Values
    are checked by the class itself when it is constructed. An entry written
    for vLLM's ``module_path`` with our adapter classes is read as our own
    (see :func:`from_vllm_entry`).
    """
    where = f"secondary_tiers[{position}]"
    try:
        config = from_vllm_entry(config)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    if not isinstance(config, Mapping):
        raise ConfigError(f"{where} must be a dict with a 'type' key, got {config!r}")
    if any(config[k] is None for k in NULL_MEANS_DEFAULT if k in config):
        config = {k: v for k, v in config.items() if v is not None or k not in NULL_MEANS_DEFAULT}
    if "type" not in config:
        raise ConfigError(f"{where}: missing required key 'type'; config: {dict(config)!r}")
    type_name = config["type"]
    where = f"{where} (type {type_name!r})"
    try:
        tier_class = resolve_tier_class(type_name, config.get("module_path"))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    options = {k: v for k, v in config.items() if k not in FRAMEWORK_KEYS}
    # JSON null means the default (docs/configuration.md): an option the constructor has
    # a default for is left out rather than passed as None.
    defaulted = _options_with_defaults(tier_class)
    options = {k: v for k, v in options.items() if v is not None or k not in defaulted}
    accepted, required, takes_any = tier_options(tier_class)
    if not takes_any:
        for key in options:
            if key not in accepted:
                raise ConfigError(
                    f"{where}: unknown option {key!r}; {tier_class.__name__} accepts "
                    f"{', '.join(accepted) or 'no options'}; the framework's keys are "
                    f"{', '.join(FRAMEWORK_KEYS)}"
                )
    for key in required:
        if key not in options:
            raise ConfigError(f"{where}: missing required option {key!r} of {tier_class.__name__}")
    try:
        tier_class.check_options(options)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    name = config.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        raise ConfigError(f"{where}: 'name' must be a non-empty string, got {name!r}")
    try:
        check_runtime_options(**{k: config[k] for k in MANAGER_OPTIONS if k in config})
        tier_identity(config, tier_class)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    isolation = config.get("isolation", "thread")
    if isolation not in ISOLATION_MODES:
        raise ConfigError(
            f"{where}: isolation must be one of {', '.join(map(repr, ISOLATION_MODES))}, "
            f"got {isolation!r}"
        )
    if any(name in options for name in AUTH_OPTION_NAMES):
        # Read the authentication key now: a missing or unsafe key fails the spec's
        # construction, not the first build (the tier reads it again when built).
        try:
            authenticator_from_options(options)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return tier_class, options, config, where


def tier_identity(
    config: Mapping[str, Any], tier_class: type[AsyncTier]
) -> tuple[str, str | None, bool]:
    """``(medium, locality, events)`` of a tier entry: its ``medium`` (default: the class's),
    ``locality`` (``"LOCAL"`` / ``"REMOTE"``, default undeclared) and ``enable_kv_events``
    (default true). Raises :class:`ConfigError` naming the key for anything else."""
    medium = config.get("medium")
    medium = tier_class.medium if medium is None else medium
    if not isinstance(medium, str) or medium.upper() not in MEDIA:
        raise ConfigError(f"medium must be 'STORAGE' or 'CPU', got {medium!r}")
    locality = config.get("locality")
    if locality is not None and (
        not isinstance(locality, str) or locality.upper() not in LOCALITIES
    ):
        raise ConfigError(f"locality must be 'LOCAL' or 'REMOTE', got {locality!r}")
    events = config.get("enable_kv_events", True)
    if not isinstance(events, bool):
        raise ConfigError(f"enable_kv_events must be true or false, got {events!r}")
    return medium.upper(), None if locality is None else locality.upper(), events
