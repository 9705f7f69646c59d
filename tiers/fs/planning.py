"""Turning a batch of blocks into I/O ops: buffer checks, bounce buffers, vectored grouping.

:func:`block_views` checks the caller's buffers; :func:`plan_ops` sorts a
batch by slot and groups adjacent slots of one slab into vectored ops of up
to ``max_io_bytes``, giving a bounce buffer to each block whose buffer
O_DIRECT cannot use. Shared by the read, write and upkeep paths.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiers.fs.io import IoOp, OpKind
from tiers.fs.io.aligned import address_of
from tiers.fs.layout import ALIGNMENT
from tiers.fs.state import Block, OpenState

#: Most buffers in one vectored op (Linux's IOV_MAX).
IOV_MAX = 1024


def plan_ops(state: OpenState, blocks: list[Block], kind: OpKind) -> list[tuple[IoOp, list[Block]]]:
    """Group blocks into vectored ops: adjacent slots of one slab, up to ``max_io_bytes``.

    Blocks whose buffer O_DIRECT cannot use get a bounce buffer (filled
    here for writes).
    """
    geometry = state.geometry
    direct = state.slabs.direct
    block_bytes, slot_bytes = geometry.block_bytes, geometry.slot_bytes
    io_len = slot_bytes if direct else block_bytes
    contiguous = io_len == slot_bytes
    per_op = max(1, min(IOV_MAX, state.config.max_io_bytes // io_len))
    slots_per_slab = geometry.slots_per_slab
    # O_DIRECT can use a buffer as it is only if it is aligned and fills the slot.
    odd_size = direct and (block_bytes != slot_bytes or block_bytes % ALIGNMENT != 0)
    plan: list[tuple[IoOp, list[Block]]] = []
    group: list[Block] = []
    buffers: list[memoryview] = []
    addresses: list[int] = []
    first_slot = prev_slot = -1
    blocks.sort(key=_slot_of)
    for block in blocks:
        buf = block.view
        address = address_of(buf)
        if direct and (odd_size or address % ALIGNMENT):
            bounce = state.bounce.take()
            block.bounce = bounce
            if kind is OpKind.WRITE:
                bounce[:block_bytes] = buf
                if state.pad:
                    bounce[block_bytes:] = state.pad
            buf = bounce
            address = address_of(bounce)
        slot = block.slot
        if (
            group
            and contiguous
            and slot == prev_slot + 1
            and slot // slots_per_slab == first_slot // slots_per_slab
            and len(group) < per_op
        ):
            group.append(block)
            buffers.append(buf)
            addresses.append(address)
        else:
            if group:
                plan.append((_make_op(state, kind, first_slot, buffers, addresses), group))
            group, buffers, addresses, first_slot = [block], [buf], [address], slot
        prev_slot = slot
    if group:
        plan.append((_make_op(state, kind, first_slot, buffers, addresses), group))
    return plan


def _make_op(
    state: OpenState, kind: OpKind, slot: int, buffers: list[memoryview], addresses: list[int]
) -> IoOp:
    _, fd, offset = state.slabs.locate(slot)
    return IoOp(kind, fd, offset, buffers, addresses=addresses)


def _slot_of(block: Block) -> int:
    return block.slot


def block_views(buffers: Sequence[memoryview], size: int, writable: bool) -> list[memoryview]:
    """The buffers as flat byte views of exactly ``size`` bytes (raises ValueError otherwise)."""
    out: list[memoryview] = []
    for buffer in buffers:
        view = buffer
        if type(view) is not memoryview or view.ndim != 1 or view.format != "B":
            view = memoryview(buffer)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
        if view.nbytes != size:
            raise ValueError(f"a block buffer must be exactly {size} bytes, got {view.nbytes}")
        if writable and view.readonly:
            raise ValueError("read() needs a writable buffer")
        out.append(view)
    return out
