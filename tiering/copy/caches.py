"""Keeping a tier's block payloads out of the CPU caches other cores share.

A tier reads every block it moves at least once with the CPU (its checksum,
its MAC tag), on its own core. Those lines pass through that core's caches
and, once evicted from them, through the last-level cache the scheduler's
core shares, pushing out the scheduler's own lines: its steps run slower
with no GIL wait and no preemption (the ``step CPU`` column of
``benchmarks/engine_step.py``). A block is never read again by the CPU
(the next reader is a disk, a socket or a GPU copy), so :func:`evict_block`
drops its lines right after the last read, while they are still in that
core's private caches, as the bulk copy does for the sources of its large
regions (``docs/copy-engine.md``).

Measured on these machines (AMD EPYC, 2 vCPUs), a scheduler thread resting 2
ms per step beside another process hashing random 256 KiB regions of a 256 MiB
pool with xxh3-128 flat out: steps 1.34-1.39x slower (22-26 GB/s hashed);
with each region's lines evicted after its hash, 1.03-1.13x (15 GB/s).
Evicting 256 KiB costs about 9 us of the tier's CPU, against 10 us for its
xxh3 from memory.

Without the optional C extension, or on a CPU without a line flush (anything
but x86-64), :func:`evict_block` does nothing: the bytes are right either way.
"""

from __future__ import annotations

from types import ModuleType

_native: ModuleType | None
try:  # built at install where a C compiler was present (setup.py): optional
    from tiering.copy import _bulkcopy as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

#: Blocks shorter than this are left in the caches: a tier's blocks are 64 KiB
#: or more, and for a few KiB the call costs more than the lines are worth.
EVICT_MIN_BYTES = 64 << 10

#: Evictions of at least this many bytes (about 35 us) release the GIL; shorter
#: ones hold it rather than hand it over twice for a few microseconds.
EVICT_RELEASE_GIL_BYTES = 1 << 20

#: How lines are evicted here: "clflushopt", "clflush" or "none" (no eviction).
EVICTION = _native.SOURCE_FLUSH if _native is not None else "none"


def evict_block(block: memoryview) -> None:
    """Drop the lines of ``block`` (C-contiguous) from every CPU cache, once read for good.

    Dirty lines are written back first: the bytes in memory are unchanged,
    only their cached copies go. A no-op for blocks under
    :data:`EVICT_MIN_BYTES` and where :data:`EVICTION` is ``"none"``.
    Raises ``BufferError`` for a non-contiguous buffer.
    """
    if _native is not None and block.nbytes >= EVICT_MIN_BYTES:
        _native.evict_lines(block, EVICT_RELEASE_GIL_BYTES)
