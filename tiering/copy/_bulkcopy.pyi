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
