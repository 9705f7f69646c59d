"""Large memory mappings for block bytes: private anonymous memory in huge pages where allowed.

Copies of small regions (a model's 8 KiB layer pages) scattered over a
buffer of many GiB take a TLB miss per 4 KiB page; in 2 MiB pages they take
far fewer. Measured on these machines (the table of ``benchmarks/copy_engine.py``'s
8 x 8 KiB stores, copied by the bulk copy alone, interleaved): 82-84 % of
memcpy into shared memory in 4 KiB pages, 91-94 % into private memory in huge
pages.

Linux grants huge pages to a mapping only under its transparent-huge-page
settings: anonymous private memory under
``/sys/kernel/mm/transparent_hugepage/enabled`` (``always``, or ``madvise``,
which the mappings here ask for), shared memory (``/dev/shm`` objects and
``MAP_SHARED | MAP_ANONYMOUS``) under ``.../shmem_enabled``, which many
distributions leave at ``never``. So buffers that no other process needs
are private (:func:`private_anonymous`), and :func:`huge_pages_refused` says
why a mapping will be in 4 KiB pages, for a log line an operator can act on.
"""

from __future__ import annotations

import contextlib
import mmap
from pathlib import Path

HUGE_PAGE_BYTES = 2 * 1024 * 1024
THP_DIR = Path("/sys/kernel/mm/transparent_hugepage")
#: Settings of ``enabled`` / ``shmem_enabled`` under which an advised mapping gets huge pages.
_GRANTING = {
    "enabled": frozenset({"always", "madvise"}),
    "shmem_enabled": frozenset({"always", "within_size", "advise", "force"}),
}


def private_anonymous(size: int) -> mmap.mmap:
    """A zero-filled private anonymous mapping of ``size`` bytes, in huge pages where allowed.

    A forked child does not inherit it (``MADV_DONTFORK``): with a private
    mapping it would get a copy-on-write snapshot, and every write of the
    parent's afterwards would copy a page (2 MiB at a time) while the child
    lives. A buffer other processes use is a named shared one instead.
    Raises ``OSError`` if the memory cannot be mapped.
    """
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(mapping)
    if hasattr(mmap, "MADV_DONTFORK"):
        with contextlib.suppress(OSError):
            mapping.madvise(mmap.MADV_DONTFORK)
    return mapping


def advise_huge_pages(mapping: mmap.mmap) -> None:
    """Ask for huge pages on ``mapping`` (at least one huge page long); the kernel may ignore it."""
    if len(mapping) >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mapping.madvise(mmap.MADV_HUGEPAGE)


def huge_pages_refused(shared: bool, thp_dir: Path = THP_DIR) -> str | None:
    """Why an advised mapping (``shared``: shared memory) will be in 4 KiB pages, or None.

    None also where the platform has no such settings to read: nothing an
    operator could change.
    """
    setting = "shmem_enabled" if shared else "enabled"
    try:
        text = (thp_dir / setting).read_text()
    except OSError:
        return None
    chosen = next((word[1:-1] for word in text.split() if word.startswith("[")), None)
    if chosen is None or chosen in _GRANTING[setting]:
        return None
    advice = "advise" if shared else "madvise"
    return (
        f"{thp_dir / setting} is {chosen!r}: the kernel gives this memory no huge pages "
        f"(set it to {advice!r} for fewer TLB misses on small scattered copies)"
    )
