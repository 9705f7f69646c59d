"""Page-locking the primary buffer: reference counts and chunked registration.

``cudaHostRegister`` is process-wide, so one registry per host runtime counts
who pinned what: the second engine over the same buffer (a restarted worker,
a second handler set) shares the registration, and only the last release
unregisters it. A range somebody else registered (``cudaErrorHostMemory
AlreadyRegistered``, 712: vLLM pins its offload region itself) is usable but
never unregistered by us.

A single registration has a per-call size limit on some drivers: 512 GiB on
NVIDIA r580+ (the driver's page table for one call must fit ``kvzalloc``;
vLLM #51080), less on some ROCm hosts (vLLM #52656: between 128 and 256 GB).
So the buffer is registered in chunks of at most ``max_chunk_bytes`` (64 GiB,
as vLLM #51081) ending on row boundaries, so no block is split between two
registrations; a chunk the driver refuses with an allocation or invalid-value
error is retried at half the size, down to ``min_chunk_bytes``. If even that
fails, every chunk registered so far is released and the buffer stays
pageable: copies then still work, but block the submitting thread; one
WARNING says so.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from tiering.copy.cuda.device import (
    CUDA_ERROR_ALREADY_REGISTERED,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_MEMORY_ALLOCATION,
    CudaDevice,
)

logger = logging.getLogger(__name__)

#: The largest single registration (vLLM #51081 chose the same, under the 512 GiB driver cap).
DEFAULT_MAX_CHUNK_BYTES = 64 * 1024**3
#: Below this a refused chunk is not split further: the failure is not about size.
DEFAULT_MIN_CHUNK_BYTES = 64 * 1024**2

_RETRY_SMALLER = (CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_MEMORY_ALLOCATION)


@dataclass
class PinnedRange:
    """One pinned host range: who holds it and how it was registered."""

    ptr: int
    nbytes: int
    holders: int = 1
    #: ``(ptr, nbytes)`` of each registration we made (and will undo).
    chunks: list[tuple[int, int]] = field(default_factory=list)
    #: Chunks somebody else had registered already (712): usable, not ours to undo.
    foreign_chunks: list[tuple[int, int]] = field(default_factory=list)


class PinRegistry:
    """Reference-counted, chunked ``cudaHostRegister`` of host ranges for one runtime.

    Thread-safe. ``pin`` / ``unpin`` must be paired by the caller.
    """

    def __init__(
        self,
        *,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES,
    ) -> None:
        if min_chunk_bytes <= 0 or max_chunk_bytes < min_chunk_bytes:
            raise ValueError(
                f"need 0 < min_chunk_bytes <= max_chunk_bytes, got {min_chunk_bytes} and "
                f"{max_chunk_bytes}"
            )
        self.max_chunk_bytes = max_chunk_bytes
        self.min_chunk_bytes = min_chunk_bytes
        self._lock = threading.Lock()
        self._ranges: dict[tuple[int, int], PinnedRange] = {}

    def holders(self, ptr: int, nbytes: int) -> int:
        """How many ``pin`` calls on exactly this range are not yet undone."""
        with self._lock:
            pinned = self._ranges.get((ptr, nbytes))
            return 0 if pinned is None else pinned.holders

    def get(self, ptr: int, nbytes: int) -> PinnedRange | None:
        with self._lock:
            return self._ranges.get((ptr, nbytes))

    def pin(self, device: CudaDevice, ptr: int, nbytes: int, *, row_bytes: int = 1) -> bool:
        """Page-lock ``[ptr, ptr + nbytes)``; True if it is pinned afterwards.

        Chunks end on multiples of ``row_bytes`` from ``ptr``. False (with
        one WARNING, nothing left registered) when the driver refuses it.
        """
        key = (ptr, nbytes)
        with self._lock:
            pinned = self._ranges.get(key)
            if pinned is not None:
                pinned.holders += 1
                return True
            pinned = self._register(device, ptr, nbytes, max(1, row_bytes))
            if pinned is None:
                return False
            self._ranges[key] = pinned
            return True

    def unpin(self, device: CudaDevice, ptr: int, nbytes: int) -> None:
        """Release one ``pin``; the last release unregisters the chunks we registered."""
        with self._lock:
            pinned = self._ranges.get((ptr, nbytes))
            if pinned is None:
                return
            pinned.holders -= 1
            if pinned.holders > 0:
                return
            del self._ranges[(ptr, nbytes)]
            self._unregister(device, pinned.chunks)

    def _register(
        self, device: CudaDevice, ptr: int, nbytes: int, row_bytes: int
    ) -> PinnedRange | None:
        pinned = PinnedRange(ptr, nbytes)
        chunk = self._rows(min(nbytes, self.max_chunk_bytes), row_bytes)
        floor = self._rows(self.min_chunk_bytes, row_bytes)
        pos = 0
        while pos < nbytes:
            size = min(chunk, nbytes - pos)
            code = device.register_host(ptr + pos, size)
            if code == 0:
                pinned.chunks.append((ptr + pos, size))
                pos += size
                continue
            device.clear_last_error()
            if code == CUDA_ERROR_ALREADY_REGISTERED:
                pinned.foreign_chunks.append((ptr + pos, size))
                pos += size
                continue
            if code in _RETRY_SMALLER and size > floor:
                chunk = max(floor, self._rows(size // 2, row_bytes))
                logger.info(
                    "cudaHostRegister of %d bytes refused (CUDA error %d); retrying in chunks "
                    "of %d bytes",
                    size,
                    code,
                    chunk,
                )
                continue
            self._unregister(device, pinned.chunks)
            logger.warning(
                "cudaHostRegister of the primary buffer (%d bytes, chunk of %d at offset %d) "
                "failed with CUDA error %d; copies fall back to pageable memory and block the "
                "submitting thread",
                nbytes,
                size,
                pos,
                code,
            )
            return None
        return pinned

    @staticmethod
    def _rows(nbytes: int, row_bytes: int) -> int:
        """``nbytes`` rounded down to whole rows (one row at least)."""
        return max(row_bytes, nbytes // row_bytes * row_bytes)

    @staticmethod
    def _unregister(device: CudaDevice, chunks: list[tuple[int, int]]) -> None:
        for chunk_ptr, _ in reversed(chunks):
            code = device.unregister_host(chunk_ptr)
            if code != 0:
                device.clear_last_error()
                logger.warning("cudaHostUnregister failed with CUDA error %d", code)


#: The process's registry for real devices (registration is process-wide in CUDA).
PROCESS_PINS = PinRegistry()
