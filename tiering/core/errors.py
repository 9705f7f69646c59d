"""Exceptions raised by the framework and by tiers.

Every error the framework raises at a point of misuse derives from
:class:`TieringError`, so an embedder can catch the whole family at once while
tests can assert on the precise type.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


class TieringError(Exception):
    """Base class of every error raised by this package."""


class ConfigError(TieringError, ValueError):
    """A configuration value is missing, unknown or out of range.

    Raised at construction, never at first use. The message names the key (and,
    for secondary tiers, the tier's position and type) and what is accepted.
    """


class ContractError(TieringError, ValueError):
    """A caller broke the scheduler-facing contract.

    Examples: loading keys that are not stored, completing a store that was not
    prepared, submitting a job id twice. The callee's state is unchanged.
    """


class BlockNotFound(TieringError, KeyError):
    """The requested block is not held by the tier.

    ``AsyncTier.read`` raises it for a missing key; the framework turns it into
    a failed job (a miss), never a wrong hit.
    """

    def __init__(self, key: bytes) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"block {self.key.hex()} is not in this tier"


class CorruptBlock(TieringError):
    """A block's bytes failed verification (checksum, length or header).

    Tiers raise it from ``read`` instead of serving the bytes; the framework
    counts it and treats the block as missing.
    """

    def __init__(self, key: bytes, reason: str) -> None:
        super().__init__(f"block {key.hex()} is corrupt: {reason}")
        self.key = key
        self.reason = reason


class TierClosedError(TieringError, RuntimeError):
    """The tier or facade was shut down; no further calls are accepted."""


class PartialBatchError(TieringError):
    """Some operations of a batch failed.

    ``succeeded`` holds the keys whose operation completed; ``errors`` maps each
    failed key to its exception. Raised by the batch forms of ``AsyncTier``.
    """

    def __init__(
        self,
        succeeded: Collection[bytes],
        errors: Mapping[bytes, BaseException],
    ) -> None:
        first = next(iter(errors.values()), None)
        super().__init__(
            f"{len(errors)} of {len(succeeded) + len(errors)} block operations failed"
            + (f"; first: {first!r}" if first is not None else "")
        )
        self.succeeded = frozenset(succeeded)
        self.errors = dict(errors)
