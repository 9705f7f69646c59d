"""Turning a (GPU spec, CPU spec) pair into per-tensor block copies.

The mapping (the seed's ``block_indices`` rule): within group ``g`` the GPU
blocks are logically contiguous blocks of a request, the first being the
request's block ``block_indices[g]``. A CPU block spans ``factor`` GPU blocks,
so that first GPU block lands at sub-block ``skip = block_indices[g] % factor``
of the group's first CPU block, and GPU block ``k`` of the group at
``position = skip + k``: CPU block ``cpu_ids[position // factor]``, sub-block
``position % factor``. The group uses ``ceil((n + skip) / factor)`` CPU
blocks; the CPU spec lists them group after group, and an empty group uses
none. Loads use the same mapping with source and destination swapped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tiering.copy.layout import KVLayout
from tiering.core.errors import ContractError
from tiering.core.specs import BlockIds, CPULoadStoreSpec, GPULoadStoreSpec

Offsets = npt.NDArray[np.int64]


class Lane(enum.Enum):
    """An ordered queue of copies: one CUDA stream or one host thread each.

    Stores and loads have separate lanes so neither waits behind the other;
    expedited loads (awaited within the current step) have their own.
    """

    STORE = "store"
    LOAD = "load"
    LOAD_EXPEDITED = "load_expedited"

    @property
    def gpu_to_cpu(self) -> bool:
        return self is Lane.STORE


@dataclass(frozen=True, slots=True)
class BlockCopies:
    """``nbytes`` bytes per block between GPU rows and CPU sub-blocks of one tensor.

    Copy ``i`` moves the first ``nbytes`` bytes of GPU block ``gpu_blocks[i]``
    to/from sub-block ``cpu_subblocks[i]`` of CPU block ``cpu_blocks[i]``.
    """

    tensor_idx: int
    nbytes: int
    gpu_blocks: BlockIds
    cpu_blocks: BlockIds
    cpu_subblocks: BlockIds

    def __len__(self) -> int:
        return int(self.gpu_blocks.size)

    def gpu_offsets(self, row_stride: int) -> Offsets:
        """Byte offsets of the GPU pages, relative to the tensor's first byte."""
        return self.gpu_blocks * np.int64(row_stride)

    def cpu_offsets(self, layout: KVLayout) -> Offsets:
        """Byte offsets of the CPU sub-blocks, relative to the host buffer's first byte."""
        t = self.tensor_idx
        return (
            self.cpu_blocks * np.int64(layout.cpu_block_bytes)
            + np.int64(layout.cpu_slot_offsets[t])
            + self.cpu_subblocks * np.int64(layout.gpu_page_bytes[t])
        )


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Every copy of one job, grouped per (tensor, size), plus what it touches.

    ``gpu_block_ids`` / ``cpu_block_ids`` are the blocks read or written on
    each side, ascending (used to order jobs of different lanes that touch the
    same blocks; arrays, not sets: a set of 1,024 ids costs the scheduler's
    thread 30 us to build, and most jobs are never compared). ``total_bytes``
    is what the job moves.
    """

    lane: Lane
    copies: tuple[BlockCopies, ...]
    total_bytes: int
    gpu_block_ids: BlockIds
    cpu_block_ids: BlockIds

    def conflicts_with(self, other: TransferPlan) -> bool:
        """True if the two jobs must not run concurrently.

        Two jobs conflict when one writes a block the other reads or writes. A
        store reads GPU blocks and writes CPU blocks; a load the reverse. Two
        loads only conflict through the GPU blocks they both write (reading the
        same CPU block twice is harmless).
        """
        both_loads = not self.lane.gpu_to_cpu and not other.lane.gpu_to_cpu
        if both_loads:
            return _intersect(self.gpu_block_ids, other.gpu_block_ids)
        if self.lane.gpu_to_cpu and other.lane.gpu_to_cpu:
            return _intersect(self.cpu_block_ids, other.cpu_block_ids)
        return _intersect(self.gpu_block_ids, other.gpu_block_ids) or _intersect(
            self.cpu_block_ids, other.cpu_block_ids
        )


def _intersect(ascending: BlockIds, others: BlockIds) -> bool:
    """Whether any of ``others`` is in ``ascending`` (a binary search per value)."""
    if not ascending.size or not others.size:
        return False
    at = np.minimum(np.searchsorted(ascending, others), ascending.size - 1)
    return bool((ascending[at] == others).any())


def plan_transfer(
    layout: KVLayout, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec, lane: Lane
) -> TransferPlan:
    """Map the GPU blocks of ``gpu_spec`` onto the CPU blocks of ``cpu_spec``.

    Raises :class:`~tiering.core.errors.ContractError` (changing nothing) when the
    specs do not fit the layout: wrong number of groups, block ids out of range,
    a CPU spec with more or fewer blocks than the GPU blocks need, or two copies
    writing the same destination.
    """
    if not isinstance(gpu_spec, GPULoadStoreSpec):
        raise ContractError(f"expected a GPULoadStoreSpec, got {type(gpu_spec).__name__}")
    if not isinstance(cpu_spec, CPULoadStoreSpec):
        raise ContractError(f"expected a CPULoadStoreSpec, got {type(cpu_spec).__name__}")
    groups = gpu_spec.groups()
    if len(groups) != layout.num_groups:
        raise ContractError(
            f"the GPU spec has {len(groups)} KV-cache group(s), the layout has "
            f"{layout.num_groups}; pass group_sizes with one entry per group"
        )
    factor = layout.block_size_factor
    indices = gpu_spec.block_indices or (0,) * len(groups)
    cpu_ids = cpu_spec.block_ids
    if cpu_ids.size and int(cpu_ids.max()) >= layout.cpu_num_blocks:
        raise ContractError(
            f"CPU block {int(cpu_ids.max())} is out of range: the host buffer has "
            f"{layout.cpu_num_blocks} blocks"
        )

    # (tensor_idx, nbytes) -> lists of per-group arrays, merged below so each
    # tensor is one batched gather/scatter per job.
    parts: dict[tuple[int, int], tuple[list[BlockIds], list[BlockIds], list[BlockIds]]] = {}
    cpu_pos = 0
    total = 0
    for g, gpu_ids in enumerate(groups):
        n = int(gpu_ids.size)
        if n == 0:
            continue
        copies = layout.group_copies[g]
        limit = min((layout.gpu_num_blocks[c.tensor_idx] for c in copies), default=0)
        if int(gpu_ids.max()) >= limit:
            raise ContractError(
                f"group {g}: GPU block {int(gpu_ids.max())} is out of range: the KV cache "
                f"tensors of this group have {limit} blocks"
            )
        skip = indices[g] % factor
        num_cpu = -(-(n + skip) // factor)
        if cpu_pos + num_cpu > cpu_ids.size:
            raise ContractError(
                f"group {g}: {n} GPU blocks starting at request block {indices[g]} need "
                f"{num_cpu} CPU block(s) (block_size_factor {factor}), but the CPU spec has "
                f"only {int(cpu_ids.size) - cpu_pos} left"
            )
        group_cpu = cpu_ids[cpu_pos : cpu_pos + num_cpu]
        positions = np.arange(skip, skip + n, dtype=np.int64)
        cpu_blocks = group_cpu[positions // factor]
        cpu_subs = positions % factor
        for c in copies:
            gl, cl, sl = parts.setdefault((c.tensor_idx, c.nbytes), ([], [], []))
            gl.append(gpu_ids)
            cl.append(cpu_blocks)
            sl.append(cpu_subs)
            total += n * c.nbytes
        cpu_pos += num_cpu
    if cpu_pos != cpu_ids.size:
        raise ContractError(
            f"the CPU spec has {int(cpu_ids.size)} blocks but the GPU spec maps onto "
            f"{cpu_pos} (block_size_factor {factor})"
        )

    block_copies: list[BlockCopies] = []
    # Every tensor of a group lists the same arrays: merge and check them once per job,
    # not once per tensor (a model has tens of layers).
    merged: dict[tuple[int, ...], tuple[BlockIds, BlockIds, BlockIds]] = {}
    for (t, nbytes), (gl, cl, sl) in parts.items():
        key = tuple(map(id, (*gl, *cl, *sl)))
        arrays = merged.get(key)
        fresh = arrays is None
        if arrays is None:
            arrays = (
                _frozen(np.concatenate(gl)),
                _frozen(np.concatenate(cl)),
                _frozen(np.concatenate(sl)),
            )
            merged[key] = arrays
        entry = BlockCopies(t, nbytes, *arrays)
        if fresh:
            _check_unique_destinations(entry, layout, lane)
        block_copies.append(entry)
    _check_tensor_destinations(block_copies, layout, lane)

    gpu_all = np.concatenate(groups) if groups else np.empty(0, np.int64)
    return TransferPlan(
        lane=lane,
        copies=tuple(block_copies),
        total_bytes=total,
        gpu_block_ids=_frozen(np.sort(gpu_all)),
        cpu_block_ids=_frozen(np.sort(cpu_ids)),
    )


def _frozen(arr: npt.NDArray[np.int64]) -> BlockIds:
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    arr.flags.writeable = False
    return arr


def _check_unique_destinations(entry: BlockCopies, layout: KVLayout, lane: Lane) -> None:
    if lane.gpu_to_cpu:
        dest = entry.cpu_blocks * layout.block_size_factor + entry.cpu_subblocks
        what = "CPU sub-block"
    else:
        dest = entry.gpu_blocks
        what = "GPU block"
    if _has_repeats(dest):
        raise ContractError(
            f"two copies of tensor {entry.tensor_idx} write the same {what}; "
            f"each destination may appear once per job"
        )


def _check_tensor_destinations(copies: list[BlockCopies], layout: KVLayout, lane: Lane) -> None:
    """The same tensor listed with two sizes (different groups) must not overlap either."""
    by_tensor: dict[int, list[BlockCopies]] = {}
    for entry in copies:
        by_tensor.setdefault(entry.tensor_idx, []).append(entry)
    for t, entries in by_tensor.items():
        if len(entries) < 2:
            continue
        if lane.gpu_to_cpu:
            dest = np.concatenate(
                [e.cpu_blocks * layout.block_size_factor + e.cpu_subblocks for e in entries]
            )
        else:
            dest = np.concatenate([e.gpu_blocks for e in entries])
        if _has_repeats(dest):
            raise ContractError(f"two groups of this job write the same blocks of tensor {t}")


def _has_repeats(values: BlockIds) -> bool:
    """Whether any value appears twice (a sort: 4-5x cheaper than ``np.unique`` here)."""
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


def byte_runs(
    src_offsets: Offsets, dst_offsets: Offsets, nbytes: int
) -> tuple[Offsets, Offsets, Offsets]:
    """Coalesce per-block copies of ``nbytes`` into maximal contiguous runs.

    Copy ``i`` joins copy ``i - 1`` when both its source and its destination
    start right where the previous one ended. Returns ``(src_starts,
    dst_starts, lengths)``; one memcpy per run replaces one per block.
    """
    n = int(src_offsets.size)
    if n == 0:
        empty = np.empty(0, np.int64)
        return empty, empty, empty
    step = np.int64(nbytes)
    breaks = np.flatnonzero(
        (src_offsets[1:] != src_offsets[:-1] + step) | (dst_offsets[1:] != dst_offsets[:-1] + step)
    )
    starts = np.concatenate(([0], breaks + 1)).astype(np.int64)
    ends = np.concatenate((breaks + 1, [n])).astype(np.int64)
    return src_offsets[starts], dst_offsets[starts], (ends - starts) * step
