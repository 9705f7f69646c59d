"""The read path: pin the blocks, read them, verify each one, drop the ones that fail.

:func:`read_blocks` pins each key's slot (so no write reuses it meanwhile),
reads the batch with vectored ops and checks every block against its
xxh3-128 checksum (and its MAC tag when the tier has a key) as each op
completes: on the loop thread, or, with a key where
:func:`~tiering.tier.auth.offload_pays`, on the hashing threads
(checksum and tag in one pass per block, the loop free to complete the next
ops meanwhile). A block that fails (checksum, tag, short read or I/O error,
or a check that did not run to its end) is dropped from the index with a DEL
record and reported removed: a miss from then on, never wrong bytes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Sequence

from tiering.copy.caches import evict_block
from tiering.core.errors import BlockNotFound, CorruptBlock
from tiering.core.keys import OffloadKey
from tiering.tier import auth as _auth
from tiering.tier.auth import BlockAuthenticator, OffLoopWork, slices
from tiers.fs.index import CHECKSUM, SLOT, TAG, Entry
from tiers.fs.io import IoOp, OpKind
from tiers.fs.planning import block_views, plan_ops
from tiers.fs.records import encode_del, tag_mac
from tiers.fs.state import Block, OpenState, checksum, notify_room

logger = logging.getLogger(__name__)


async def read_blocks(
    state: OpenState, keys: Sequence[OffloadKey], views: Sequence[memoryview]
) -> dict[bytes, BaseException]:
    """Read ``keys`` into ``views``; the errors of the blocks that failed, by key.

    Cancellation: returns (raising ``CancelledError``) only once no I/O and no
    hashing thread touches ``views`` any more; blocks not verified are not
    counted as read.
    """
    if len(keys) != len(views):
        raise ValueError(f"{len(keys)} keys but {len(views)} buffers")
    into = block_views(views, state.geometry.block_bytes, writable=True)
    errors: dict[bytes, BaseException] = {}
    blocks: list[Block] = []
    index = state.index
    for key, view in zip(keys, into, strict=True):
        entry = index.pin(key)
        if entry is None:
            errors[key] = BlockNotFound(key)
        else:
            blocks.append(Block(key, view, entry[SLOT], entry))
    if not blocks:
        return errors
    checks: OffLoopWork | None = None
    if state.auth is not None and _auth.offload_pays(len(blocks) * state.geometry.block_bytes):
        checks = OffLoopWork()
    try:
        plan = plan_ops(state, blocks, OpKind.READ)
        for op, group in plan:  # verify each op's blocks as soon as it completes
            op.on_done = functools.partial(_settle_read, state, group=group, checks=checks)
        try:
            await state.backend.run([op for op, _ in plan])
        finally:
            if checks is not None:  # the hashing threads read the views (and bounces)
                await checks.wait()
    finally:
        for block in blocks:
            index.unpin(block.slot)
            if block.bounce is not None:
                state.bounce.give(block.bounce)
                block.bounce = None
        notify_room(state)
    stats = state.stats
    block_bytes = state.geometry.block_bytes
    for block in blocks:
        if block.error is None:
            index.access(block.key)
            stats.blocks_read += 1
            stats.bytes_read += block_bytes
        elif block.error is _NOT_VERIFIED_YET:  # a failed check, not a bad block: kept
            errors[block.key] = CorruptBlock(block.key, "not verified (its check failed)")
            stats.read_failures += 1
        else:
            errors[block.key] = block.error
            stats.read_failures += 1
            assert block.entry is not None
            _drop(state, block.key, block.entry, block.error)
    return errors


def _settle_read(
    state: OpenState, op: IoOp, *, group: list[Block], checks: OffLoopWork | None = None
) -> None:
    """Judge one finished op's blocks (loop thread): short reads and errors here; the
    checksum and tag here too, or handed to ``checks``' hashing threads."""
    block_bytes = state.geometry.block_bytes
    io_len = op.nbytes // len(group)
    complete: list[Block] = []
    for i, block in enumerate(group):
        if op.done < (i + 1) * io_len:
            if op.error is not None:
                block.error = op.error
            else:
                got = max(0, op.done - i * io_len)
                block.error = CorruptBlock(block.key, f"short read: {got} of {io_len} bytes")
            continue
        if block.bounce is not None:
            block.view[:] = block.bounce[:block_bytes]
        if checks is not None:
            # A miss unless a hashing thread finds checksum and tag right.
            block.error = _NOT_VERIFIED_YET
            complete.append(block)
            continue
        block.error = _check_block(state.auth, state.fingerprint, block)
    if complete:
        assert checks is not None and state.auth is not None
        auth, fingerprint = state.auth, state.fingerprint
        for lo, hi in slices([block_bytes] * len(complete), _auth.OFFLOAD_SLICE_BYTES):
            part = complete[lo:hi]
            checks.submit(functools.partial(_check_slice, part, auth, fingerprint))


def _check_block(
    auth: BlockAuthenticator | None, fingerprint: bytes, block: Block
) -> CorruptBlock | None:
    """Why ``block``'s bytes are not what was stored (checksum, then tag), or None.

    Pure: runs on the loop or a hashing thread.
    """
    entry = block.entry
    assert entry is not None
    error: CorruptBlock | None = None
    if checksum(block.view) != entry[CHECKSUM]:
        error = CorruptBlock(block.key, "checksum mismatch")
    elif auth is not None:
        error = _authentication_error(auth, fingerprint, block.key, block.view, entry)
    evict_block(block.view)  # read for good: out of the caches the scheduler shares
    return error


def _check_slice(blocks: list[Block], auth: BlockAuthenticator, fingerprint: bytes) -> None:
    """Verify blocks on a hashing thread: each one's error is cleared only if it checks out."""
    for block in blocks:
        block.error = _check_block(auth, fingerprint, block)


def _drop(state: OpenState, key: OffloadKey, entry: Entry, why: BaseException) -> None:
    """Forget a block that failed to read, so it is a miss from now on."""
    if state.index.get(key) is not entry:
        return
    stats = state.stats
    if isinstance(why, _AuthenticationFailed):
        stats.auth_failures += 1
        if stats.auth_failures == 1:  # once per tier: a forger must not flood the log
            logger.error(
                "fs tier %s: block %s failed authentication (%s) and was deleted; someone "
                "without the key wrote to %s. Further failures are only counted "
                "(stats.auth_failures)",
                state.name,
                key.hex(),
                why,
                state.config.root_dir,
            )
    elif isinstance(why, CorruptBlock):
        stats.corrupt_blocks += 1
    seq = state.journal.next_seq
    state.index.remove(key, seq)
    with contextlib.suppress(RuntimeError):  # closing: the entry is gone from memory anyway
        state.journal.append(encode_del([key], state.seed), retry=True)
    state.report_removed([key])
    if not isinstance(why, _AuthenticationFailed):
        logger.warning("fs tier %s: dropped block %s: %s", state.name, key.hex(), why)


class _AuthenticationFailed(CorruptBlock):
    """A block whose MAC tag is missing or wrong: written by someone without the key."""


#: The error of a block handed to a hashing thread until it verifies it (never a hit). One
#: still there after the wait met a failed check (a bug, logged): a miss, the block kept.
_NOT_VERIFIED_YET = CorruptBlock(b"", "not verified (its check did not finish)")


def _authentication_error(
    auth: BlockAuthenticator, fingerprint: bytes, key: OffloadKey, data: memoryview, entry: Entry
) -> CorruptBlock | None:
    stored = entry[TAG]
    if stored is None:
        return _AuthenticationFailed(key, "stored without an authentication tag")
    mac, tag = tag_mac(stored)
    if not auth.verify(key, fingerprint, data, tag, mac):
        return _AuthenticationFailed(key, f"authentication tag mismatch ({mac})")
    return None
