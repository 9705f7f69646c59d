"""The runtime's options: their defaults, their checks, and the primary view's geometry.

Both scheduler-side transports (:class:`~tiering.runtime.AsyncTierManager`,
the tier on a loop thread of this process, and
:class:`~tiering.isolation.IsolatedTierManager`, the tier in a child process)
take the same keyword options; this module owns what they mean once:
:class:`RuntimeOptions` (the keywords, for ``**options``),
:func:`check_runtime_options` (a tier entry's framework keys, checked without
building anything, also used by the registry) and :func:`primary_geometry`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TypedDict

from tiering.core.errors import ConfigError
from tiering.runtime.affinity import check_cpus
from tiering.runtime.gil_handoff import DEFAULT_MAX_GIL_HOLD_S
from tiering.support.quoting import shown

#: ``max_gil_hold_ms``'s default.
DEFAULT_MAX_GIL_HOLD_MS = DEFAULT_MAX_GIL_HOLD_S * 1e3


class RuntimeOptions(TypedDict, total=False):
    """The keyword options every runtime transport takes (meanings: ``AsyncTierManager``)."""

    name: str | None
    layout_fingerprint: str
    job_timeout_s: float
    open_timeout_s: float
    shutdown_timeout_s: float
    cancel_grace_s: float
    shared_absent_ttl_s: float
    shared_present_ttl_s: float
    shared_max_known_keys: int
    max_events: int
    verify: bool | None
    failed_load_backoff_s: float
    cpus: Collection[int] | str | None
    max_gil_hold_ms: float | None
    gc_handoff: bool


#: Every option's default.
RUNTIME_DEFAULTS: RuntimeOptions = {
    "name": None,
    "layout_fingerprint": "",
    "job_timeout_s": 30.0,
    "open_timeout_s": 30.0,
    "shutdown_timeout_s": 10.0,
    "cancel_grace_s": 1.0,
    "shared_absent_ttl_s": 5.0,
    "shared_present_ttl_s": 60.0,
    "shared_max_known_keys": 1_000_000,
    "max_events": 100_000,
    "verify": None,
    "failed_load_backoff_s": 0.0,
    "cpus": None,
    "max_gil_hold_ms": DEFAULT_MAX_GIL_HOLD_MS,
    "gc_handoff": True,
}
#: The options :func:`check_runtime_options` checks (the others name, not configure).
_CHECKED = frozenset(RUNTIME_DEFAULTS) - {"name", "layout_fingerprint"}


#: The longest timeout or time-to-live a runtime option may be: a week.
MAX_SECONDS = 7 * 24 * 3600.0


def check_runtime_options(**options: object) -> None:
    """Check the runtime's options (a tier entry's framework keys) without building anything.

    Any of :class:`RuntimeOptions` but ``name`` and ``layout_fingerprint``; those left out
    take :data:`RUNTIME_DEFAULTS`. Raises :class:`~tiering.core.errors.ConfigError` naming
    the first bad one (``TypeError`` for a keyword that is not an option).
    """
    unknown = sorted(set(options) - _CHECKED)
    if unknown:
        raise TypeError(f"check_runtime_options() got unexpected options {unknown}")
    merged: dict[str, object] = {**RUNTIME_DEFAULTS, **options}
    job_timeout_s, open_timeout_s = merged["job_timeout_s"], merged["open_timeout_s"]
    shutdown_timeout_s, cancel_grace_s = merged["shutdown_timeout_s"], merged["cancel_grace_s"]
    shared_absent_ttl_s = merged["shared_absent_ttl_s"]
    shared_present_ttl_s = merged["shared_present_ttl_s"]
    shared_max_known_keys, max_events = merged["shared_max_known_keys"], merged["max_events"]
    verify, failed_load_backoff_s = merged["verify"], merged["failed_load_backoff_s"]
    cpus, max_gil_hold_ms = merged["cpus"], merged["max_gil_hold_ms"]
    gc_handoff = merged["gc_handoff"]
    for option, value in (
        ("job_timeout_s", job_timeout_s),
        ("open_timeout_s", open_timeout_s),
        ("shutdown_timeout_s", shutdown_timeout_s),
        ("cancel_grace_s", cancel_grace_s),
        ("shared_absent_ttl_s", shared_absent_ttl_s),
        ("shared_present_ttl_s", shared_present_ttl_s),
    ):
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not 0 < value <= MAX_SECONDS
        ):
            # Finite and bounded: deadlines are loop times (inf never returns, 1e10 overflows).
            raise ConfigError(
                f"{option} must be a positive number of seconds up to {MAX_SECONDS:g} "
                f"(a week), got {shown(value)}"
            )
    if (
        not isinstance(failed_load_backoff_s, (int, float))
        or isinstance(failed_load_backoff_s, bool)
        or not failed_load_backoff_s >= 0
    ):
        raise ConfigError(
            f"failed_load_backoff_s must be a number of seconds >= 0, got {failed_load_backoff_s!r}"
        )
    if verify is not None and not isinstance(verify, bool):
        raise ConfigError(f"verify must be true, false or null, got {verify!r}")
    if not isinstance(gc_handoff, bool):
        raise ConfigError(f"gc_handoff must be true or false, got {gc_handoff!r}")
    if (
        not isinstance(shared_max_known_keys, int)
        or isinstance(shared_max_known_keys, bool)
        or shared_max_known_keys < 1
    ):
        raise ConfigError(
            f"shared_max_known_keys must be a positive int, got {shared_max_known_keys!r}"
        )
    if not isinstance(max_events, int) or isinstance(max_events, bool) or max_events < 0:
        raise ConfigError(f"max_events must be a non-negative int, got {max_events!r}")
    if max_gil_hold_ms is not None and (
        not isinstance(max_gil_hold_ms, (int, float))
        or isinstance(max_gil_hold_ms, bool)
        or not 0 < max_gil_hold_ms < float("inf")
    ):
        raise ConfigError(
            "max_gil_hold_ms must be a positive number of milliseconds or null (off), "
            f"got {max_gil_hold_ms!r}"
        )
    check_cpus(cpus)


def primary_geometry(view: memoryview, block_bytes: int | None) -> tuple[memoryview, int, int]:
    """The primary view as flat writable bytes, its number of rows and the row size."""
    if not isinstance(view, memoryview):
        raise TypeError(f"primary_kv_view must be a memoryview, not {type(view).__name__}")
    if view.readonly:
        raise ConfigError("primary_kv_view must be writable (loads write into it)")
    if not view.c_contiguous:
        raise ConfigError("primary_kv_view must be C-contiguous")
    flat = view.cast("B") if view.ndim != 1 or view.format != "B" else view[:]
    if block_bytes is None:
        if view.ndim < 2 or view.shape is None or view.shape[0] == 0:
            flat.release()
            raise ConfigError(
                "primary_kv_view must be 2-D (num_blocks, block_bytes) or block_bytes given"
            )
        rows = view.shape[0]
        size = view.nbytes // rows
    else:
        if block_bytes <= 0 or view.nbytes % block_bytes:
            flat.release()
            raise ConfigError(
                f"block_bytes={block_bytes} does not divide the primary view's {view.nbytes} bytes"
            )
        size = block_bytes
        rows = view.nbytes // block_bytes
    if size <= 0:
        flat.release()
        raise ConfigError("primary_kv_view rows are empty")
    return flat, rows, size


def resolved_options(options: RuntimeOptions) -> RuntimeOptions:
    """``options`` over :data:`RUNTIME_DEFAULTS`, checked (``ConfigError`` naming the first
    bad one): every key present."""
    naming = ("name", "layout_fingerprint")
    check_runtime_options(**{k: v for k, v in options.items() if k not in naming})
    return {**RUNTIME_DEFAULTS, **options}
