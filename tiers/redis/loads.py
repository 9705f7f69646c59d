"""Loads of the Redis tier: each value verified as its reply is parsed, then sorted.

The tier installs a redis-py response callback for ``GET``/``GETEX`` that
hands each reply of a load to :func:`load_reply`: the value is verified
(header, fingerprint, key, length, checksum or tag) and copied into its
destination row while it is still hot in cache, then dropped, so a pipeline
never holds more than one value; the header it served is remembered for a
later delete. :class:`LoadOutcomes` sorts what a batch's replies came to
(loaded, vanished, rejected, failed) and counts it in the tier's stats. The
round trips themselves and what is done about rejected values (deletes) are
elsewhere. Loop-thread code of one tier.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tiering.core.errors import BlockNotFound
from tiering.core.keys import OffloadKey
from tiers.redis.errors import RejectedValue
from tiers.redis.layout import BlockLayout
from tiers.redis.rejections import RejectionLog
from tiers.redis.stats import RedisTierStats

#: What :func:`load_reply` returns for a block verified and copied into place.
LOADED = object()


class Load(NamedTuple):
    """One block a pipeline loads: its key and the destination row."""

    key: OffloadKey
    into: memoryview
    live: list[bool]  # [False] once the round trip that queued it has ended


def load_reply(
    layout: BlockLayout,
    served_headers: MutableMapping[OffloadKey, bytes],
    load: Load,
    response: Any,
) -> Any:
    """Verify the value ``response`` loaded for ``load`` and copy it into place.

    Never raises (an error in a response callback would abandon the rest of
    the pipeline's replies): returns :data:`LOADED`, or the exception for
    that key. A verified value's header is kept in ``served_headers``.
    """
    if not load.live[0]:
        return RuntimeError("the load this reply belongs to has ended")
    if response is None:
        return BlockNotFound(load.key)
    try:
        layout.decode_into(load.key, response, load.into)
    except RejectedValue as exc:
        # Identifies this exact value, so the delete spares a rewrite landing later.
        exc.value_sha1 = hashlib.sha1(response, usedforsecurity=False).hexdigest()
        return exc
    except Exception as exc:
        return exc
    served_headers[load.key] = response[: layout.header_len]
    return LOADED


@dataclass
class LoadOutcomes:
    """What the replies of one ``read_many`` came to, key by key."""

    succeeded: list[bytes] = field(default_factory=list)
    errors: dict[bytes, BaseException] = field(default_factory=dict)
    gone: list[OffloadKey] = field(default_factory=list)  # vanished from the server
    corrupt: list[RejectedValue] = field(default_factory=list)  # failed verification

    def fail(self, keys: Sequence[OffloadKey], error: BaseException) -> None:
        """Every key of a round trip that failed as a whole fails with its error."""
        self.errors.update(dict.fromkeys(keys, error))

    def sort(
        self,
        key: OffloadKey,
        reply: Any,
        translate: Callable[[BaseException, str, OffloadKey], BaseException],
    ) -> None:
        """File ``key``'s reply; other errors are ``translate``d as the tier's own."""
        if reply is LOADED:
            self.succeeded.append(key)
        elif isinstance(reply, BlockNotFound):
            self.gone.append(key)
            self.errors[key] = reply
        elif isinstance(reply, RejectedValue):
            self.corrupt.append(reply)
            self.errors[key] = reply
        elif isinstance(reply, BaseException) and str(reply).startswith("WRONGTYPE"):
            rejected = RejectedValue(key, "wrong_type", "the key holds a non-string value")
            self.corrupt.append(rejected)
            self.errors[key] = rejected
        elif isinstance(reply, BaseException):
            self.errors[key] = translate(reply, "GET", key)
        else:
            self.errors[key] = RuntimeError(f"unexpected reply to GET: {type(reply).__name__}")

    def count(self, stats: RedisTierStats, block_bytes: int, log: RejectionLog | None) -> None:
        """Add these outcomes to ``stats``; each rejected value is counted by reason and logged."""
        stats.blocks_read += len(self.succeeded)
        stats.bytes_read += len(self.succeeded) * block_bytes
        stats.read_failures += len(self.errors)
        stats.vanished_blocks += len(self.gone)
        if not self.corrupt:
            return
        stats.corrupt_blocks += len(self.corrupt)
        for value in self.corrupt:
            counter = f"rejected_{value.kind}"
            setattr(stats, counter, getattr(stats, counter) + 1)
            if log is not None:
                log.note(value)
