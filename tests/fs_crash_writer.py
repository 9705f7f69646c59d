"""A process that writes blocks to a filesystem tier forever; the crash test kills it with SIGKILL.

Usage: python -m tests.fs_crash_writer ROOT CAPACITY_BLOCKS DURABILITY BACKEND
Prints ``ACK i j ...`` after each batch is acknowledged and ``DEL i ...`` for
blocks the tier evicted, flushing stdout each time.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.fs_support import BLOCK, Rows, block_data, key, opened


def index_of(k: bytes) -> int:
    return int.from_bytes(k[:8], "big")


async def main(root: Path, capacity_blocks: int, durability: str, backend: str) -> None:
    def removed(keys: object) -> None:
        print("DEL", *(index_of(k) for k in keys), flush=True)  # type: ignore[attr-defined]

    async with opened(
        root, capacity_bytes=capacity_blocks * BLOCK, durability=durability, io_backend=backend
    ) as tier:
        tier._bind_removed_sink(removed)
        print("READY", flush=True)
        next_index = 0

        async def writer(batch: int) -> None:
            nonlocal next_index
            # Page-aligned rows, like the primary tier's: the O_DIRECT-from-row path.
            rows = Rows(batch).rows(batch)
            while True:
                first = next_index
                next_index += batch
                indices = list(range(first, first + batch))
                keys = [key(i) for i in indices]
                for row, k in zip(rows, keys, strict=True):
                    row[:] = block_data(k)
                await tier.write_many(keys, rows)
                print("ACK", *indices, flush=True)

        await asyncio.gather(writer(3), writer(8), writer(16))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]))
