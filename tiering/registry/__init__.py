"""Secondary tiers from config dicts ``{"type": ..., **options}`` (the seed's ``secondary_tiers``).

This module owns building and starting the tier an entry describes
(:func:`create_secondary_tier`: on a loop thread of this process, or in a child
process) and the one-line note naming a tier that failed to start
(:func:`tier_start_failure`). Which class a ``type`` names is resolved in
:mod:`tiering.registry.types`, and an entry is checked in :mod:`tiering.registry.entries`;
their public names are importable from here as well.

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
:class:`~tiering.core.errors.ConfigError` naming the tier's position in the list,
its type and the offending key, and listing what is accepted.
"""

from __future__ import annotations

import errno
import functools
import pickle
from collections.abc import Callable, Mapping
from typing import Any

from tiering.core.errors import ConfigError
from tiering.primary.host_buffer import HostBuffer
from tiering.registry.entries import (
    FRAMEWORK_KEYS,
    ISOLATION_MODES,
    MANAGER_OPTIONS,
    check_tier_config,
    from_vllm_entry,
    tier_identity,
    tier_options,
)
from tiering.registry.types import (
    BUILTIN_TIERS,
    ENTRY_POINT_GROUP,
    known_tier_types,
    register_tier_type,
    resolve_tier_class,
    unregister_tier_type,
)
from tiering.runtime import AsyncTierManager
from tiering.tier import AsyncTier


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
    Configuration mistakes raise :class:`~tiering.core.errors.ConfigError` naming
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


def _start_manager(
    start: Callable[..., AsyncTierManager],
    config: Mapping[str, Any],
    where: str,
    position: int,
    tier_class: type[AsyncTier],
) -> AsyncTierManager:
    """``start(name=..., **the entry's framework options)``; its errors name the entry."""
    manager_options = {k: config[k] for k in MANAGER_OPTIONS if k in config}
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
    "tier_identity",
    "tier_options",
    "tier_start_failure",
    "unregister_tier_type",
]
