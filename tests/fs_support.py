"""Helpers for the filesystem tier tests: opening tiers, block contents, fault injection."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import mmap
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tiering.core.keys import OffloadKey, make_offload_key
from tiering.tier import TierContext
from tiers.fs import FileSystemTier
from tiers.fs.index import SLOT
from tiers.fs.io import IoBackend, IoOp, OpKind
from tiers.fs.io.uring import uring_unavailable_reason

BLOCK = 16384
FINGERPRINT = "test-model/bf16/16x2x8x128"
BACKENDS = ["threads"] + (["uring"] if uring_unavailable_reason() is None else [])


def key(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), group)


def block_data(k: bytes, nbytes: int = BLOCK) -> bytes:
    """Deterministic bytes for key ``k`` (a crashed writer and its checker agree on them)."""
    rng = np.random.default_rng(xxhash.xxh3_64_intdigest(k))
    return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()


class Rows:
    """A page-aligned buffer of ``count`` rows of ``nbytes`` (like the primary tier's)."""

    def __init__(self, count: int, nbytes: int = BLOCK) -> None:
        self._map = mmap.mmap(-1, count * nbytes)
        self.view = memoryview(self._map)
        self.nbytes = nbytes

    def row(self, i: int) -> memoryview:
        return self.view[i * self.nbytes : (i + 1) * self.nbytes]

    def rows(self, count: int) -> list[memoryview]:
        return [self.row(i) for i in range(count)]


def make_tier(root: Path, **config: Any) -> FileSystemTier:
    config.setdefault("capacity_bytes", "16MiB")
    return FileSystemTier(root_dir=root, **config)


@contextlib.asynccontextmanager
async def opened(
    root: Path,
    block_bytes: int = BLOCK,
    fingerprint: str = FINGERPRINT,
    tier: FileSystemTier | None = None,
    **config: Any,
) -> AsyncIterator[FileSystemTier]:
    tier = tier if tier is not None else make_tier(root, **config)
    await tier.open(TierContext(block_bytes, fingerprint, "fs-test"))
    try:
        yield tier
    finally:
        await tier.aclose()


async def write_keys(tier: FileSystemTier, keys: Sequence[OffloadKey], nbytes: int = BLOCK) -> None:
    await tier.write_many(keys, [memoryview(block_data(k, nbytes)) for k in keys])


async def read_key(tier: FileSystemTier, k: OffloadKey, nbytes: int = BLOCK) -> bytes:
    into = bytearray(nbytes)
    await tier.read(k, memoryview(into))
    return bytes(into)


def slot_location(tier: FileSystemTier, k: OffloadKey) -> tuple[Path, int]:
    """The slab file and offset holding ``k``'s block (white-box, for damaging it)."""
    state = tier._state()
    entry = state.index.get(k)
    assert entry is not None, f"{k.hex()} is not in the tier"
    geometry = state.geometry
    slab = geometry.slab_of(entry[SLOT])
    return tier.config.root_dir / f"slab-{slab:06d}.bin", geometry.offset_of(entry[SLOT])


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def fill_disk(path: Path) -> None:
    """Write ``path`` until its filesystem is full."""
    with contextlib.suppress(OSError), open(path, "wb") as f:
        while True:
            f.write(bytes(4096))
            f.flush()


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


#: Decides a fault for an op: an OSError to fail it, or None to run it.
FaultRule = Callable[[IoOp], OSError | None]


def fail_data_ops(kind: OpKind, code: int = errno.EIO) -> FaultRule:
    """Fail every data op of ``kind`` (slab reads or writes, not the journal)."""

    def rule(op: IoOp) -> OSError | None:
        if op.kind is kind and op.nbytes and op.priority.name != "URGENT":
            return OSError(code, f"injected {errno.errorcode[code]}")
        return None

    return rule


class FaultyBackend(IoBackend):
    """Wraps a real backend; ops the rule picks fail (asynchronously) instead of running."""

    def __init__(self, inner: IoBackend, rule: FaultRule) -> None:
        super().__init__(asyncio.get_running_loop())
        self.inner = inner
        self.rule = rule
        self.name = inner.name
        self.injected = 0

    def _enqueue(self, ops: Sequence[IoOp]) -> None:
        passthrough = []
        for op in ops:
            fault = self.rule(op)
            if fault is None:
                passthrough.append(op)
            else:
                self.injected += 1
                op.error = fault
                op.started = True
                self._loop.call_soon(op.finish)
        if passthrough:
            self.inner._enqueue(passthrough)

    def _withdraw(self, ops: Sequence[IoOp]) -> list[IoOp]:
        return self.inner._withdraw(ops)

    async def aclose(self) -> None:
        self._closed = True
        await self.inner.aclose()


class FaultyFsTier(FileSystemTier):
    """A FileSystemTier whose I/O goes through a :class:`FaultyBackend` (rule swappable)."""

    rule: FaultRule = staticmethod(lambda op: None)
    backend: FaultyBackend | None = None

    def _make_backend(self, loop: asyncio.AbstractEventLoop, *, direct_io: bool) -> IoBackend:
        inner = super()._make_backend(loop, direct_io=direct_io)
        self.backend = FaultyBackend(inner, lambda op: self.rule(op))
        return self.backend


def slab_files(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith("slab-"))


def disk_bytes(root: Path) -> int:
    """Bytes allocated to slab files (what capacity bounds)."""
    return sum(os.stat(p).st_blocks * 512 for p in slab_files(root))
