"""How much memory this host can give the CPU primary tier, checked before it is allocated.

This module owns the host-memory checks of the config: :func:`host_memory` reads
what the machine (``MemAvailable`` in ``/proc/meminfo``) or its container (cgroup
v2 ``memory.max``) can still give, and :func:`check_host_memory` refuses a
buffer larger than that, or a shared buffer larger than what is free in
``/dev/shm``, with a :class:`~tiering.core.errors.ConfigError` naming the key and the
fix instead of an ENOMEM after a traceback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tiering.core.errors import ConfigError
from tiering.primary.host_buffer import SHM_DIR  # where POSIX shared memory lives (its own tmpfs)
from tiering.support.units import format_bytes


@dataclass(frozen=True, slots=True)
class HostMemory:
    """Memory this process can still take: ``available_bytes`` of ``total_bytes``,
    ``source`` saying where the figure comes from (for messages)."""

    available_bytes: int
    total_bytes: int
    source: str


def host_memory() -> HostMemory | None:
    """What this machine (or its cgroup, if that is tighter) has available; None if unknown.

    Linux's ``MemAvailable`` counts free memory plus what the kernel can reclaim
    (page cache), which is what a new buffer can be given without swapping; a
    container's ``memory.max`` (cgroup v2) caps it further.
    """
    meminfo = _read_meminfo()
    if meminfo is None:
        return None
    available, total = meminfo
    memory = HostMemory(available, total, "MemAvailable in /proc/meminfo")
    limit = _cgroup_limit()
    if limit is not None:
        cgroup_max, cgroup_used = limit
        if cgroup_max - cgroup_used < memory.available_bytes:
            memory = HostMemory(
                max(0, cgroup_max - cgroup_used), cgroup_max, "this container's cgroup memory.max"
            )
    return memory


def _read_meminfo() -> tuple[int, int] | None:
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    fields[name] = int(parts[0]) * 1024  # the file says kB, meaning KiB
    except (OSError, ValueError):
        return None
    if "MemAvailable" not in fields or "MemTotal" not in fields:
        return None
    return fields["MemAvailable"], fields["MemTotal"]


def _cgroup_limit() -> tuple[int, int] | None:
    try:
        with open("/proc/self/cgroup", encoding="ascii") as cgroup:
            relative = next((line.strip()[3:] for line in cgroup if line.startswith("0::")), None)
        if relative is None:
            return None
        base = "/sys/fs/cgroup" + relative.rstrip("/")
        with open(base + "/memory.max", encoding="ascii") as limit_file:
            limit = limit_file.read().strip()
        if limit == "max":
            return None
        with open(base + "/memory.current", encoding="ascii") as current_file:
            current = int(current_file.read().strip())
        return int(limit), current
    except (OSError, ValueError):
        return None


def check_host_memory(
    key: str,
    asked_bytes: int,
    memory: HostMemory | None = None,
    *,
    shared: bool = False,
    shm_free_bytes: int | None = None,
) -> None:
    """Raise :class:`ConfigError` naming ``key`` if ``asked_bytes`` is more than the host has
    available, before anything is allocated (an allocation that size would fail with ENOMEM
    after a traceback, or get the process killed later).

    With ``shared`` the buffer is a POSIX shared-memory object, which must also fit in
    ``/dev/shm`` (a container's is often 64 MiB unless ``--shm-size`` says otherwise).
    ``memory`` and ``shm_free_bytes`` override what the machine says (for tests).
    """
    memory = memory if memory is not None else host_memory()
    if memory is not None and asked_bytes > memory.available_bytes:
        raise ConfigError(
            f"{key}={format_bytes(asked_bytes)} ({asked_bytes} bytes) is more memory than this "
            f"machine has available: {format_bytes(memory.available_bytes)} available of "
            f"{format_bytes(memory.total_bytes)} ({memory.source}); lower {key} to fit "
            "(the CPU primary tier allocates all of it up front)"
        )
    if not shared:
        return
    if shm_free_bytes is None:
        try:
            shm = os.statvfs(SHM_DIR)
        except OSError:
            return
        shm_free_bytes = shm.f_bavail * shm.f_frsize
    if asked_bytes > shm_free_bytes:
        raise ConfigError(
            f"{key}={format_bytes(asked_bytes)} ({asked_bytes} bytes) does not fit in "
            f"{SHM_DIR}, where the primary buffer is shared with the engine's workers: "
            f"{format_bytes(shm_free_bytes)} free there; enlarge it (docker run --shm-size, "
            f"a Kubernetes emptyDir with medium: Memory) or lower {key}"
        )
