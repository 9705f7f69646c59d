"""CPU affinity for what runs a tier: its event-loop thread, or its child process.

A tier's threads that share CPUs with the scheduler thread compete with it
for the CPU and its caches even when they hold no GIL (``docs/runtime.md``,
"Pinning", has the engine-step figures: it helped the Redis and fs-threads
tiers there, not io_uring or the memory tier). Which CPUs an engine may spare is the
operator's call, so pinning is an option (the ``cpus`` framework key), never
a default.

``cpus`` is a collection of CPU ids or a string in the kernel's list format
(``"2-5,8"``, as ``taskset -c`` and ``Cpus_allowed_list`` write it). Its
form and that every id is a CPU of this machine are checked before anything
starts (:func:`check_cpus`); that the process's cpuset grants them all is
verified when they are set, and a mask the kernel narrowed is refused, not
used. Both raise :class:`~tiering.core.errors.ConfigError` naming the CPUs.
Threads inherit their creator's affinity, so pinning the loop thread before
the tier opens pins every thread the tier starts from it (worker threads,
``asyncio.to_thread``'s executor, io_uring's kernel workers).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

from tiering.core.errors import ConfigError


def allowed_cpus() -> frozenset[int]:
    """The CPUs the calling thread may run on (empty where the platform cannot tell)."""
    getter = getattr(os, "sched_getaffinity", None)
    return frozenset(getter(0)) if getter is not None else frozenset()


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (the kernel's list format)."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = previous = None
    for cpu in [*ordered, None]:
        if cpu is not None and previous is not None and cpu == previous + 1:
            previous = cpu
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = cpu
    return ",".join(parts)


def _parse_cpu_list(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ConfigError(
                f"cpus: {part.strip()!r} in {text!r} is not a CPU id or a range like '2-5'"
            ) from None
        if low < 0 or high < low:
            raise ConfigError(f"cpus: {part.strip()!r} in {text!r} is not a valid CPU range")
        cpus.update(range(low, high + 1))
    return cpus


def check_cpus(value: object) -> frozenset[int] | None:
    """``value`` as a set of CPU ids, or None for "not pinned".

    Raises :class:`~tiering.core.errors.ConfigError` naming what is wrong: a value
    that is not a list or a list string, a negative or non-integer id, an
    empty set, an id this machine does not have, or a platform without
    ``os.sched_setaffinity``. Whether the process's cpuset grants them is
    known only when they are set (:func:`pin_current_thread`).
    """
    if value is None:
        return None
    if isinstance(value, str):
        cpus = _parse_cpu_list(value)
    elif isinstance(value, (list, tuple, set, frozenset)):
        bad = [c for c in value if not isinstance(c, int) or isinstance(c, bool) or c < 0]
        if bad:
            raise ConfigError(f"cpus must hold CPU ids (ints >= 0), got {bad[0]!r} in {value!r}")
        cpus = set(value)
    else:
        raise ConfigError(f"cpus must be a list of CPU ids or a string like '2-5,8', got {value!r}")
    if not cpus:
        raise ConfigError("cpus must name at least one CPU (leave it out not to pin)")
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("cpus: this platform cannot pin threads (no os.sched_setaffinity)")
    machine = os.cpu_count() or 1
    absent = {cpu for cpu in cpus if cpu >= machine}
    if absent:
        raise ConfigError(
            f"cpus: {format_cpu_list(absent)} not a CPU of this machine "
            f"(it has {format_cpu_list(range(machine))})"
        )
    return frozenset(cpus)


def _pin(tid: int, cpus: frozenset[int]) -> None:
    """Set ``tid``'s affinity (0: the calling thread) and check that all of ``cpus`` took."""
    before = os.sched_getaffinity(tid)
    try:
        os.sched_setaffinity(tid, cpus)
    except OSError as exc:  # EINVAL: none of them is allowed (cpuset) or online
        raise ConfigError(f"cpus: cannot run on {format_cpu_list(cpus)}: {exc}") from exc
    granted = os.sched_getaffinity(tid)
    if granted != cpus:  # the kernel narrows a mask to the cpuset without saying so
        os.sched_setaffinity(tid, before)
        raise ConfigError(
            f"cpus: {format_cpu_list(cpus - granted)} not allowed to this process "
            "(its cpuset or the CPUs online)"
        )


def pin_current_thread(cpus: frozenset[int] | None) -> None:
    """Restrict the calling thread (and the threads it starts from now on) to ``cpus``.

    Raises :class:`~tiering.core.errors.ConfigError` (and leaves the thread as it
    was) if the process may not run on all of them.
    """
    if cpus is not None:
        _pin(0, cpus)


def pin_current_process(cpus: frozenset[int] | None) -> None:
    """Restrict every thread of this process to ``cpus``, and so every thread started later.

    Imports may already have started threads (a BLAS pool, for example), so
    the current thread alone is not enough. Raises as :func:`pin_current_thread`.
    """
    if cpus is None:
        return
    _pin(0, cpus)
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = []
    for tid in threads:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.sched_setaffinity(tid, cpus)


__all__ = [
    "allowed_cpus",
    "check_cpus",
    "format_cpu_list",
    "pin_current_process",
    "pin_current_thread",
]
