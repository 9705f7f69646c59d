"""On-disk layout of a filesystem tier: file names, slot geometry and the header.

A root directory holds::

    header.json          self-describing header (format, block size, fingerprint, cache id,
                         and the set of roots of a striped tier)
    index.journal        the index: an append-only log of PUT/DEL records (see journal.py)
    slab-000000.bin ...  preallocated slab files of fixed-size slots, one block per slot
    lock                 flock()ed by the process that has the tier open

File names never derive from keys: a key maps to a slot through the index
only, so no key can name a path.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiers.fs.files import RootDir

FORMAT_NAME = "kv-tiering-fs"
FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "xxh3_128"

HEADER_NAME = "header.json"
JOURNAL_NAME = "index.journal"
LOCK_NAME = "lock"
SLAB_GLOB_PREFIX = "slab-"
SLAB_SUFFIX = ".bin"

#: Slot offsets and sizes are multiples of this, so O_DIRECT works on any device
#: whose logical block size divides a page.
ALIGNMENT = 4096


def slab_name(index: int) -> str:
    return f"{SLAB_GLOB_PREFIX}{index:06d}{SLAB_SUFFIX}"


def parse_slab_name(name: str) -> int | None:
    """The slab index of a file name written by :func:`slab_name`, else None."""
    if not (name.startswith(SLAB_GLOB_PREFIX) and name.endswith(SLAB_SUFFIX)):
        return None
    digits = name[len(SLAB_GLOB_PREFIX) : -len(SLAB_SUFFIX)]
    return int(digits) if digits.isdigit() and len(digits) == 6 else None


def existing_slab_bytes(root: Path) -> int:
    """Disk space already allocated to slab files under ``root`` (0 if none)."""
    total = 0
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            if parse_slab_name(entry.name) is not None and entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where each slot lives: slot ``s`` is in slab ``s // slots_per_slab``.

    ``capacity_slots`` is the number of usable slots; the last slab may be
    shorter than the others.
    """

    block_bytes: int
    slot_bytes: int
    slots_per_slab: int
    capacity_slots: int

    @classmethod
    def plan(cls, block_bytes: int, capacity_bytes: int, slab_bytes: int) -> Geometry:
        slot_bytes = round_up(block_bytes, ALIGNMENT)
        return cls(
            block_bytes=block_bytes,
            slot_bytes=slot_bytes,
            slots_per_slab=max(1, slab_bytes // slot_bytes),
            capacity_slots=capacity_bytes // slot_bytes,
        )

    @property
    def num_slabs(self) -> int:
        return -(-self.capacity_slots // self.slots_per_slab)

    def slab_of(self, slot: int) -> int:
        return slot // self.slots_per_slab

    def offset_of(self, slot: int) -> int:
        return (slot % self.slots_per_slab) * self.slot_bytes

    def slab_size(self, slab: int) -> int:
        """Bytes of slab ``slab`` under this capacity (0 for slabs past the end)."""
        first = slab * self.slots_per_slab
        slots = max(0, min(self.slots_per_slab, self.capacity_slots - first))
        return slots * self.slot_bytes


@dataclass(frozen=True, slots=True)
class Header:
    """The self-describing header: what a root directory holds, and for which layout."""

    block_bytes: int
    slot_bytes: int
    slots_per_slab: int
    layout_fingerprint: str
    cache_id: str
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    checksum: str = CHECKSUM_ALGORITHM
    #: Every root of the tier this root belongs to (``root_dirs``), empty for a tier of
    #: one root. Not part of the layout: a changed set costs only the roots that left.
    root_set: tuple[str, ...] = ()

    @classmethod
    def new(
        cls, geometry: Geometry, layout_fingerprint: str, root_set: tuple[str, ...] = ()
    ) -> Header:
        return cls(
            block_bytes=geometry.block_bytes,
            slot_bytes=geometry.slot_bytes,
            slots_per_slab=geometry.slots_per_slab,
            layout_fingerprint=layout_fingerprint,
            cache_id=uuid.uuid4().hex,
            root_set=root_set,
        )

    def mismatch(self, block_bytes: int, layout_fingerprint: str) -> str | None:
        """Why this cache cannot serve ``block_bytes``/``layout_fingerprint`` (None: it can)."""
        if self.format != FORMAT_NAME or self.format_version != FORMAT_VERSION:
            return (
                f"format {self.format!r} v{self.format_version}, this code reads v{FORMAT_VERSION}"
            )
        if self.checksum != CHECKSUM_ALGORITHM:
            return f"checksum {self.checksum!r}, this code uses {CHECKSUM_ALGORITHM!r}"
        if self.block_bytes != block_bytes:
            return f"block_bytes {self.block_bytes}, this tier was opened with {block_bytes}"
        if self.layout_fingerprint != layout_fingerprint:
            return (
                f"layout fingerprint {self.layout_fingerprint!r}, this tier was opened with "
                f"{layout_fingerprint!r}"
            )
        if self.slot_bytes != round_up(block_bytes, ALIGNMENT) or self.slots_per_slab <= 0:
            return f"inconsistent geometry (slot_bytes={self.slot_bytes})"
        return None

    @property
    def journal_seed(self) -> int:
        """Seeds record checksums, so records of another cache never validate here."""
        return int(self.cache_id[:16], 16)

    def to_json(self) -> str:
        fields: dict[str, Any] = {
            "format": self.format,
            "format_version": self.format_version,
            "checksum": self.checksum,
            "block_bytes": self.block_bytes,
            "slot_bytes": self.slot_bytes,
            "slots_per_slab": self.slots_per_slab,
            "layout_fingerprint": self.layout_fingerprint,
            "cache_id": self.cache_id,
        }
        if self.root_set:  # a tier of one root writes the header earlier releases wrote
            fields["root_set"] = list(self.root_set)
        return json.dumps(fields, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Header:
        """Parse a header; raises ValueError when it is not one of ours or is damaged."""
        try:
            raw: Any = json.loads(text)
        except RecursionError:
            raise ValueError("header nests too deeply to be one of ours") from None
        if not isinstance(raw, dict):
            raise ValueError("header is not a JSON object")
        try:
            header = cls(
                format=str(raw["format"]),
                format_version=int(raw["format_version"]),
                checksum=str(raw["checksum"]),
                block_bytes=int(raw["block_bytes"]),
                slot_bytes=int(raw["slot_bytes"]),
                slots_per_slab=int(raw["slots_per_slab"]),
                layout_fingerprint=str(raw["layout_fingerprint"]),
                cache_id=str(raw["cache_id"]),
                root_set=_root_set(raw.get("root_set", [])),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"header field missing or malformed: {exc}") from exc
        if len(header.cache_id) != 32 or any(c not in "0123456789abcdef" for c in header.cache_id):
            raise ValueError(f"header cache_id {header.cache_id!r} is malformed")
        return header


def _root_set(raw: object) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(r, str) for r in raw):
        raise ValueError(f"root_set {raw!r} is not a list of paths")
    return tuple(raw)


#: A header is a few hundred bytes; anything much larger is not one of ours.
MAX_HEADER_BYTES = 64 * 1024


def read_header(root: RootDir) -> Header | None:
    """The header under ``root``; None if there is none. Raises ValueError if damaged."""
    data = root.read_small(HEADER_NAME, MAX_HEADER_BYTES)
    if data is None:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"header is not UTF-8 ({exc.reason})") from None
    return Header.from_json(text)


def write_header(root: RootDir, header: Header) -> None:
    """Atomically replace the header (temp file, fsync, rename, directory fsync). Blocking."""
    root.replace_atomically(HEADER_NAME, header.to_json().encode("utf-8"), full_sync=True)
