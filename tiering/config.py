"""Configuration of the tiering stack, parsed from vLLM's ``kv_connector_extra_config``.

Users write the same dict they would give vLLM's own tiering spec::

    {
        "cpu_bytes_to_use": 10737418240,
        "block_size": 16,
        "eviction_policy": "lru",
        "secondary_tiers": [{"type": "memory", "capacity_blocks": 100000}],
    }

:meth:`TieringConfig.from_extra_config` checks every value and raises
:class:`~tiering.errors.ConfigError` naming the key and what is accepted.
:class:`BlockGeometry` turns the KV layout (given as plain numbers, so this
module never imports vLLM) and ``block_size`` into the bytes of one offloaded
block and the number of primary blocks. Tier-specific keys are checked by the
tier registry when the tier is built.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tiering.errors import ConfigError
from tiering.policies import PolicyChoice, resolve_admission, resolve_policy

logger = logging.getLogger(__name__)

DEFAULT_EVICTION_POLICY = "lru"
#: Where POSIX shared memory lives (a tmpfs with its own size limit).
SHM_DIR = "/dev/shm"
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
DEFAULT_FAILED_PROMOTION_BACKOFF_S = 10.0
#: Back-pressure: the share of the primary tier one secondary tier's cascades may pin.
DEFAULT_CASCADE_MAX_PINNED_FRACTION = 0.25

#: Keys this package reads. Other keys belong to the engine (vLLM puts e.g.
#: ``spec_name`` and ``spec_module_path`` in the same dict) and are ignored,
#: with a warning when they look like a misspelling of one of these.
KNOWN_KEYS = (
    "cpu_bytes_to_use",
    "block_size",
    "eviction_policy",
    "cache_policy_module_path",
    "cascade_admission",
    "secondary_tiers",
    "store_threshold",
    "shutdown_timeout_s",
    "failed_promotion_backoff_s",
    "backfill_earlier_tiers",
    "cascade_max_pinned_fraction",
    "metrics_port",
    "metrics_host",
)


@dataclass(frozen=True, slots=True)
class TieringConfig:
    """The validated, immutable form of ``kv_connector_extra_config``.

    ``block_size`` is the number of tokens per offloaded block (None: the GPU
    block size). ``secondary_tiers`` are read-only copies of the user's tier
    dicts, each with a non-empty string ``"type"``. ``eviction_policy`` is the
    policy's label (``"lru"``, ``"kvaware(probation_ghosts=2)"``, ``"pkg.mod:Class"``);
    ``policy`` is the resolved choice the primary tier builds (resolved from
    ``eviction_policy`` when not given). ``cascade_admission`` chooses which
    stored blocks are cascaded to the secondary tiers (None: all of them).
    ``metrics_port`` (None: off; 0: any free port) serves the ``kv_tiering_*``
    Prometheus series on ``metrics_host`` from the process that builds the manager.
    """

    cpu_bytes_to_use: int
    block_size: int | None = None
    eviction_policy: str = DEFAULT_EVICTION_POLICY
    secondary_tiers: tuple[Mapping[str, Any], ...] = ()
    store_threshold: int = 0
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    failed_promotion_backoff_s: float = DEFAULT_FAILED_PROMOTION_BACKOFF_S
    backfill_earlier_tiers: bool = True
    cascade_max_pinned_fraction: float = DEFAULT_CASCADE_MAX_PINNED_FRACTION
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"
    cascade_admission: PolicyChoice | None = None
    policy: PolicyChoice = None  # type: ignore[assignment]  # set by __post_init__

    def __post_init__(self) -> None:
        given: object = self.policy  # None unless a resolved choice was passed
        if given is None:
            object.__setattr__(self, "policy", resolve_policy(self.eviction_policy))

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any]) -> TieringConfig:
        """Parse and validate ``extra_config`` (raises :class:`ConfigError`, naming the key)."""
        if not isinstance(extra_config, Mapping):
            raise ConfigError(
                "kv_connector_extra_config must be a mapping (a JSON object), "
                f"got {type(extra_config).__name__}"
            )
        _warn_about_likely_typos(extra_config)
        if "cpu_bytes_to_use" not in extra_config:
            raise ConfigError(
                "cpu_bytes_to_use is required: the bytes of host memory for the CPU primary "
                "tier, e.g. 10737418240 for 10 GiB"
            )
        policy = _eviction_policy(extra_config)
        return cls(
            cpu_bytes_to_use=_cpu_bytes(extra_config),
            block_size=_optional_block_size(extra_config),
            eviction_policy=policy.label,
            policy=policy,
            secondary_tiers=_secondary_tiers(extra_config),
            store_threshold=_store_threshold(extra_config),
            shutdown_timeout_s=_seconds(
                extra_config, "shutdown_timeout_s", DEFAULT_SHUTDOWN_TIMEOUT_S, positive=True
            ),
            failed_promotion_backoff_s=_seconds(
                extra_config,
                "failed_promotion_backoff_s",
                DEFAULT_FAILED_PROMOTION_BACKOFF_S,
                positive=False,
            ),
            backfill_earlier_tiers=_flag(extra_config, "backfill_earlier_tiers", True),
            cascade_max_pinned_fraction=pinned_fraction(extra_config),
            cascade_admission=_cascade_admission(extra_config),
            metrics_port=_metrics_port(extra_config),
            metrics_host=_metrics_host(extra_config),
        )


@dataclass(frozen=True, slots=True)
class BlockGeometry:
    """The size of one offloaded block.

    ``block_bytes`` is one row of the primary buffer: the KV bytes of
    ``block_size`` tokens, all layers, all workers. ``block_size`` (tokens per
    offloaded block) is None when the caller gave bytes only.
    ``block_size_factor`` is the number of GPU blocks per offloaded block.
    """

    block_bytes: int
    block_size: int | None = None
    block_size_factor: int = 1

    def __post_init__(self) -> None:
        if _not_int(self.block_bytes) or self.block_bytes <= 0:
            raise ConfigError(f"block_bytes must be a positive integer, got {self.block_bytes!r}")
        if self.block_size is not None and (_not_int(self.block_size) or self.block_size <= 0):
            raise ConfigError(f"block_size must be a positive integer, got {self.block_size!r}")
        if _not_int(self.block_size_factor) or self.block_size_factor <= 0:
            raise ConfigError(
                f"block_size_factor must be a positive integer, got {self.block_size_factor!r}"
            )

    @classmethod
    def from_gpu_pages(
        cls,
        *,
        gpu_block_size: int,
        gpu_page_bytes: int,
        block_size: int | None = None,
        world_size: int = 1,
    ) -> BlockGeometry:
        """Geometry of offloaded blocks made of ``block_size // gpu_block_size`` GPU blocks.

        ``gpu_page_bytes`` is the bytes of one GPU block (all layers) on one
        worker; the primary row holds the pages of all ``world_size`` workers.
        ``block_size`` (from the config) defaults to ``gpu_block_size`` and
        must be a positive multiple of it.
        """
        for name, value in (
            ("gpu_block_size", gpu_block_size),
            ("gpu_page_bytes", gpu_page_bytes),
            ("world_size", world_size),
        ):
            if _not_int(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        tokens = gpu_block_size if block_size is None else block_size
        if _not_int(tokens) or tokens <= 0 or tokens % gpu_block_size:
            raise ConfigError(
                f"block_size must be a positive multiple of the GPU block size "
                f"({gpu_block_size} tokens), got {block_size!r}"
            )
        factor = tokens // gpu_block_size
        return cls(
            block_bytes=gpu_page_bytes * factor * world_size,
            block_size=tokens,
            block_size_factor=factor,
        )

    def num_blocks(self, cpu_bytes_to_use: int) -> int:
        """Primary blocks that fit in ``cpu_bytes_to_use`` (raises if not even one)."""
        count = cpu_bytes_to_use // self.block_bytes
        if count <= 0:
            raise ConfigError(
                f"cpu_bytes_to_use={cpu_bytes_to_use} is smaller than one offloaded block "
                f"({self.block_bytes} bytes); give at least {self.block_bytes} bytes"
            )
        return count


# -- the host's memory ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HostMemory:
    """Memory this process can still take: ``available_bytes`` of ``total_bytes``,
    ``source`` saying where the figure comes from (for messages)."""

    available_bytes: int
    total_bytes: int
    source: str


def host_memory() -> HostMemory | None:
    """What this machine (or its cgroup, if that is tighter) has available; None if unknown.

    Linux's ``MemAvailable`` counts free memory plus what the kernel can reclaim
    (page cache), which is what a new buffer can be given without swapping; a
    container's ``memory.max`` (cgroup v2) caps it further.
    """
    meminfo = _read_meminfo()
    if meminfo is None:
        return None
    available, total = meminfo
    memory = HostMemory(available, total, "MemAvailable in /proc/meminfo")
    limit = _cgroup_limit()
    if limit is not None:
        cgroup_max, cgroup_used = limit
        if cgroup_max - cgroup_used < memory.available_bytes:
            memory = HostMemory(
                max(0, cgroup_max - cgroup_used), cgroup_max, "this container's cgroup memory.max"
            )
    return memory


def _read_meminfo() -> tuple[int, int] | None:
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    fields[name] = int(parts[0]) * 1024  # the file says kB, meaning KiB
    except (OSError, ValueError):
        return None
    if "MemAvailable" not in fields or "MemTotal" not in fields:
        return None
    return fields["MemAvailable"], fields["MemTotal"]


def _cgroup_limit() -> tuple[int, int] | None:
    try:
        with open("/proc/self/cgroup", encoding="ascii") as cgroup:
            relative = next((line.strip()[3:] for line in cgroup if line.startswith("0::")), None)
        if relative is None:
            return None
        base = "/sys/fs/cgroup" + relative.rstrip("/")
        with open(base + "/memory.max", encoding="ascii") as limit_file:
            limit = limit_file.read().strip()
        if limit == "max":
            return None
        with open(base + "/memory.current", encoding="ascii") as current_file:
            current = int(current_file.read().strip())
        return int(limit), current
    except (OSError, ValueError):
        return None


def check_host_memory(
    key: str,
    asked_bytes: int,
    memory: HostMemory | None = None,
    *,
    shared: bool = False,
    shm_free_bytes: int | None = None,
) -> None:
    """Raise :class:`ConfigError` naming ``key`` if ``asked_bytes`` is more than the host has
    available, before anything is allocated (an allocation that size would fail with ENOMEM
    after a traceback, or get the process killed later).

    With ``shared`` the buffer is a POSIX shared-memory object, which must also fit in
    ``/dev/shm`` (a container's is often 64 MiB unless ``--shm-size`` says otherwise).
    ``memory`` and ``shm_free_bytes`` override what the machine says (for tests).
    """
    from tiering.units import format_bytes

    memory = memory if memory is not None else host_memory()
    if memory is not None and asked_bytes > memory.available_bytes:
        raise ConfigError(
            f"{key}={format_bytes(asked_bytes)} ({asked_bytes} bytes) is more memory than this "
            f"machine has available: {format_bytes(memory.available_bytes)} available of "
            f"{format_bytes(memory.total_bytes)} ({memory.source}); lower {key} to fit "
            "(the CPU primary tier allocates all of it up front)"
        )
    if not shared:
        return
    if shm_free_bytes is None:
        try:
            shm = os.statvfs(SHM_DIR)
        except OSError:
            return
        shm_free_bytes = shm.f_bavail * shm.f_frsize
    if asked_bytes > shm_free_bytes:
        raise ConfigError(
            f"{key}={format_bytes(asked_bytes)} ({asked_bytes} bytes) does not fit in "
            f"{SHM_DIR}, where the primary buffer is shared with the engine's workers: "
            f"{format_bytes(shm_free_bytes)} free there; enlarge it (docker run --shm-size, "
            f"a Kubernetes emptyDir with medium: Memory) or lower {key}"
        )


# -- value checks ---------------------------------------------------------------------------


class _ShortRepr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 3 * _SHOWN_INT_DIGITS:  # past Python's digit limit repr() raises
            return f"<an integer of about {int(x.bit_length() * 0.30103)} digits>"
        return super().repr_int(x, level)


_SHOWN_INT_DIGITS = 1000
_SHOWN = _ShortRepr()
_SHOWN.maxlevel = 3
_SHOWN.maxstring = 60
_SHOWN.maxother = 80
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 4
_SHOWN.maxlong = 40


def shown(value: object) -> str:
    """``repr(value)`` cut to a readable length, for error messages.

    A config value can be huge (a long string, or a YAML structure that aliases
    expand): messages show its start, never the whole thing.
    """
    return _SHOWN.repr(value)


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _get(extra: Mapping[str, Any], key: str, default: Any) -> Any:
    """``extra[key]``, with an absent key or a JSON ``null`` meaning the default."""
    value = extra.get(key)
    return default if value is None else value


def _integral(value: object) -> int | None:
    """``value`` as an int if it is an int or an integral float (JSON's 1e10), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def _positive_int(extra: Mapping[str, Any], key: str, accepted: str) -> int:
    value = extra[key]
    number = _integral(value)
    if number is None or number <= 0:
        raise ConfigError(f"{key} must be {accepted}, got {shown(value)}")
    return number


def _cpu_bytes(extra: Mapping[str, Any]) -> int:
    from tiering.units import config_bytes  # tiering.units quotes values with shown()

    value = extra["cpu_bytes_to_use"]
    try:
        number = config_bytes("cpu_bytes_to_use", value)
    except ConfigError as exc:
        if "larger than any machine" in str(exc):
            raise
        number = 0
    if number <= 0:
        raise ConfigError(
            "cpu_bytes_to_use must be a positive integer number of bytes or a size with a "
            f"unit (e.g. 10737418240 or '10GiB'), got {shown(value)}"
        )
    return number


def _optional_block_size(extra: Mapping[str, Any]) -> int | None:
    if extra.get("block_size") is None:
        return None
    return _positive_int(
        extra, "block_size", "a positive integer number of tokens per offloaded block"
    )


def _eviction_policy(extra: Mapping[str, Any]) -> PolicyChoice:
    """A built-in name, ``pkg.mod:Class``, an entry point, or vLLM's class + module spelling."""
    value = _get(extra, "eviction_policy", DEFAULT_EVICTION_POLICY)
    module_path = _get(extra, "cache_policy_module_path", None)
    return resolve_policy(value, module_path=module_path)


def _cascade_admission(extra: Mapping[str, Any]) -> PolicyChoice | None:
    """None (cascade everything, no per-block work) unless a policy other than "all" is named."""
    value = _get(extra, "cascade_admission", None)
    if value is None:
        return None
    choice = resolve_admission(value)
    return None if choice.label == "all" else choice


def _secondary_tiers(extra: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    value = extra.get("secondary_tiers")
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
        raise ConfigError(
            'secondary_tiers must be a list of tier configurations like [{"type": "memory"}], '
            f"got {type(value).__name__}"
        )
    tiers: list[Mapping[str, Any]] = []
    for position, entry in enumerate(value):
        if not isinstance(entry, Mapping):
            raise ConfigError(
                f"secondary_tiers[{position}] must be a mapping with a 'type' key, "
                f"got {type(entry).__name__}"
            )
        tier_type = entry.get("type")
        if not isinstance(tier_type, str) or not tier_type.strip():
            raise ConfigError(
                f"secondary_tiers[{position}].type is required: a non-empty string naming a "
                f"registered tier type or 'package.module:Class', got {shown(tier_type)}"
            )
        bad_keys = [k for k in entry if not isinstance(k, str)]
        if bad_keys:
            raise ConfigError(
                f"secondary_tiers[{position}] ({tier_type}): keys must be strings, "
                f"got {shown(bad_keys[0])}"
            )
        tiers.append(MappingProxyType(dict(entry)))
    return tuple(tiers)


def _store_threshold(extra: Mapping[str, Any]) -> int:
    value = _get(extra, "store_threshold", 0)
    number = _integral(value)
    if number is None or number < 0:
        raise ConfigError(
            f"store_threshold must be 0 or 1 (store on first offload), got {shown(value)}"
        )
    if number >= 2:
        raise ConfigError(
            f"store_threshold={number} is not supported by the tiering spec: blocks are "
            "offloaded on first eviction; use 0 or 1, or leave store_threshold out"
        )
    return number


def _seconds(extra: Mapping[str, Any], key: str, default: float, *, positive: bool) -> float:
    value = _get(extra, key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        kind = "a positive" if positive else "a non-negative"
        raise ConfigError(f"{key} must be {kind} finite number of seconds, got {shown(value)}")
    return float(value)


def pinned_fraction(extra: Mapping[str, Any]) -> float:
    """``cascade_max_pinned_fraction``: a number in (0, 1] (raises naming the key)."""
    key = "cascade_max_pinned_fraction"
    value = _get(extra, key, DEFAULT_CASCADE_MAX_PINNED_FRACTION)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 < value <= 1
    ):
        raise ConfigError(
            f"{key} must be a number in (0, 1] (the share of the CPU primary tier one "
            f"secondary tier's cascades in flight may pin), got {shown(value)}"
        )
    return float(value)


def _metrics_port(extra: Mapping[str, Any]) -> int | None:
    value = _get(extra, "metrics_port", None)
    if value is None:
        return None
    from tiering.metrics_server import check_metrics_port

    return check_metrics_port(value)


def _metrics_host(extra: Mapping[str, Any]) -> str:
    value = _get(extra, "metrics_host", None)
    if value is None:
        return "0.0.0.0"
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"metrics_host must be a host name or address to listen on, got {value!r}"
        )
    if extra.get("metrics_port") is None:
        raise ConfigError("metrics_host is set but metrics_port is not: give the port too")
    return value


def _flag(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = _get(extra, key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {shown(value)}")
    return value


def _warn_about_likely_typos(extra: Mapping[str, Any]) -> None:
    for key in extra:
        if not isinstance(key, str) or key in KNOWN_KEYS:
            continue
        close = difflib.get_close_matches(key, KNOWN_KEYS, n=1, cutoff=0.8)
        if close:
            logger.warning(
                "kv_connector_extra_config key %s is not used by kv-tiering; did you mean %r?",
                shown(key),
                close[0],
            )
