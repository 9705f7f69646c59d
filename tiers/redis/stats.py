"""Counters of one Redis tier instance (owned by its loop thread; read anywhere)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class RedisTierStats:
    """What the tier did and what went wrong, since it was opened.

    ``corrupt_blocks`` counts values that failed verification (never served);
    ``vanished_blocks`` counts loads of keys that were gone (evicted by the
    server, expired or deleted by another engine); ``refused_while_down`` counts
    operations failed at once because the server was known to be unreachable.
    """

    blocks_written: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    write_failures: int = 0
    read_failures: int = 0
    corrupt_blocks: int = 0
    vanished_blocks: int = 0
    out_of_memory_rejections: int = 0
    timeouts: int = 0
    unreachable_errors: int = 0
    refused_while_down: int = 0
    outages: int = 0
    recoveries: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for logs and metrics exporters)."""
        return asdict(self)
