"""The conformance kit against the filesystem tier (both I/O backends, O_DIRECT and buffered)."""

from __future__ import annotations

from pathlib import Path

from tiering.testing.conformance import conformance_tests
from tiers.fs import FileSystemTier
from tiers.fs.io import uring_unavailable_reason

_BACKEND = "uring" if uring_unavailable_reason() is None else "threads"


def uring_direct_tier(tmp_path: Path) -> FileSystemTier:
    return FileSystemTier(
        root_dir=tmp_path / "fs", capacity_bytes="64MiB", io_backend=_BACKEND, direct_io="auto"
    )


def threads_buffered_tier(tmp_path: Path) -> FileSystemTier:
    return FileSystemTier(
        root_dir=tmp_path / "fs",
        capacity_bytes="64MiB",
        io_backend="threads",
        direct_io=False,
        durability="fsync",
    )


globals().update(conformance_tests(uring_direct_tier, prefix="test_kit_default_", persistent=True))
globals().update(
    conformance_tests(threads_buffered_tier, prefix="test_kit_threads_", persistent=True)
)


def authenticated_tier(tmp_path: Path) -> FileSystemTier:
    """With ``auth_key_file``: every block carries a MAC tag, checked on every read."""
    key_file = tmp_path / "fs-key"
    if not key_file.exists():
        key_file.write_bytes(b"conformance-kit-key-0123456789abcdef")
        key_file.chmod(0o600)
    return FileSystemTier(
        root_dir=tmp_path / "fs", capacity_bytes="64MiB", auth_key_file=str(key_file)
    )


globals().update(conformance_tests(authenticated_tier, prefix="test_kit_auth_", persistent=True))
