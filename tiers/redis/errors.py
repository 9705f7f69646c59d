"""Errors the Redis tier raises, each naming the server and what went wrong."""

from __future__ import annotations

from tiering.core.errors import CorruptBlock, TieringError


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


class RejectedValue(CorruptBlock):
    """A stored value failed verification; never served, deleted from the store.

    ``kind`` is the reason class the tier counts (``malformed``, ``foreign``,
    ``checksum``, ``unauthenticated``, ``wrong_type``).
    """

    def __init__(self, key: bytes, kind: str, reason: str) -> None:
        super().__init__(key, reason)
        self.kind = kind
        #: SHA-1 (hex) of the rejected value, so only that same value is deleted.
        self.value_sha1: str | None = None
