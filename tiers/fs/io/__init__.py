"""I/O backends of the filesystem tier: io_uring on the loop, or a thread pool."""

from __future__ import annotations

import asyncio
import logging

from tiering.core.errors import ConfigError
from tiers.fs.io.backend import IoBackend
from tiers.fs.io.ops import IoOp, OpKind, Priority
from tiers.fs.io.threads import ThreadBackend
from tiers.fs.io.uring import UringBackend, uring_unavailable_reason

logger = logging.getLogger(__name__)


_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        logger.warning(
            "fs tier: io_uring is not usable here (%s); using the thread backend", reason
        )


def make_backend(
    name: str,
    loop: asyncio.AbstractEventLoop,
    *,
    queue_depth: int,
    n_read_threads: int,
    n_write_threads: int,
    direct_io: bool = True,
) -> IoBackend:
    """Build the backend called ``name`` ("auto", "uring" or "threads").

    "auto" picks io_uring for O_DIRECT files where it passed its probe (see
    :func:`uring_unavailable_reason`) and the thread pool otherwise, with one
    WARNING per process saying why. Buffered files get the thread pool:
    io_uring punts buffered writes to kernel workers that contend on the file
    (0.16 GB/s for 64 KiB blocks here) and completes page-cache reads inside
    the submit call. "uring" where it is not available raises
    :class:`ConfigError` naming the reason. A ring that fails to start after a
    good probe (a seccomp profile, a container without io_uring) falls back too
    under "auto".
    """
    if name == "uring" or (name == "auto" and direct_io):
        reason = uring_unavailable_reason()
        if reason is None:
            try:
                return UringBackend(loop, queue_depth)
            except OSError as exc:
                reason = f"the ring failed to start: {exc.strerror or exc}"
        if name == "uring":
            raise ConfigError(f"fs tier: io_backend='uring' is not available here: {reason}")
        _warn_once(reason)
    return ThreadBackend(loop, n_read_threads, n_write_threads)


__all__ = [
    "IoBackend",
    "IoOp",
    "OpKind",
    "Priority",
    "ThreadBackend",
    "UringBackend",
    "make_backend",
    "uring_unavailable_reason",
]
