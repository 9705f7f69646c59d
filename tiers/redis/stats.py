"""Counters of one Redis tier instance (owned by its loop thread; read anywhere)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class RedisTierStats:
    """What the tier did and what went wrong, since it was opened.

    ``corrupt_blocks`` counts values that failed verification (never served),
    and the ``rejected_*`` counters split them by reason: ``malformed`` (bad
    header, length or format version), ``foreign`` (another key's or layout's
    value), ``checksum`` (payload differs from its checksum), ``unauthenticated``
    (no valid tag of our auth key: written by someone without the key) and
    ``wrong_type`` (not a string); ``rejected_deleted`` counts those the tier
    then deleted from the server (still the same bad value);
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
    rejected_malformed: int = 0
    rejected_foreign: int = 0
    rejected_checksum: int = 0
    rejected_unauthenticated: int = 0
    rejected_wrong_type: int = 0
    rejected_deleted: int = 0
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
