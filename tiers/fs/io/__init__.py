"""I/O backends of the filesystem tier: io_uring on the loop, or a thread pool."""

from __future__ import annotations

import asyncio
import logging

from tiering.errors import ConfigError
from tiers.fs.io.backend import IoBackend
from tiers.fs.io.ops import IoOp, OpKind, Priority
from tiers.fs.io.threads import ThreadBackend
from tiers.fs.io.uring import UringBackend, uring_unavailable_reason

logger = logging.getLogger(__name__)


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

    "auto" picks io_uring for O_DIRECT files where the kernel and the
    ``liburing`` package allow it, and the thread pool otherwise (logged).
    Buffered files get the thread pool: io_uring punts buffered writes to
    kernel workers that contend on the file (0.16 GB/s for 64 KiB blocks
    here) and completes page-cache reads inside the submit call, holding the
    GIL. "uring" where it is not available raises :class:`ConfigError`.
    """
    if name == "uring" or (name == "auto" and direct_io):
        reason = uring_unavailable_reason()
        if reason is None:
            return UringBackend(loop, queue_depth)
        if name == "uring":
            raise ConfigError(f"fs tier: io_backend='uring' is not available here: {reason}")
        logger.info("fs tier: io_uring unavailable (%s); using the thread backend", reason)
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
