# The optional C extension built from _bulkcopy.c (see tiering/copy/bulk.py).
from collections.abc import Sequence
from typing import Any

def copy_regions(
    src: Sequence[int] | Any,
    dst: Sequence[int] | Any,
    lengths: int | Sequence[int] | Any,
    release_gil_from_bytes: int,
    /,
) -> None: ...

#: How regions of 64 KiB or more evict their source lines once read:
#: "clflushopt", "clflush" (x86-64 without CLFLUSHOPT) or "none" (other CPUs).
SOURCE_FLUSH: str

def evict_lines(buffer: Any, release_gil_from_bytes: int, /) -> None: ...
