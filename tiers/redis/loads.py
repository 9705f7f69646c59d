"""Loads of the Redis tier: each value verified as its reply is parsed, then sorted.

The tier installs a redis-py response callback for ``GET``/``GETEX`` that
hands each reply of a load to :func:`load_reply`: the value is verified
(header, fingerprint, key, length, checksum or tag) and copied into its
destination row while it is still hot in cache, then dropped, so a pipeline
never holds more than one value (handed to the hashing threads: those not
verified yet, at most one round trip's); the header it served is remembered for a
later delete. With an auth key and a chunk of at least ``OFFLOAD_MIN_BYTES``
(on a machine with ``OFFLOAD_MIN_CPUS`` CPUs or more),
the callback hands the values to the hashing threads of
:mod:`tiering.tier.auth` instead (:class:`ChunkChecks`, about
``OFFLOAD_SLICE_BYTES`` at a time): tags are verified and bytes copied there
while the loop parses the next replies, and the tier waits for every one of
them before the load returns (cancelled or not).
:class:`LoadOutcomes` sorts what a batch's replies came to
(loaded, vanished, rejected, failed) and counts it in the tier's stats. The
round trips themselves and what is done about rejected values (deletes) are
elsewhere. Loop-thread code of one tier.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tiering.core.errors import BlockNotFound
from tiering.core.keys import OffloadKey
from tiering.tier import auth as _auth
from tiering.tier.auth import OffLoopWork
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
    #: Where its value is verified and copied (the hashing threads), or None: right away.
    checks: ChunkChecks | None = None


class CheckedLoad:
    """A reply handed to the hashing threads: what it came to once its checks have waited.

    Until a hashing thread has verified and copied the value, ``outcome`` is
    an error (never a hit): a check that did not run to its end fails its key.
    """

    __slots__ = ("header", "outcome")

    def __init__(self) -> None:
        self.outcome: Any = RuntimeError("the loaded value was not verified")
        self.header: bytes | None = None


class ChunkChecks:
    """The values of one round trip's replies on their way to the hashing threads.

    Replies are held until about ``OFFLOAD_SLICE_BYTES`` have arrived, then
    handed over together (one hand-over per slice, not per block). Loop-thread
    object; :meth:`finish` must be awaited before the round trip's loads end.
    """

    __slots__ = ("_held", "_held_bytes", "_layout", "_work")

    def __init__(self, layout: BlockLayout) -> None:
        self._layout = layout
        self._work = OffLoopWork()
        self._held: list[tuple[Load, Any, CheckedLoad]] = []
        self._held_bytes = 0

    def add(self, load: Load, response: Any) -> CheckedLoad:
        checked = CheckedLoad()
        self._held.append((load, response, checked))
        self._held_bytes += len(response)
        if self._held_bytes >= _auth.OFFLOAD_SLICE_BYTES:
            self._hand_over()
        return checked

    def _hand_over(self) -> None:
        held, self._held, self._held_bytes = self._held, [], 0
        if held:
            self._work.submit(functools.partial(_check_slice, self._layout, held))

    async def finish(self, complete: bool) -> None:
        """Hand over the replies still held (``complete``: the round trip succeeded; else
        they stay unverified, failures) and wait until no hashing thread touches a
        destination row any more. Cancellation: as :meth:`OffLoopWork.wait`."""
        if complete:
            self._hand_over()
        else:
            self._held, self._held_bytes = [], 0
        # Every reply is parsed: the loop has nothing else to do for these loads, so it
        # takes its share of what no hashing thread has started.
        await self._work.wait(help=complete)


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
    if load.checks is not None:
        return load.checks.add(load, response)
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


def _check_slice(layout: BlockLayout, held: list[tuple[Load, Any, CheckedLoad]]) -> None:
    """Verify replies and copy them into place (a hashing thread: touches only these loads)."""
    for load, response, checked in held:
        _check_off_loop(layout, load, response, checked)


def _check_off_loop(layout: BlockLayout, load: Load, response: Any, into: CheckedLoad) -> None:
    """Verify ``response`` and copy it into place (a hashing thread)."""
    outcome: Any
    try:
        layout.decode_into(load.key, response, load.into)
    except RejectedValue as exc:
        exc.value_sha1 = hashlib.sha1(response, usedforsecurity=False).hexdigest()
        outcome = exc
    except Exception as exc:
        outcome = exc
    else:
        into.header = response[: layout.header_len]
        outcome = LOADED
    into.outcome = outcome


def settle_checked(
    served_headers: MutableMapping[OffloadKey, bytes], key: OffloadKey, reply: Any
) -> Any:
    """The outcome of ``reply`` (a :class:`CheckedLoad` once its checks have waited, or any
    other reply as it is); a verified value's header is kept in ``served_headers``."""
    if type(reply) is not CheckedLoad:
        return reply
    if reply.outcome is LOADED and reply.header is not None:
        served_headers[key] = reply.header
    return reply.outcome


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
