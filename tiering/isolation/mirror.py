"""The lookup view across processes: the child records each change, the parent replays them.

In the tier's process the service publishes what ``lookup`` reads
(``present``, ``unsettled``, ``absent_at``; see
:mod:`tiering.runtime.service`). Here those containers are replaced by
recording ones that append every change, in order, to one change log; the
child ships the log with the results it covers, and the parent applies it
to plain containers its scheduler thread owns. A result therefore never
arrives before the presence change it implies, as in one process.

A recording container fails loudly on a mutation it does not record (so a
service change that uses one cannot silently desynchronise the mirror).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from tiering.core.keys import OffloadKey
from tiering.runtime.presence import KnownPresent

PRESENT_ADD = 0
PRESENT_DROP = 1
UNSETTLED_ADD = 2
UNSETTLED_DROP = 3
ABSENT_SET = 4
ABSENT_DROP = 5

#: One change: (code, key, time) - the time only matters for ABSENT_SET.
Change = tuple[int, OffloadKey, float]


class ChangeLog:
    """The child's ordered log of changes and its "something to ship" signal."""

    def __init__(self, on_dirty: Callable[[], None]) -> None:
        self.changes: list[Change] = []
        self.on_dirty = on_dirty

    def record(self, code: int, key: OffloadKey, when: float = 0.0) -> None:
        self.changes.append((code, key, when))
        self.on_dirty()

    def take(self, limit: int) -> list[Change]:
        changes = self.changes
        if len(changes) <= limit:
            self.changes = []
            return changes
        head, self.changes = changes[:limit], changes[limit:]
        return head


class RecordingPresent(KnownPresent):
    """``KnownPresent`` that logs each key learnt and forgotten."""

    __slots__ = ("_log",)

    def __init__(self, log: ChangeLog, **options: Any) -> None:
        super().__init__(**options)
        self._log = log

    def add(self, key: OffloadKey) -> list[OffloadKey]:
        forgotten = super().add(key)
        self._log.record(PRESENT_ADD, key)
        for old in forgotten:
            self._log.record(PRESENT_DROP, old)
        return forgotten

    def add_many(self, keys: Iterable[OffloadKey]) -> None:
        # One add (and one record) per key: the blocks a tier recovers at open. Not the
        # base class's bulk update, which the scheduler's mirror would never hear of.
        for key in keys:
            self.add(key)

    def discard(self, key: OffloadKey) -> None:
        if key in self:
            super().discard(key)
            self._log.record(PRESENT_DROP, key)

    def expire(self) -> list[OffloadKey]:
        forgotten = super().expire()
        for old in forgotten:
            self._log.record(PRESENT_DROP, old)
        return forgotten


def _unrecorded(*_: object, **__: object) -> NoReturn:
    raise NotImplementedError("this mutation is not mirrored to the scheduler's process")


class RecordingKeys(set[OffloadKey]):
    """The ``unsettled`` set, logging ``add`` and ``discard`` (the only mutations allowed)."""

    def __init__(self, log: ChangeLog) -> None:
        super().__init__()
        self._log = log

    def add(self, key: OffloadKey) -> None:
        if key not in self:
            super().add(key)
            self._log.record(UNSETTLED_ADD, key)

    def discard(self, key: object) -> None:
        if key in self:
            super().discard(key)
            self._log.record(UNSETTLED_DROP, key)  # type: ignore[arg-type]  # a key: it was in

    remove = pop = clear = update = difference_update = intersection_update = _unrecorded
    symmetric_difference_update = __ior__ = __iand__ = __isub__ = __ixor__ = _unrecorded


class RecordingTimes(dict[OffloadKey, float]):
    """The ``absent_at`` dict, logging sets and deletions (``pop``, ``del``, ``[k] = t``)."""

    def __init__(self, log: ChangeLog) -> None:
        super().__init__()
        self._log = log

    def __setitem__(self, key: OffloadKey, when: float) -> None:
        super().__setitem__(key, when)
        self._log.record(ABSENT_SET, key, when)

    def __delitem__(self, key: OffloadKey) -> None:
        super().__delitem__(key)
        self._log.record(ABSENT_DROP, key)

    def pop(self, key: OffloadKey, *default: Any) -> Any:
        if key in self:
            self._log.record(ABSENT_DROP, key)
        return super().pop(key, *default)

    popitem = clear = setdefault = update = __ior__ = _unrecorded


class SignallingDeque(deque[Any]):
    """A deque that signals when something is appended (the events the child ships)."""

    def __init__(self, on_append: Callable[[], None]) -> None:
        super().__init__()
        self._on_append = on_append

    def append(self, item: Any) -> None:
        super().append(item)
        self._on_append()


class Mirror:
    """The parent's copy of the lookup view (its scheduler thread is the only writer)."""

    def __init__(self) -> None:
        self.present: dict[OffloadKey, None] = {}
        self.unsettled: set[OffloadKey] = set()
        self.absent_at: dict[OffloadKey, float] = {}

    def apply(self, changes: Iterable[Change]) -> None:
        present, unsettled, absent_at = self.present, self.unsettled, self.absent_at
        for code, key, when in changes:
            if code == PRESENT_ADD:
                present[key] = None
            elif code == PRESENT_DROP:
                present.pop(key, None)
            elif code == UNSETTLED_ADD:
                unsettled.add(key)
            elif code == UNSETTLED_DROP:
                unsettled.discard(key)
            elif code == ABSENT_SET:
                absent_at[key] = when
            else:
                absent_at.pop(key, None)

    def forget_everything(self) -> None:
        """The tier's process is gone: nothing is known present any more (never a wrong hit)."""
        self.present.clear()
        self.unsettled.clear()
        self.absent_at.clear()
