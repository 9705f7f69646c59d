"""The canonical KV-cache layout on both sides of a GPU <-> CPU copy.

GPU side (the seed's ``CanonicalKVCaches``): a list of unique tensors, each
viewed as ``(num_blocks, page_bytes)`` bytes, plus, per KV-cache group, the
references ``(tensor_idx, page_size_bytes)`` that say which tensors hold the
group's layers and how many bytes of each (possibly padded) page are real.

CPU side (the primary tier's host buffer, ``(num_cpu_blocks, block_bytes)``):
one CPU block holds ``block_size_factor`` consecutive GPU blocks of one group,
for every tensor. Each tensor owns a *slot* of ``page_bytes * factor`` bytes in
every CPU block; slots are packed back to back from the worker's offset::

    CPU block b: | worker 0: [tensor0 x factor][tensor1 x factor] ... | worker 1: ...

Sub-block ``j`` of tensor ``t`` in CPU block ``b`` starts at byte
``b * block_bytes + slot_offset[t] + j * page_bytes[t]``. Every worker of a
tensor-parallel engine has its own area of ``worker_area_bytes`` in each block,
so one host buffer serves all of them. This module is pure and torch-free: the
scheduler uses :func:`required_cpu_block_bytes` to size the buffer it creates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

#: Default alignment of a CPU block (O_DIRECT needs 4096-byte multiples).
CPU_BLOCK_ALIGNMENT = 4096


@dataclass(slots=True)
class CanonicalKVCacheTensor:
    """A KV-cache tensor whose first dimension is ``num_blocks``.

    ``tensor`` is a torch tensor (CUDA for the CUDA engine, CPU for the host
    engine) or a numpy array; ``page_size_bytes`` is the (possibly padded) size
    of one block's page.
    """

    tensor: Any
    page_size_bytes: int


@dataclass(slots=True)
class CanonicalKVCacheRef:
    """One layer (or group of layers) of a KV-cache group: which tensor, how many real bytes."""

    tensor_idx: int
    page_size_bytes: int


@dataclass(slots=True)
class CanonicalKVCaches:
    """The canonical block-level KV caches: unique tensors and per-group references.

    Field names follow vLLM's ``vllm.v1.kv_offload.base.CanonicalKVCaches``, so
    vLLM's own object can be passed wherever this one is accepted.
    """

    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]] = field(default_factory=list)


class _TensorLike(Protocol):
    @property
    def tensor(self) -> Any: ...
    @property
    def page_size_bytes(self) -> int: ...


class _RefLike(Protocol):
    @property
    def tensor_idx(self) -> int: ...
    @property
    def page_size_bytes(self) -> int: ...


class KVCachesLike(Protocol):
    """Anything shaped like :class:`CanonicalKVCaches` (ours or vLLM's)."""

    @property
    def tensors(self) -> Sequence[_TensorLike]: ...
    @property
    def group_data_refs(self) -> Sequence[Sequence[_RefLike]]: ...


@dataclass(frozen=True, slots=True)
class GroupCopy:
    """The bytes one KV-cache group moves per GPU block in one tensor."""

    tensor_idx: int
    nbytes: int


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


def worker_area_bytes(page_sizes: Sequence[int], block_size_factor: int) -> int:
    """Bytes one worker needs in each CPU block: one slot of ``page * factor`` per tensor."""
    return sum(int(p) for p in page_sizes) * block_size_factor


def required_cpu_block_bytes(
    page_sizes: Sequence[int],
    block_size_factor: int = 1,
    num_workers: int = 1,
    alignment: int = CPU_BLOCK_ALIGNMENT,
) -> int:
    """Size of one CPU block of a host buffer shared by ``num_workers`` workers.

    ``page_sizes`` are one worker's padded page sizes, one per unique tensor.
    The scheduler creates the primary tier's buffer with this block size; each
    worker's :class:`KVLayout` must then agree (checked at construction).
    """
    if block_size_factor < 1:
        raise ValueError(f"block_size_factor must be >= 1, got {block_size_factor}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    if not page_sizes or any(int(p) <= 0 for p in page_sizes):
        raise ValueError(f"page_sizes must be positive and non-empty, got {list(page_sizes)}")
    return round_up(worker_area_bytes(page_sizes, block_size_factor) * num_workers, alignment)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry of both sides of a copy; validated at construction.

    ``gpu_page_bytes[t]`` / ``gpu_num_blocks[t]``: tensor ``t``'s padded page
    and block count. ``group_copies[g]``: what group ``g`` moves per GPU block
    (aliased references of one tensor are merged; the larger size wins).
    ``cpu_slot_offsets[t]``: where tensor ``t``'s slot starts in a CPU block.
    """

    gpu_page_bytes: tuple[int, ...]
    gpu_num_blocks: tuple[int, ...]
    group_copies: tuple[tuple[GroupCopy, ...], ...]
    block_size_factor: int
    cpu_num_blocks: int
    cpu_block_bytes: int
    cpu_slot_offsets: tuple[int, ...]

    @classmethod
    def build(
        cls,
        *,
        gpu_page_bytes: Sequence[int],
        gpu_num_blocks: Sequence[int],
        group_data_refs: Sequence[Sequence[_RefLike]],
        block_size_factor: int,
        cpu_num_blocks: int,
        cpu_block_bytes: int,
        worker_index: int = 0,
    ) -> KVLayout:
        """Pack this worker's slots at ``worker_index * worker_area_bytes`` of each CPU block.

        Raises ``ValueError`` naming the offending value for any inconsistency:
        a reference to a missing tensor or larger than its page, a CPU block
        too small for this worker's area, non-positive sizes.
        """
        pages = tuple(int(p) for p in gpu_page_bytes)
        counts = tuple(int(n) for n in gpu_num_blocks)
        if not pages:
            raise ValueError("the KV caches have no tensors")
        if len(counts) != len(pages):
            raise ValueError(f"{len(pages)} page sizes but {len(counts)} block counts")
        for t, (page, count) in enumerate(zip(pages, counts, strict=True)):
            if page <= 0:
                raise ValueError(f"tensor {t}: page_size_bytes must be positive, got {page}")
            if count <= 0:
                raise ValueError(f"tensor {t}: num_blocks must be positive, got {count}")
        if block_size_factor < 1:
            raise ValueError(f"block_size_factor must be >= 1, got {block_size_factor}")
        if cpu_num_blocks <= 0:
            raise ValueError(f"the host buffer must have blocks, got {cpu_num_blocks}")
        if worker_index < 0:
            raise ValueError(f"worker_index must be >= 0, got {worker_index}")
        if not group_data_refs:
            raise ValueError("group_data_refs must list at least one KV-cache group")

        groups: list[tuple[GroupCopy, ...]] = []
        for g, refs in enumerate(group_data_refs):
            merged: dict[int, int] = {}
            for ref in refs:
                t, nbytes = int(ref.tensor_idx), int(ref.page_size_bytes)
                if not 0 <= t < len(pages):
                    raise ValueError(
                        f"group {g}: reference to tensor {t}, but there are {len(pages)} tensors"
                    )
                if not 0 < nbytes <= pages[t]:
                    raise ValueError(
                        f"group {g}: page_size_bytes={nbytes} of tensor {t} must be in "
                        f"(0, {pages[t]}] (the tensor's page)"
                    )
                merged[t] = max(merged.get(t, 0), nbytes)
            groups.append(tuple(GroupCopy(t, n) for t, n in merged.items()))

        area = worker_area_bytes(pages, block_size_factor)
        base = worker_index * area
        if base + area > cpu_block_bytes:
            raise ValueError(
                f"a CPU block of {cpu_block_bytes} bytes cannot hold worker {worker_index}'s "
                f"area of {area} bytes at offset {base} (pages {list(pages)} x "
                f"block_size_factor {block_size_factor}); size the host buffer with "
                f"required_cpu_block_bytes()"
            )
        offsets: list[int] = []
        for page in pages:
            offsets.append(base)
            base += page * block_size_factor
        return cls(
            gpu_page_bytes=pages,
            gpu_num_blocks=counts,
            group_copies=tuple(groups),
            block_size_factor=block_size_factor,
            cpu_num_blocks=cpu_num_blocks,
            cpu_block_bytes=cpu_block_bytes,
            cpu_slot_offsets=tuple(offsets),
        )

    @property
    def num_groups(self) -> int:
        return len(self.group_copies)

    @property
    def num_tensors(self) -> int:
        return len(self.gpu_page_bytes)

    def cpu_slot_bytes(self, tensor_idx: int) -> int:
        """Bytes of tensor ``tensor_idx``'s slot in one CPU block."""
        return self.gpu_page_bytes[tensor_idx] * self.block_size_factor

    def bytes_per_gpu_block(self, group_idx: int) -> int:
        """Bytes group ``group_idx`` moves per GPU block (over all its tensors)."""
        return sum(c.nbytes for c in self.group_copies[group_idx])
