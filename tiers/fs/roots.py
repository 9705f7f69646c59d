"""The roots of a striped fs tier: where each block is, which roots serve, and failing roots.

A tier with ``root_dirs`` keeps one :class:`Root` per directory, each with its
own files, journal, I/O backend, O_DIRECT probe and deletion watch (its own
:class:`~tiers.fs.state.OpenState`, opened exactly as a tier of one root
opens). :class:`RootSet` owns them, on the tier's loop thread:

* **where a block is**: lookups ask every root in service (:meth:`RootSet.holder`);
* **where a new block goes**: the root that holds the key already, else the
  best live root by weighted rendezvous hashing (:mod:`tiers.fs.placement`);
* **a failing root** (every block of :data:`FAILED_CALLS_LIMIT` calls in a row
  failing with an I/O error, or its deletion watch refusing stores: the
  directory deleted, files that cannot be created again) is taken out of
  service: one ERROR line, ``stats.roots_out_of_service`` and
  ``stats.root_failures``, its blocks reported removed. The tier goes on
  with the others; stores that were meant for it go to the next live root.
  Its files are closed once the calls still running on it have returned.
* **a root coming back**: every :data:`PROBE_INTERVAL_S`, each root out of
  service is opened again; once that works it serves again, empty (its blocks
  were reported removed), with one WARNING line.

A tier of one root never takes its root out of service: it behaves as it
always did (docs/fs-tier.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from tiering.core.errors import BlockNotFound, CorruptBlock, TierClosedError
from tiering.core.keys import OffloadKey
from tiers.fs.config import FsTierConfig
from tiers.fs.errors import TierFullError
from tiers.fs.lifecycle import stop_open_state
from tiers.fs.placement import place, root_seed
from tiers.fs.records import encode_del
from tiers.fs.state import FsTierStats, OpenState, notify_room

logger = logging.getLogger(__name__)

#: Consecutive calls whose every block failed with an I/O error that take a root out.
FAILED_CALLS_LIMIT = 3
#: How often roots in service are checked (their deletion watch) and out-of-service
#: roots are probed.
CHECK_INTERVAL_S = 1.0
PROBE_INTERVAL_S = 5.0

#: Errors that say nothing about the root's health (the block, not the drive).
_BLOCK_ERRORS = (BlockNotFound, CorruptBlock, TierFullError)


class NoRootInServiceError(OSError):
    """A store found no root of a striped tier in service."""

    def __init__(self, roots: int) -> None:
        super().__init__(errno.EIO, f"fs tier: none of its {roots} root_dirs is in service")


class RootTakenOutError(OSError):
    """A store whose root was taken out of service while it ran: not stored there."""

    def __init__(self, path: str) -> None:
        super().__init__(
            errno.EIO, f"fs tier: root_dir {path!r} was taken out of service during the store"
        )


@dataclass(eq=False, slots=True)
class Root:
    """One root directory of the tier, and its open state while it is in service."""

    index: int
    config: FsTierConfig
    seed: int
    weight: float = 1.0
    state: OpenState | None = None
    #: Why it is out of service (None while it serves, or before open).
    out_reason: str | None = None
    #: Consecutive calls in which every block failed with an I/O error.
    failed_calls: int = 0
    #: Calls running on its state; its files close once they have returned.
    busy: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    retiring: asyncio.Task[None] | None = None

    @property
    def path(self) -> str:
        return str(self.config.root_dir)


def _is_io_error(error: BaseException) -> bool:
    return isinstance(error, OSError) and not isinstance(error, _BLOCK_ERRORS)


class RootSet:
    """Every root of one tier (owned by the tier, on its loop thread)."""

    def __init__(
        self,
        config: FsTierConfig,
        *,
        name: Callable[[], str],
        stats: FsTierStats,
        report_removed: Callable[[Sequence[OffloadKey]], None],
    ) -> None:
        self.roots = [
            Root(i, config.for_root(i), root_seed(str(path)))
            for i, path in enumerate(config.root_dirs)
        ]
        self.striped = config.striped
        self._name = name
        self._stats = stats
        self._report_removed = report_removed
        self._seeds = [root.seed for root in self.roots]
        stats.roots = len(self.roots)

    # -- where blocks are --------------------------------------------------------------

    def in_service(self) -> list[Root]:
        return [root for root in self.roots if root.state is not None]

    def holder(self, key: OffloadKey) -> Root | None:
        """The root in service whose index holds ``key``."""
        for root in self.roots:
            state = root.state
            if state is not None and key in state.index:
                return root
        return None

    def states_of(self, key: OffloadKey) -> list[OpenState]:
        """The open state of every root in service holding ``key`` (one, once duplicates
        are dropped)."""
        return [r.state for r in self.roots if r.state is not None and key in r.state.index]

    def drop_duplicates(self) -> int:
        """Keep each key on the first root holding it (at open); how many copies were dropped.

        A root that left ``root_dirs`` and is listed again comes back with its
        blocks, some of which may have been stored again elsewhere meanwhile. A
        key is its block's content, so any copy serves the same bytes; the
        others would only make deletes, counts and evictions disagree.
        """
        seen: set[OffloadKey] = set()
        dropped = 0
        for root in self.roots:
            state = root.state
            if state is None:
                continue
            held = state.index.keys()
            copies = [k for k in held if k in seen]
            if copies:
                seq = state.journal.next_seq
                for k in copies:
                    state.index.remove(k, seq)
                state.journal.append(encode_del(copies, state.seed), retry=True)
                notify_room(state)
                dropped += len(copies)
            seen.update(state.index.keys())
        if dropped:
            note = (
                f"{dropped} blocks held by two roots (a root listed again after others "
                "stored them) were kept on one only"
            )
            self._stats.notes.append(note)
            logger.warning("fs tier %s: %s", self._name(), note)
        return dropped

    def destination(self, key: OffloadKey) -> Root | None:
        """Where a store of ``key`` goes: the root holding it, else the best live root."""
        root = self.holder(key)
        if root is not None:
            return root
        live = [r.state is not None for r in self.roots]
        best = place(key, self._seeds, [r.weight for r in self.roots], live)
        return None if best is None else self.roots[best]

    # -- calls on one root ---------------------------------------------------------------

    async def call(
        self,
        root: Root,
        run: Callable[[OpenState], Awaitable[dict[bytes, BaseException]]],
        keys: Sequence[OffloadKey],
        *,
        stores: bool = False,
    ) -> dict[bytes, BaseException]:
        """``run`` on ``root``'s state; its errors by key, and the root's health updated.

        An exception ``run`` raises (a store refused by the deletion watch, a
        store waiting for room on a root taken out) becomes the error of every
        key. With ``stores``, a root taken out of service while ``run`` ran
        fails every key (:class:`RootTakenOutError`): its blocks were reported
        removed, so one acknowledged there would be lost without a word.
        Cancellation: propagates once ``run`` has returned (it waits for I/O
        already in the kernel).
        """
        state = root.state
        if state is None:
            return {key: NoRootInServiceError(len(self.roots)) for key in keys}
        root.busy += 1
        root.idle.clear()
        try:
            try:
                errors = await run(state)
            except OSError as exc:
                errors = {key: exc for key in keys}
            except TierClosedError:
                if root.out_reason is None:  # the tier itself is closing
                    raise
                errors = {key: RootTakenOutError(root.path) for key in keys}
        finally:
            root.busy -= 1
            if root.busy == 0:
                root.idle.set()
        if stores and root.state is not state:
            taken_out = RootTakenOutError(root.path)
            errors = {key: errors.get(key, taken_out) for key in keys}
        self._account(root, state, keys, errors)
        return errors

    def _account(
        self,
        root: Root,
        state: OpenState,
        keys: Sequence[OffloadKey],
        errors: dict[bytes, BaseException],
    ) -> None:
        if not self.striped or root.state is not state:
            return
        if state.watch.refusing is not None:
            self.take_out(root, state.watch.refusing, logging.WARNING)
            return
        failed = [e for e in errors.values() if _is_io_error(e)]
        if keys and len(failed) == len(keys):
            root.failed_calls += 1
            if root.failed_calls >= FAILED_CALLS_LIMIT:
                self.take_out(
                    root, f"{root.failed_calls} calls in a row failed (last: {failed[-1]})"
                )
        elif len(failed) < len(keys):
            root.failed_calls = 0

    # -- out of service and back -----------------------------------------------------------

    def take_out(self, root: Root, why: str, level: int = logging.ERROR) -> None:
        """Take ``root`` out of service: its blocks reported removed, its files closed later.

        ``level``: of its log line (lower when the deletion watch logged the ERROR).
        """
        state = root.state
        if state is None:
            return
        root.state = None
        root.out_reason = why
        root.failed_calls = 0
        stats = self._stats
        stats.root_failures += 1
        stats.roots_out_of_service += 1
        stats.capacity_slots -= state.index.capacity_slots  # lowered if its disk filled
        keys = list(state.index.keys())
        logger.log(
            level,
            "fs tier %s: root_dir %r taken out of service: %s; its %d blocks are reported "
            "removed, %d of %d roots serve on, and it is probed every %.0f s",
            self._name(),
            root.path,
            why,
            len(keys),
            len(self.in_service()),
            len(self.roots),
            PROBE_INTERVAL_S,
        )
        self._report_removed(keys)
        state.closed = True
        notify_room(state)  # writes waiting for room on it fail now
        root.retiring = asyncio.get_running_loop().create_task(
            self._retire(root, state), name=f"fs-root-retire-{id(state)}"
        )

    async def _retire(self, root: Root, state: OpenState) -> None:
        """Close a root's files once the calls still running on it have returned."""
        try:
            if root.busy:
                await root.idle.wait()
            await stop_open_state(state, durable=False)
        except Exception as exc:  # a failing drive fails its close too; it is out already
            logger.debug("fs tier %s: closing root_dir %r: %s", self._name(), root.path, exc)

    def start_out(self, root: Root, error: BaseException) -> None:
        """Record that ``root`` could not be opened: it starts out of service."""
        root.out_reason = f"cannot open: {error}"
        self._stats.roots_out_of_service += 1
        logger.error(
            "fs tier %s: root_dir %r is out of service from the start (%s); the tier "
            "serves with the other roots and probes it every %.0f s",
            self._name(),
            root.path,
            error,
            PROBE_INTERVAL_S,
        )

    def bring_back(self, root: Root, state: OpenState) -> None:
        """``root`` opened again (empty): it serves from now on."""
        root.state = state
        root.out_reason = None
        root.retiring = None
        stats = self._stats
        stats.roots_out_of_service -= 1
        stats.root_returns += 1
        stats.capacity_slots += state.index.capacity_slots
        logger.warning(
            "fs tier %s: root_dir %r is back in service (empty); %d of %d roots serve",
            self._name(),
            root.path,
            len(self.in_service()),
            len(self.roots),
        )

    def waiting_for_probe(self) -> list[Root]:
        """Roots out of service whose files are closed: the ones a probe may open again."""
        return [
            root
            for root in self.roots
            if root.state is None
            and root.out_reason is not None
            and (root.retiring is None or root.retiring.done())
        ]

    def refusing_roots(self) -> list[Root]:
        """Roots in service whose deletion watch refuses stores."""
        return [r for r in self.roots if r.state is not None and r.state.watch.refusing is not None]

    async def close(self) -> list[OpenState]:
        """Wait for retiring roots; the states still open, for the tier to stop."""
        for root in self.roots:
            if root.retiring is not None:
                with contextlib.suppress(Exception):
                    await root.retiring
        states = [root.state for root in self.roots if root.state is not None]
        for root in self.roots:
            root.state = None
        return states
