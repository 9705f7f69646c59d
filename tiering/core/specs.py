"""The ``LoadStoreSpec`` family: where a worker finds or puts the bytes of blocks."""

from __future__ import annotations

import itertools
import struct
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Self

import numpy as np
import numpy.typing as npt

BlockIds = npt.NDArray[np.int64]


#: Arrays this module validated and froze: ``id(array) -> weakref.ref(array)``. Passing
#: one on again (a spec's ids into a job) costs a lookup, not a copy and a re-validation
#: (0.3 us instead of about 2 us per call). A plain dict of plain references, not a
#: ``WeakValueDictionary``: registering costs 0.1 us instead of 0.6 (no callback per
#: array). An entry outlives its array until the next prune; a dead entry, or one whose
#: id a new array reuses, never matches (its reference answers None, or another object).
_VALIDATED: dict[int, weakref.ref[BlockIds]] = {}
#: The next prune of dead entries is due once the registry holds this many.
_prune_at = 1024


def as_block_ids(block_ids: Sequence[int] | npt.ArrayLike, what: str = "block_ids") -> BlockIds:
    """Return ``block_ids`` as a read-only 1-D int64 array, validating it.

    An array this function returned before (and nobody made writable since)
    is returned as it is. Raises ``ValueError`` for a non 1-D or negative
    input and ``TypeError`` for values that are not integers (floats, bools,
    strings would otherwise be silently truncated or parsed).
    """
    if type(block_ids) is np.ndarray:
        if not block_ids.flags.writeable and _is_validated(block_ids):
            return block_ids
        if block_ids.dtype == _INT64 and block_ids.ndim == 1 and block_ids.size <= _SMALL:
            # A fresh row array (the scheduler's per-request case): Python's min over a
            # few items costs a fraction of numpy's reduction.
            arr = block_ids.copy()
            if arr.size and min(arr.tolist()) < 0:
                raise ValueError(f"{what} must be non-negative, got {int(arr.min())}")
            return _freeze(arr)
    elif (
        isinstance(block_ids, (list, tuple))
        and len(block_ids) <= _SMALL
        and all(type(i) is int for i in block_ids)
    ):
        if block_ids and min(block_ids) < 0:
            raise ValueError(f"{what} must be non-negative, got {min(block_ids)}")
        try:
            return _frozen_small(block_ids)
        except struct.error:
            pass  # an int beyond int64: the general path names it
    elif (
        isinstance(block_ids, (list, tuple))
        and len(block_ids) <= _SMALL
        and any(isinstance(i, (bool, np.bool_)) for i in block_ids)
    ):
        # numpy reads [1, True] as [1, 1]. Checked where it is cheap (a longer list would
        # pay a Python loop on the scheduler's path; numpy refuses a list of bools alone).
        raise TypeError(f"{what} must be integers, got a bool in {list(block_ids)!r}")
    raw = np.asarray(block_ids)
    if raw.size and (
        raw.dtype.kind not in "iu" or (raw.dtype.kind == "u" and int(raw.max()) > _INT64_MAX)
    ):
        _raise_out_of_range(block_ids, raw, what)
        raise TypeError(f"{what} must be integers, got dtype {raw.dtype}")
    arr = raw.astype(np.int64, copy=True)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{what} must be non-negative, got {int(arr.min())}")
    return _freeze(arr)


#: Inputs up to this many ids take the fast paths of :func:`as_block_ids`.
_SMALL = 64
_INT64 = np.dtype(np.int64)
_INT64_MAX = int(np.iinfo(np.int64).max)


def _raise_out_of_range(block_ids: object, raw: npt.NDArray[Any], what: str) -> None:
    """Name an integer id beyond int64 as such: numpy reads such lists as uint64, float64
    or objects, which would otherwise read as "not integers" or wrap negative."""
    if raw.dtype.kind == "u":
        raise ValueError(f"{what} must fit in a signed 64-bit integer, got {int(raw.max())}")
    if isinstance(block_ids, (list, tuple)) and all(type(i) is int for i in block_ids):
        if min(block_ids) < 0:
            raise ValueError(f"{what} must be non-negative, got {min(block_ids)}")
        raise ValueError(f"{what} must fit in a signed 64-bit integer, got {max(block_ids)}")


def trusted_block_ids(block_ids: list[int]) -> BlockIds:
    """:func:`as_block_ids` of ints the caller owns and knows valid (non-negative, within
    int64: a tier's own rows), without checking them again: 0.6 us instead of 3.4 for 8
    ids, on the scheduler's path of every ``prepare_store`` / ``prepare_load``."""
    if len(block_ids) <= _SMALL:
        return _frozen_small(block_ids)
    return _freeze(np.array(block_ids, dtype=np.int64))


#: ``struct.Struct(f"={n}q").pack`` by ``n`` (at most ``_SMALL`` + 1 of them).
_PACKERS: dict[int, Callable[..., bytes]] = {}


def _frozen_small(block_ids: Sequence[int]) -> BlockIds:
    """At most ``_SMALL`` ints as a validated array over an immutable ``bytes``: read-only
    from birth, and numpy refuses to make it writable (its memory is the bytes object's).
    One numpy call instead of three (array, flag, view): the scheduler's small specs are
    built in a step whose caches are cold, where each numpy call costs several times its
    warm price. ``struct.error`` for an int beyond int64."""
    count = len(block_ids)
    pack = _PACKERS.get(count)
    if pack is None:
        pack = _PACKERS[count] = struct.Struct(f"={count}q").pack
    return _register(np.frombuffer(pack(*block_ids), np.int64))


def _freeze(arr: BlockIds) -> BlockIds:
    """``arr`` (owned here) made read-only and remembered as validated."""
    arr.flags.writeable = False
    # A view of a read-only array is read-only, and numpy refuses to make it writable
    # again (its base is not), so a validated array stays what was validated.
    return _register(arr.view())


def _register(frozen: BlockIds) -> BlockIds:
    global _prune_at
    registry = _VALIDATED
    registry[id(frozen)] = weakref.ref(frozen)
    if len(registry) >= _prune_at:
        for key in [key for key, ref in registry.items() if ref() is None]:
            del registry[key]
        _prune_at = max(1024, 2 * len(registry))  # amortized O(1) per registration
    return frozen


def _is_validated(arr: BlockIds) -> bool:
    ref = _VALIDATED.get(id(arr))
    return ref is not None and ref() is arr


class LoadStoreSpec(ABC):
    """Abstract description of a source or destination of a block transfer."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """The medium's name (``"GPU"``, ``"CPU"``, a secondary tier type...)."""


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """Blocks identified by their index in the medium's block array."""

    def __init__(self, block_ids: Sequence[int] | npt.ArrayLike) -> None:
        self.block_ids: BlockIds = as_block_ids(block_ids)

    def __len__(self) -> int:
        return int(self.block_ids.size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids.tolist()})"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Rows of the CPU primary tier's host buffer."""

    @classmethod
    def of_own_rows(cls, block_ids: list[int]) -> Self:
        """The spec of rows its caller owns (:func:`trusted_block_ids`: not checked again)."""
        spec = cls.__new__(cls)
        spec.block_ids = trusted_block_ids(block_ids)
        return spec

    @staticmethod
    def medium() -> str:
        return "CPU"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU KV-cache blocks, possibly of several KV-cache groups.

    With several groups the block ids are ordered by group: ``group_sizes[i]``
    blocks belong to group ``i`` and ``sum(group_sizes) == len(block_ids)``.
    ``group_sizes=None`` means a single group.

    ``block_indices[i]`` is the logical index (within its request) of the first
    block of group ``i``. Workers need it when an offloaded block spans several
    GPU blocks: a group whose first GPU block is not aligned to the offloaded
    block size starts part-way into the first offloaded block.
    """

    def __init__(
        self,
        block_ids: Sequence[int] | npt.ArrayLike,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ) -> None:
        super().__init__(block_ids)
        sizes = None if group_sizes is None else _ints(group_sizes, "group_sizes")
        if sizes is not None:
            if any(s < 0 for s in sizes):
                raise ValueError(f"group_sizes must be non-negative, got {list(sizes)}")
            if sum(sizes) != len(self):
                raise ValueError(
                    f"sum(group_sizes)={sum(sizes)} must equal len(block_ids)={len(self)}"
                )
        indices = None if block_indices is None else _ints(block_indices, "block_indices")
        if indices is not None:
            num_groups = 1 if sizes is None else len(sizes)
            if len(indices) != num_groups:
                raise ValueError(
                    f"len(block_indices)={len(indices)} must equal the number of "
                    f"KV cache groups ({num_groups})"
                )
            if any(i < 0 for i in indices):
                raise ValueError(f"block_indices must be non-negative, got {list(indices)}")
        self.group_sizes: tuple[int, ...] | None = sizes
        self.block_indices: tuple[int, ...] | None = indices

    @staticmethod
    def medium() -> str:
        return "GPU"

    def groups(self) -> list[BlockIds]:
        """The block ids split per KV-cache group."""
        if self.group_sizes is None:
            return [self.block_ids]
        bounds = np.cumsum((0, *self.group_sizes))
        return [self.block_ids[a:b] for a, b in itertools.pairwise(bounds.tolist())]


def _ints(values: Sequence[int], what: str) -> tuple[int, ...]:
    """``values`` as ints; ``TypeError`` for anything else (int() truncated 1.5 and parsed
    '1'). numpy integers are ints."""
    out = []
    for value in values:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{what} must be integers, got {value!r}")
        out.append(int(value))
    return tuple(out)
