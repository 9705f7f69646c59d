"""Secondary tiers from config dicts ``{"type": ..., **options}`` (the seed's ``secondary_tiers``).

A ``type`` names a tier class (an :class:`~tiering.tier.AsyncTier` subclass),
found in this order:

1. names given to :func:`register_tier_type`;
2. the built-in names (:data:`BUILTIN_TIERS`: ``memory``, ``example``, ``fs``,
   ``redis``, ``directory``), imported only when used;
3. entry points of the group ``kv_tiering.tiers`` (a third-party package
   declares ``[project.entry-points."kv_tiering.tiers"] mytier = "pkg.mod:MyTier"``);
4. a ``"package.module:Class"`` path;
5. vLLM 0.33's style, ``{"type": "Class", "module_path": "package.module"}``.

The other keys of the dict are split in two. The *framework's* keys
(:data:`FRAMEWORK_KEYS`) configure the runtime around the tier:

``name``                 label in logs, metrics and the loop thread's name
                         (default ``"<type>-<position>"``)
``job_timeout_s``        every job's deadline (default 30)
``open_timeout_s``       how long opening the tier may take (default 30)
``shutdown_timeout_s``   bound on shutdown (default 10)
``cancel_grace_s``       how long a cancelled operation may linger (default 1)
``shared_absent_ttl_s``  shared tiers: how long an "absent" answer is trusted (default 5)
``shared_present_ttl_s`` shared tiers: how long a "present" answer is trusted (default 60)
``shared_max_known_keys`` shared tiers: most "present" answers kept (default 1000000)
``max_events``           events kept for ``take_events`` (default 100000)
``verify``               checksum stored blocks and verify loads (default: unless
                         the tier declares ``verifies_reads``)
``failed_load_backoff_s`` after a load of a key fails, lookups answer False for it this
                         long (default 0: off; the vLLM adapter sets 10)
``cpus``                 CPUs for what runs the tier: its loop thread and the threads
                         it starts, or its whole child process (a list of ids or a
                         string like ``"2-5,8"``; default: not pinned)
``max_gil_hold_ms``      longest run of loop work between GIL hand-offs, so the
                         scheduler thread gets the GIL back within about that long
                         (default 1; null: off; ``docs/runtime.md``, "The GIL")
``gc_handoff``           another thread of the scheduler's process (the tier's loop
                         thread; for ``isolation: process``, a collector thread) runs
                         the garbage collections the scheduler's step would run,
                         while the scheduler waits for the GPU (default true;
                         ``docs/runtime.md``, "Garbage collections")
``isolation``            ``"thread"`` (default: the tier's event loop on a thread of this
                         process) or ``"process"`` (in a child process:
                         :class:`~tiering.isolation.IsolatedTierManager`; the tier's
                         class and options must pickle)
``medium``               ``"STORAGE"`` or ``"CPU"`` (default: the tier class's ``medium``);
                         matched by requests' ``kv_load_tiers`` / ``kv_store_tiers``
``locality``             ``"LOCAL"`` or ``"REMOTE"`` (default: undeclared, matches any);
                         matched by the same filters and reported in events
``enable_kv_events``     report this tier's stored/removed events (default true)
``module_path``          see 5. above

Every other key is passed to the tier class's constructor as a keyword.
Before constructing, the constructor's signature is checked: an unknown
keyword or a missing required argument raises
:class:`~tiering.errors.ConfigError` naming the tier's position in the list,
its type and the offending key, and listing what is accepted.
"""

from __future__ import annotations

import errno
import functools
import importlib
import importlib.metadata
import inspect
import pickle
from collections.abc import Callable, Mapping
from typing import Any

from tiering.auth import AUTH_OPTION_NAMES, authenticator_from_options
from tiering.errors import ConfigError
from tiering.host_buffer import HostBuffer
from tiering.manager.filters import LOCALITIES, MEDIA
from tiering.runtime import AsyncTierManager
from tiering.runtime.facade import check_runtime_options
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
_MANAGER_OPTIONS = FRAMEWORK_KEYS[3 : FRAMEWORK_KEYS.index("isolation")]
#: Where a tier's event loop may run (the ``isolation`` key).
ISOLATION_MODES = ("thread", "process")

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

    Raises :class:`~tiering.errors.ConfigError` for an unknown name, a path
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
    ours = {k: v for k, v in config.items() if k != "module_path"}
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
    if "type" not in config:
        raise ConfigError(f"{where}: missing required key 'type'; config: {dict(config)!r}")
    type_name = config["type"]
    where = f"{where} (type {type_name!r})"
    try:
        tier_class = resolve_tier_class(type_name, config.get("module_path"))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    options = {k: v for k, v in config.items() if k not in FRAMEWORK_KEYS}
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
        check_runtime_options(**{k: config[k] for k in _MANAGER_OPTIONS if k in config})
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


def create_secondary_tier(
    config: Mapping[str, Any],
    primary_kv_view: memoryview,
    *,
    position: int,
    layout_fingerprint: str = "",
    primary_buffer: HostBuffer | None = None,
) -> AsyncTierManager:
    """Build the tier ``config`` describes and run it behind an :class:`AsyncTierManager`.

    ``position`` is the entry's index in ``secondary_tiers`` (for messages).
    With ``isolation: process`` the tier is built and run in a child process
    (:class:`~tiering.isolation.IsolatedTierManager`) over ``primary_buffer``,
    the named shared buffer behind ``primary_kv_view``.
    Configuration mistakes raise :class:`~tiering.errors.ConfigError` naming
    the position, the type and the offending key, before anything is
    started; an error opening the tier propagates as the tier raised it, with
    a note (:func:`tier_start_failure`) naming the tier, the cause and the fix.
    """
    tier_class, options, config, where = check_tier_config(config, position=position)
    type_name = config["type"]
    if config.get("isolation", "thread") == "process":
        return _create_isolated(
            config, tier_class, options, where, position, layout_fingerprint, primary_buffer
        )
    try:
        tier = tier_class(**options)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {tier_class.__name__} rejected its options: {exc}") from exc
    start = functools.partial(
        AsyncTierManager,
        tier,
        primary_kv_view,
        str(type_name),
        layout_fingerprint=layout_fingerprint,
    )
    return _start_manager(start, config, where, position, tier_class)


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


def _start_manager(
    start: Callable[..., AsyncTierManager],
    config: Mapping[str, Any],
    where: str,
    position: int,
    tier_class: type[AsyncTier],
) -> AsyncTierManager:
    """``start(name=..., **the entry's framework options)``; its errors name the entry."""
    manager_options = {k: config[k] for k in _MANAGER_OPTIONS if k in config}
    name = config.get("name") or f"{config['type']}-{position}"  # null: the default
    medium, locality, events = tier_identity(config, tier_class)
    try:
        manager = start(name=name, **manager_options)
        manager.medium, manager.locality, manager.events_enabled = medium, locality, events
        return manager
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    except Exception as exc:
        exc.add_note(_TIER_START_NOTE + _start_failure(where, exc, config))
        raise


def _create_isolated(
    config: Mapping[str, Any],
    tier_class: type[AsyncTier],
    options: dict[str, Any],
    where: str,
    position: int,
    layout_fingerprint: str,
    primary_buffer: HostBuffer | None,
) -> AsyncTierManager:
    from tiering.isolation import IsolatedTierManager  # only where asked for

    if primary_buffer is None or primary_buffer.name is None:
        raise ConfigError(
            f"{where}: isolation 'process' needs the primary buffer in named shared memory "
            "(build the spec with a shared_name, or pass primary_buffer)"
        )
    factory = functools.partial(tier_class, **options)
    try:
        pickle.dumps(factory)
    except Exception as exc:
        raise ConfigError(
            f"{where}: isolation 'process' builds the tier in a child process, but "
            f"{tier_class.__name__} and its options do not pickle: {exc}"
        ) from exc
    start = functools.partial(
        IsolatedTierManager,
        factory,
        primary_buffer,
        str(config["type"]),
        layout_fingerprint=layout_fingerprint,
    )
    return _start_manager(start, config, where, position, tier_class)


_TIER_START_NOTE = "kv-tiering: "


def tier_start_failure(exc: BaseException) -> str | None:
    """One line naming the tier whose start raised ``exc``, the cause and the fix; None if
    ``exc`` did not come from starting a tier (see :func:`create_secondary_tier`)."""
    for note in getattr(exc, "__notes__", ()):
        if isinstance(note, str) and note.startswith(_TIER_START_NOTE):
            return note[len(_TIER_START_NOTE) :]
    return None


def _start_failure(where: str, exc: Exception, config: Mapping[str, Any]) -> str:
    """``where``, what went wrong opening the tier, and what to do about it, on one line."""
    cause = " ".join(str(exc).split()) or type(exc).__name__
    if len(cause) > 500:  # a tier's message can quote anything; keep the line readable
        cause = cause[:500] + "..."
    if isinstance(exc, TimeoutError):
        limit = config.get("open_timeout_s", 30.0)
        return (
            f"{where}: did not open within open_timeout_s={limit} s ({cause}); check that "
            "what it connects to is up, or raise open_timeout_s"
        )
    hint = _OS_ERROR_HINTS.get(exc.errno or 0) if isinstance(exc, OSError) else None
    return f"{where}: cannot start: {type(exc).__name__}: {cause}" + (f"; {hint}" if hint else "")


_OS_ERROR_HINTS = {
    errno.ENOSPC: "free space on that filesystem or give the tier a root_dir on another one",
    errno.EDQUOT: "free space within your quota or give the tier a root_dir elsewhere",
    errno.EACCES: "give the tier a path this user may write to",
    errno.EPERM: "give the tier a path this user may write to",
    errno.EROFS: "the filesystem is read-only: give the tier a root_dir on a writable one",
    errno.ENOMEM: "the machine is out of memory: make the tier (or cpu_bytes_to_use) smaller",
}


__all__ = [
    "BUILTIN_TIERS",
    "ENTRY_POINT_GROUP",
    "FRAMEWORK_KEYS",
    "ISOLATION_MODES",
    "check_tier_config",
    "from_vllm_entry",
    "create_secondary_tier",
    "known_tier_types",
    "register_tier_type",
    "resolve_tier_class",
    "tier_options",
    "tier_start_failure",
    "unregister_tier_type",
]
