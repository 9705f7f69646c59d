"""The write path: reserve slots, write the bytes, commit PUT records, acknowledge.

:func:`write_blocks` waits until the whole batch fits, reserves its slots
(evicting if full), makes sure slab files back them, writes the bytes with
vectored ops while it hashes (and tags) them (with a key, where
:func:`~tiering.tier.auth.offload_pays`, on the hashing threads, off the
loop), then appends one PUT record
for the blocks written. A block becomes visible, and its slot leaves the
batch's hands, only once that record is durable; a slab deleted under the
write fails its blocks instead of acknowledging them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
from collections.abc import Sequence

from tiering.copy.caches import evict_block
from tiering.core.errors import TierClosedError
from tiering.core.keys import OffloadKey
from tiering.tier import auth as _auth
from tiering.tier.auth import BlockAuthenticator, OffLoopWork, slices
from tiers.fs.deletion import FilesDeletedError
from tiers.fs.errors import TierFullError
from tiers.fs.files import UnsafeFileError
from tiers.fs.index import SLOT
from tiers.fs.io import OpKind
from tiers.fs.journal import JournalWriter
from tiers.fs.planning import block_views, plan_ops
from tiers.fs.records import encode_del, encode_put, encode_put_tagged, stored_tag
from tiers.fs.state import Block, OpenState, checksum, notify_room, wait_for_room

logger = logging.getLogger(__name__)

#: Hash this many bytes on the loop between yields, so completions keep flowing.
_HASH_SLICE_BYTES = 4 * 1024 * 1024


async def write_blocks(
    state: OpenState, keys: Sequence[OffloadKey], datas: Sequence[memoryview]
) -> dict[bytes, BaseException]:
    """Store ``datas`` as ``keys``' blocks; the errors of the blocks not stored, by key."""
    if len(keys) != len(datas):
        raise ValueError(f"{len(keys)} keys but {len(datas)} buffers")
    if len(set(keys)) != len(keys):
        raise ValueError("a write batch names the same key twice")
    views = block_views(datas, state.geometry.block_bytes, writable=False)
    if state.watch.refusing is not None:
        raise FilesDeletedError(state.watch.refusing)
    index, journal, stats = state.index, state.journal, state.stats
    errors: dict[bytes, BaseException] = {}
    # All or nothing: a batch that fits waits while other writes and reads hold the
    # slots it needs (holding part of them while waiting could deadlock two batches).
    while len(keys) <= index.capacity_slots and index.available() < len(keys):
        await wait_for_room(state)
        if state.closed:
            raise TierClosedError("fs tier closed while a write waited for room")
    reservation = index.reserve(len(keys), journal.durable_seq, journal.next_seq)
    if reservation.evicted:
        journal.append(encode_del([k for k, _ in reservation.evicted], state.seed), retry=True)
        stats.evictions += len(reservation.evicted)
        state.report_removed([k for k, _ in reservation.evicted])
    blocks = [
        Block(key, view, slot, None)
        for key, view, slot in zip(keys, views, reservation.slots, strict=False)
    ]
    for key in keys[len(blocks) :]:
        errors[key] = TierFullError(key, index.capacity_slots, len(keys))
    owned = {block.slot for block in blocks}  # released in `finally` unless handed on
    try:
        if blocks:
            await _write_reserved(state, blocks, reservation.ready_seq, owned)
    finally:
        if owned:
            index.release(owned)
            notify_room(state)
        for block in blocks:
            if block.bounce is not None:
                state.bounce.give(block.bounce)
                block.bounce = None
    for block in blocks:
        if block.error is not None:
            errors[block.key] = block.error
    stats.write_failures += len(errors)
    return errors


async def _write_reserved(
    state: OpenState, blocks: list[Block], ready_seq: int, owned: set[int]
) -> None:
    journal = state.journal
    await _back_slots(state, blocks)
    live = [b for b in blocks if b.error is None]
    if not live:
        return
    if ready_seq > journal.durable_seq and not await _durable_or_fail(journal, ready_seq, live):
        return
    plan = plan_ops(state, live, OpKind.WRITE)
    ops = [op for op, _ in plan]
    batch = state.backend.start(ops)
    try:
        await _seal_blocks(live, state.auth, state.fingerprint)
    except asyncio.CancelledError:
        await state.backend.abandon(batch, ops)
        raise
    await state.backend.wait(batch, ops)
    for op, group in plan:
        io_len = op.nbytes // len(group)
        for i, block in enumerate(group):
            if op.done < (i + 1) * io_len:
                block.error = op.error or OSError(errno.EIO, "short write")
        state.slabs.mark_dirty(state.geometry.slab_of(group[0].slot))
    good = [b for b in live if b.error is None]
    if not good:
        return
    seq = journal.next_seq
    entries = [(b.key, b.slot, b.checksum, b.tag) for b in good]
    if state.auth is not None:
        payload = encode_put_tagged(
            [(b.key, b.slot, b.checksum, b.tag or b"") for b in good], state.seed
        )
    else:
        payload = encode_put([(b.key, b.slot, b.checksum) for b in good], state.seed)
    index = state.index
    stats = state.stats
    block_bytes = state.geometry.block_bytes

    def commit() -> None:
        index.commit_many(entries, seq)
        stats.blocks_written += len(good)
        stats.bytes_written += len(good) * block_bytes
        notify_room(state)

    def give_back() -> None:
        index.release(b.slot for b in good)
        notify_room(state)

    journal.append(payload, on_durable=commit, on_failed=give_back)
    owned.difference_update(b.slot for b in good)  # the journal's callbacks own them now
    if not await _durable_or_fail(journal, seq, good):
        return
    await _refuse_ack_into_deleted_files(state, good, {op.fd for op in ops})


async def _durable_or_fail(journal: JournalWriter, seq: int, blocks: list[Block]) -> bool:
    """Wait until record ``seq`` is durable; if it cannot be, fail ``blocks`` with the error."""
    try:
        await journal.wait_durable(seq)
    except OSError as exc:
        for block in blocks:
            block.error = exc
        return False
    return True


async def _refuse_ack_into_deleted_files(
    state: OpenState, blocks: list[Block], fds: set[int]
) -> None:
    """Fail (and forget) committed blocks whose slab file was deleted under them.

    A deleted journal is written again first: it held their records.
    """
    watch, journal = state.watch, state.journal
    if journal.file_deleted():
        await watch.check()
    why = watch.unsafe_fds(list(fds))
    if why is None:
        return
    await watch.check()  # the slab is repaired (or stores refused) for the next writes
    seq = journal.next_seq
    gone = []
    for block in blocks:
        entry = state.index.get(block.key)
        if entry is not None and entry[SLOT] == block.slot:
            state.index.remove(block.key, seq)
            gone.append(block.key)
        block.error = FilesDeletedError(f"block {block.key.hex()} not stored: {why}")
    if gone:
        with contextlib.suppress(RuntimeError):
            journal.append(encode_del(gone, state.seed), retry=True)
        notify_room(state)


async def _back_slots(state: OpenState, blocks: list[Block]) -> None:
    """Create slab files for the blocks' slots; on ENOSPC, shrink capacity and fail those.

    A link planted where a slab is to be created is refused the same way
    (UnsafeFileError; the next open refuses the directory).
    """
    top = max(b.slot for b in blocks) + 1
    if top <= state.slabs.backed_slots:
        return
    try:
        await state.slabs.ensure(top)
    except (OSError, UnsafeFileError) as exc:
        backed = state.slabs.backed_slots
        if backed < state.index.capacity_slots:
            logger.warning(
                "fs tier %s: cannot grow the slab files past %d slots (%s); "
                "capacity lowered to what is allocated",
                state.name,
                backed,
                exc,
            )
            before = state.index.capacity_slots
            state.index.limit_capacity(backed)
            # The tier's figure sums every root's: take off what this one lost.
            state.stats.capacity_slots -= before - state.index.capacity_slots
        for block in blocks:
            if block.slot >= backed:
                block.error = exc


async def _seal_blocks(
    blocks: list[Block], auth: BlockAuthenticator | None, fingerprint: bytes
) -> None:
    """xxh3_128 (and, with a key, the MAC tag) of each block.

    Without a key, or where the hand-over does not pay (a batch under
    ``OFFLOAD_MIN_BYTES``, a machine with fewer than ``OFFLOAD_MIN_CPUS``), on
    the tier's loop thread (never the scheduler's), yielding every few MiB;
    xxhash and BLAKE3 release the GIL while they hash a block. Otherwise the
    batch is hashed and tagged on the hashing threads (:class:`OffLoopWork`), in
    slices of about ``OFFLOAD_SLICE_BYTES``, each block's checksum and tag in
    one pass while its bytes are in cache; the loop meanwhile completes other
    I/O. A block whose tag could not be computed fails (it is never committed
    untagged). Cancellation: waits until no hashing thread reads the blocks any
    more, then propagates.
    """
    sizes = [block.view.nbytes for block in blocks]
    if auth is not None and _auth.offload_pays(sum(sizes)):
        work = OffLoopWork()
        for lo, hi in slices(sizes, _auth.OFFLOAD_SLICE_BYTES):
            part = blocks[lo:hi]
            work.submit(functools.partial(_seal_slice, part, auth, fingerprint))
        await work.wait()
        for block in blocks:
            if block.tag is None:
                block.error = work.failure or RuntimeError("block tag not computed")
        return
    budget = _HASH_SLICE_BYTES
    for block in blocks:
        block.checksum = checksum(block.view)
        if auth is not None:
            block.tag = stored_tag(auth.mac, auth.tag(block.key, fingerprint, block.view))
        evict_block(block.view)  # read for good: out of the caches the scheduler shares
        budget -= block.view.nbytes
        if budget <= 0:
            budget = _HASH_SLICE_BYTES
            await asyncio.sleep(0)


def _seal_slice(blocks: list[Block], auth: BlockAuthenticator, fingerprint: bytes) -> None:
    """Checksum and tag of each block (a hashing thread: touches only these blocks)."""
    mac = auth.mac
    for block in blocks:
        view = block.view
        block.checksum = checksum(view)
        block.tag = stored_tag(mac, auth.tag(block.key, fingerprint, view))
        evict_block(view)  # read for good: out of the caches the scheduler shares
