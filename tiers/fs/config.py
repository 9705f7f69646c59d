"""Configuration of the filesystem tier, validated at construction.

Users write it in ``secondary_tiers`` the way vLLM users write its own tier::

    {"type": "fs", "root_dir": "/mnt/nvme/kvcache", "capacity_bytes": "64GiB",
     "n_read_threads": 8, "n_write_threads": 4, "durability": "periodic"}

Every value is checked here, so a typo fails when the engine starts, not at
the first store. Sizes accept integers or strings with a unit (``"64GiB"``,
``"500MB"``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from tiering.core.errors import ConfigError
from tiering.policies import PolicyChoice, resolve_policy
from tiering.tier.auth import BlockAuthenticator, authenticator_from_options
from tiers.fs.files import check_root_permissions
from tiers.fs.layout import SLAB_GLOB_PREFIX, existing_slab_bytes

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

IO_BACKENDS = ("auto", "uring", "threads")
DURABILITY_POLICIES = ("none", "periodic", "fsync")
LAYOUT_MISMATCH_ACTIONS = ("reset", "error")

#: Default capacity: this much, or half of what the disk can hold, whichever is smaller.
DEFAULT_CAPACITY_BYTES = 16 * GiB
DEFAULT_SLAB_BYTES = 1 * GiB
DEFAULT_MAX_IO_BYTES = 8 * MiB

IoBackendName = Literal["auto", "uring", "threads"]
Durability = Literal["none", "periodic", "fsync"]
DirectIo = Literal["auto", "on", "off"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 1024 * GiB,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(name: str, value: object) -> int:
    """Bytes from an int or a string such as ``"64GiB"``/``"500MB"`` (raises ConfigError)."""
    if isinstance(value, bool):
        raise ConfigError(f"fs tier: {name} must be a size in bytes, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _UNITS:
            return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise ConfigError(
        f"fs tier: {name} must be a number of bytes or a string like '64GiB' or '500MB', "
        f"got {value!r}"
    )


def _positive_int(name: str, value: object, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"fs tier: {name} must be a positive integer, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"fs tier: {name} must be at most {maximum}, got {value}")
    return value


def _choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"fs tier: {name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _direct_io(value: object) -> DirectIo:
    if value is True or value == "on":
        return "on"
    if value is False or value == "off":
        return "off"
    if value is None or value == "auto":
        return "auto"
    raise ConfigError(f"fs tier: direct_io must be 'auto', true or false; got {value!r}")


@dataclass(frozen=True, slots=True)
class FsTierConfig:
    """The validated configuration of one filesystem tier (see docs/fs-tier.md).

    ``capacity_bytes`` bounds the bytes of block data on disk (slab files);
    the index journal and header are small and not counted. With
    ``capacity_blocks`` set instead, the capacity is that many slots, turned
    into bytes (and checked against the disk) when the block size is known.

    A striped tier (``root_dirs``) has one such capacity per root:
    ``root_dirs``/``root_capacities`` list them, :meth:`for_root` gives one
    root's config, and ``root_dir``/``capacity_bytes`` are the first root's.
    """

    root_dir: Path
    capacity_bytes: int
    capacity_blocks: int | None = None
    n_read_threads: int = 8
    n_write_threads: int = 4
    io_backend: IoBackendName = "auto"
    direct_io: DirectIo = "auto"
    durability: Durability = "periodic"
    sync_interval_s: float = 1.0
    eviction_policy: str = "lru"  # the policy's label; ``policy`` is what is built
    slab_bytes: int = DEFAULT_SLAB_BYTES
    queue_depth: int = 32
    max_io_bytes: int = DEFAULT_MAX_IO_BYTES
    on_layout_mismatch: Literal["reset", "error"] = "reset"
    preallocate: bool = True
    policy: PolicyChoice = None  # type: ignore[assignment]  # set by __post_init__

    def __post_init__(self) -> None:
        given: object = self.policy  # None unless a resolved choice was passed
        if given is None:
            object.__setattr__(self, "policy", resolve_policy(self.eviction_policy))
        if not self.root_dirs:  # built directly with one root_dir
            object.__setattr__(self, "root_dirs", (self.root_dir,))
            object.__setattr__(self, "root_capacities", (self.capacity_bytes,))

    #: The MAC of ``auth_key_file`` / ``auth_key_env`` (None: blocks are checksummed only).
    authenticator: BlockAuthenticator | None = field(default=None, repr=False, compare=False)
    #: Every root (``root_dirs``, or ``root_dir`` alone) and the capacity in bytes of each.
    root_dirs: tuple[Path, ...] = ()
    root_capacities: tuple[int, ...] = ()

    @property
    def striped(self) -> bool:
        """Whether the tier spreads its blocks over several roots."""
        return len(self.root_dirs) > 1

    @property
    def root_set(self) -> tuple[str, ...]:
        """What each root's header records: every root, sorted (empty for one root)."""
        return tuple(sorted(str(r) for r in self.root_dirs)) if self.striped else ()

    def for_root(self, index: int) -> FsTierConfig:
        """The config of root ``index`` alone."""
        root, capacity = self.root_dirs[index], self.root_capacities[index]
        return replace(
            self,
            root_dir=root,
            capacity_bytes=capacity,
            root_dirs=(root,),
            root_capacities=(capacity,),
        )

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> FsTierConfig:
        """Validate the tier's keyword options (every key of ``FileSystemTier.__init__``).

        The tier's constructor is the one place that lists the keys and their
        defaults; this checks their values, creates ``root_dir`` when allowed
        and reads the authentication key. Raises ConfigError naming the key.
        """
        capacity_bytes = options["capacity_bytes"]
        capacity_blocks = options["capacity_blocks"]
        sync_interval_s = options["sync_interval_s"]
        eviction_policy = options["eviction_policy"]
        preallocate = options["preallocate"]
        roots = _check_root_dirs(
            options["root_dir"], options["root_dirs"], options["create_root_dir"]
        )
        n_read = _positive_int("n_read_threads", options["n_read_threads"], 256)
        n_write = _positive_int("n_write_threads", options["n_write_threads"], 256)
        backend = _choice("io_backend", options["io_backend"], IO_BACKENDS)
        durable = _choice("durability", options["durability"], DURABILITY_POLICIES)
        if (
            isinstance(sync_interval_s, bool)
            or not isinstance(sync_interval_s, (int, float))
            or not 0 < sync_interval_s <= 3600
        ):
            raise ConfigError(
                f"fs tier: sync_interval_s must be a number of seconds in (0, 3600], "
                f"got {sync_interval_s!r}"
            )
        policy = resolve_policy(eviction_policy, key="fs tier: eviction_policy")
        slab = parse_size("slab_bytes", options["slab_bytes"])
        if slab < 4 * KiB:
            raise ConfigError(f"fs tier: slab_bytes must be at least 4KiB, got {slab}")
        depth = _positive_int("queue_depth", options["queue_depth"], 4096)
        max_io = parse_size("max_io_bytes", options["max_io_bytes"])
        if max_io < 4 * KiB:
            raise ConfigError(f"fs tier: max_io_bytes must be at least 4KiB, got {max_io}")
        mismatch = _choice(
            "on_layout_mismatch", options["on_layout_mismatch"], LAYOUT_MISMATCH_ACTIONS
        )
        if not isinstance(preallocate, bool):
            raise ConfigError(f"fs tier: preallocate must be true or false, got {preallocate!r}")
        if capacity_blocks is not None:
            if capacity_bytes is not None:
                raise ConfigError("fs tier: give capacity_bytes or capacity_blocks, not both")
            blocks = _positive_int("capacity_blocks", capacity_blocks)
            capacities = (0,) * len(roots)  # known at open, once the block size is
        else:
            blocks = None
            striped = len(roots) > 1
            capacities = tuple(_check_capacity(root, capacity_bytes, striped) for root in roots)
        return cls(
            root_dir=roots[0],
            capacity_bytes=capacities[0],
            root_dirs=roots,
            root_capacities=capacities,
            capacity_blocks=blocks,
            n_read_threads=n_read,
            n_write_threads=n_write,
            io_backend=backend,  # type: ignore[arg-type]
            direct_io=_direct_io(options["direct_io"]),
            durability=durable,  # type: ignore[arg-type]
            sync_interval_s=float(sync_interval_s),
            eviction_policy=policy.label,
            policy=policy,
            slab_bytes=slab,
            queue_depth=depth,
            max_io_bytes=max_io,
            on_layout_mismatch=mismatch,  # type: ignore[arg-type]
            preallocate=preallocate,
            authenticator=authenticator_from_options(options, "fs tier: "),
        )


#: More roots than drives a server carries is a config mistake, not a layout.
MAX_ROOT_DIRS = 64


def _check_root_dirs(root_dir: object, root_dirs: object, create: bool) -> tuple[Path, ...]:
    """Every root of the tier: ``root_dir`` alone, or each of ``root_dirs``, checked."""
    if root_dir is not None and root_dirs is not None:
        raise ConfigError("fs tier: give root_dir or root_dirs, not both")
    if root_dirs is None:
        if root_dir is None:
            raise ConfigError("fs tier: root_dir (or root_dirs, a list of directories) is required")
        return (_check_root_dir(root_dir, create),)
    if not isinstance(root_dirs, (list, tuple)) or not root_dirs:
        raise ConfigError(
            f"fs tier: root_dirs must be a non-empty list of directories, got {root_dirs!r}"
        )
    if len(root_dirs) > MAX_ROOT_DIRS:
        raise ConfigError(
            f"fs tier: root_dirs lists {len(root_dirs)} directories; at most {MAX_ROOT_DIRS}"
        )
    # Striped: a drive that fails with an I/O error is not a config mistake; the open
    # starts it out of service (one ERROR line) and the tier serves with the others.
    striped = len(root_dirs) > 1
    roots = tuple(_check_root_dir(r, create, defer_io_errors=striped) for r in root_dirs)
    seen: dict[tuple[int, int], Path] = {}
    for root in roots:
        try:
            st = root.stat()
        except OSError:  # a failing drive (deferred above): it cannot be another root
            continue
        first = seen.setdefault((st.st_dev, st.st_ino), root)
        if first is not root:
            raise ConfigError(
                f"fs tier: root_dirs lists one directory twice ({str(first)!r} and {str(root)!r})"
            )
    return roots


#: Errors of a drive, not of the configuration: deferred to the open for a striped tier.
_DRIVE_ERRNOS = frozenset(
    {errno.EIO, errno.ENXIO, errno.ENODEV, errno.ESTALE, errno.EROFS, errno.ENOTCONN}
)


def _check_root_dir(root_dir: object, create: bool, *, defer_io_errors: bool = False) -> Path:
    if not isinstance(root_dir, (str, os.PathLike)) or not os.fspath(root_dir):
        raise ConfigError(f"fs tier: root_dir must be a directory path, got {root_dir!r}")
    root = Path(os.fspath(root_dir)).expanduser().absolute()
    try:
        _check_usable(root, create)
    except (OSError, ConfigError) as exc:
        cause = exc if isinstance(exc, OSError) else exc.__cause__
        if defer_io_errors and isinstance(cause, OSError) and cause.errno in _DRIVE_ERRNOS:
            return root
        if isinstance(exc, OSError):
            raise ConfigError(f"fs tier: root_dir {str(root)!r}: {exc.strerror or exc}") from exc
        raise
    return root


def _check_usable(root: Path, create: bool) -> None:
    """Exists (or is created), is a directory we own, and takes a file (ConfigError)."""
    if not root.exists():
        if not create:
            raise ConfigError(f"fs tier: root_dir {str(root)!r} does not exist")
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"fs tier: root_dir {str(root)!r} does not exist and cannot be created: "
                f"{exc.strerror or exc}"
            ) from exc
    if not root.is_dir():
        raise ConfigError(f"fs tier: root_dir {str(root)!r} is not a directory")
    check_root_permissions(root.stat(), root)  # checked again on the open directory
    # os.access is not enough (root bypasses mode bits, read-only mounts): try it.
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=root)
    except OSError as exc:
        raise ConfigError(
            f"fs tier: root_dir {str(root)!r} is not writable: {exc.strerror or exc}"
        ) from exc
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def check_capacity_fits(root: Path, capacity: int, what: str) -> None:
    """Raise ConfigError if the filesystem of ``root`` cannot hold ``capacity`` bytes of slabs."""
    usage = shutil.disk_usage(root)
    holdable = usage.free + existing_slab_bytes(root)
    if capacity > holdable:
        raise ConfigError(
            f"fs tier: {what}={capacity / GiB:.2f} GiB but the filesystem "
            f"of root_dir {str(root)!r} can hold only {holdable / GiB:.2f} GiB "
            f"({usage.free / GiB:.2f} GiB free + {SLAB_GLOB_PREFIX}* files already there)"
        )


def _check_capacity(root: Path, capacity_bytes: int | str | None, striped: bool = False) -> int:
    try:
        usage = shutil.disk_usage(root)
        # Slab files already here count as room: they are reused, not added to.
        holdable = usage.free + existing_slab_bytes(root)
    except OSError as exc:
        if striped and exc.errno in _DRIVE_ERRNOS and capacity_bytes is not None:
            return _capacity_of(capacity_bytes)  # a failing drive: the open takes it out
        raise ConfigError(
            f"fs tier: cannot read the free space of root_dir {str(root)!r} "
            f"({exc.strerror or exc})"
            + ("; set capacity_bytes explicitly" if capacity_bytes is None else "")
        ) from exc
    if capacity_bytes is None:
        capacity = min(DEFAULT_CAPACITY_BYTES, holdable // 2)
        if capacity < 64 * MiB:
            raise ConfigError(
                f"fs tier: the filesystem of root_dir {str(root)!r} has only "
                f"{usage.free / MiB:.0f} MiB free; set capacity_bytes explicitly"
            )
        return capacity
    capacity = _capacity_of(capacity_bytes)
    check_capacity_fits(root, capacity, f"capacity_bytes={capacity}")
    return capacity


def _capacity_of(capacity_bytes: int | str) -> int:
    capacity = parse_size("capacity_bytes", capacity_bytes)
    if capacity < 4 * KiB:
        raise ConfigError(f"fs tier: capacity_bytes must be at least 4KiB, got {capacity}")
    return capacity
