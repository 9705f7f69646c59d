"""What an open fs tier holds: its counters, its per-open state and the blocks of one batch.

:class:`OpenState` gathers everything that exists between ``open`` and
``aclose`` (files, index, journal, I/O backend, background tasks, writes
waiting for room); the tier owns it, and the read, write and upkeep paths
take it as an argument. :class:`Block` carries one block of a batch through
planning, I/O and settling. Everything here lives on the tier's loop thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import xxhash

from tiering.core.keys import OffloadKey
from tiering.tier.auth import BlockAuthenticator
from tiers.fs.config import FsTierConfig
from tiers.fs.deletion import DeletionWatch
from tiers.fs.index import Entry, SlotIndex
from tiers.fs.io import IoBackend
from tiers.fs.io.aligned import BouncePool
from tiers.fs.journal import JournalWriter
from tiers.fs.layout import Geometry
from tiers.fs.opening import Prepared
from tiers.fs.slabs import SlabFiles

#: The checksum stored with every block (xxh3-128 of its bytes).
checksum = xxhash.xxh3_128_intdigest


@dataclass(slots=True)
class FsTierStats:
    """Counters of one tier since it was opened (read on the tier's loop thread)."""

    blocks_read: int = 0
    blocks_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_failures: int = 0
    write_failures: int = 0
    corrupt_blocks: int = 0
    auth_failures: int = 0
    deletions_noticed: int = 0
    evictions: int = 0
    recovered_blocks: int = 0
    dropped_on_recovery: int = 0
    #: Recovered blocks read back and verified after a damaged journal (see docs/fs-tier.md).
    verified_after_damage: int = 0
    io_backend: str = ""
    direct_io: bool = False
    capacity_slots: int = 0
    notes: list[str] = field(default_factory=list)
    #: Roots of the tier (``root_dirs``), those out of service now, how many times one
    #: was taken out, and how many times one came back (docs/fs-tier.md, "Several drives").
    roots: int = 1
    roots_out_of_service: int = 0
    root_failures: int = 0
    root_returns: int = 0

    def count_deletion(self) -> None:
        """One more deletion of the tier's files noticed under it."""
        self.deletions_noticed += 1


class Block:
    """One block of a batch on its way through planning, I/O and settling."""

    __slots__ = ("bounce", "checksum", "entry", "error", "key", "slot", "tag", "view")

    def __init__(self, key: OffloadKey, view: memoryview, slot: int, entry: Entry | None) -> None:
        self.key = key
        self.view = view
        self.slot = slot
        self.entry = entry
        self.bounce: memoryview | None = None
        self.checksum = 0
        self.tag: bytes | None = None
        self.error: BaseException | None = None


@dataclass(slots=True)
class OpenState:
    """Everything that exists while the tier is open (owned by its loop thread)."""

    prepared: Prepared
    geometry: Geometry
    slabs: SlabFiles
    index: SlotIndex
    backend: IoBackend
    journal: JournalWriter
    bounce: BouncePool
    seed: int
    pad: bytes
    auth: BlockAuthenticator | None
    fingerprint: bytes
    watch: DeletionWatch
    # From the tier, for the paths that take this state: its name (for logs), config and
    # counters, and where blocks it drops are reported.
    name: str
    config: FsTierConfig
    stats: FsTierStats
    report_removed: Callable[[Sequence[OffloadKey]], None]
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    room_waiters: list[asyncio.Future[None]] = field(default_factory=list)
    #: Set by ``aclose``: writes waiting for room wake up and fail.
    closed: bool = False


async def wait_for_room(state: OpenState) -> None:
    """Wait until slots may have come free (a commit, release, unpin or delete)."""
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    state.room_waiters.append(waiter)
    await waiter


def notify_room(state: OpenState) -> None:
    """Wake every write waiting for room (it checks again whether its batch fits)."""
    waiters, state.room_waiters = state.room_waiters, []
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
