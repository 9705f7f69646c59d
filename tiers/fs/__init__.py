"""Filesystem secondary tier: slab files, O_DIRECT and io_uring, checksummed and crash-consistent.

Config (``secondary_tiers`` entry)::

    {"type": "fs", "root_dir": "/mnt/nvme/kvcache", "capacity_bytes": "64GiB"}

See docs/fs-tier.md for the format, its guarantees and every option.
"""

from tiers.fs.config import FsTierConfig
from tiers.fs.deletion import FilesDeletedError
from tiers.fs.errors import RootInUseError, TierFullError
from tiers.fs.files import UnsafeFileError
from tiers.fs.state import FsTierStats
from tiers.fs.tier import FileSystemTier

__all__ = [
    "FileSystemTier",
    "FilesDeletedError",
    "FsTierConfig",
    "FsTierStats",
    "RootInUseError",
    "TierFullError",
    "UnsafeFileError",
]
