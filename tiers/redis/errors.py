"""Errors the Redis tier raises, each naming the server and what went wrong."""

from __future__ import annotations

from tiering.errors import TieringError


class RedisTierUnavailable(TieringError, ConnectionError):
    """The Redis server cannot be reached (down, refusing, timing out, restarting).

    Raised by ``open`` when ``on_start_unreachable="fail"``, and by every
    operation while the tier waits to retry the connection; those operations
    fail at once instead of each waiting out a timeout.
    """


class RedisTierTimeout(TieringError, TimeoutError):
    """An operation got no complete answer within ``op_timeout_s``."""


class RedisTierCommandError(TieringError):
    """The server refused a command (``OOM`` under ``maxmemory``, ``READONLY``, ...)."""

    def __init__(self, message: str, *, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory
