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
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tiering.errors import ConfigError
from tiering.policies import POLICY_NAMES

logger = logging.getLogger(__name__)

DEFAULT_EVICTION_POLICY = "lru"
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
DEFAULT_FAILED_PROMOTION_BACKOFF_S = 10.0

#: Keys this package reads. Other keys belong to the engine (vLLM puts e.g.
#: ``spec_name`` and ``spec_module_path`` in the same dict) and are ignored,
#: with a warning when they look like a misspelling of one of these.
KNOWN_KEYS = (
    "cpu_bytes_to_use",
    "block_size",
    "eviction_policy",
    "secondary_tiers",
    "store_threshold",
    "shutdown_timeout_s",
    "failed_promotion_backoff_s",
    "backfill_earlier_tiers",
    "metrics_port",
    "metrics_host",
)


@dataclass(frozen=True, slots=True)
class TieringConfig:
    """The validated, immutable form of ``kv_connector_extra_config``.

    ``block_size`` is the number of tokens per offloaded block (None: the GPU
    block size). ``secondary_tiers`` are read-only copies of the user's tier
    dicts, each with a non-empty string ``"type"``. ``metrics_port`` (None:
    off; 0: any free port) serves the ``kv_tiering_*`` Prometheus series on
    ``metrics_host`` from the process that builds the manager.
    """

    cpu_bytes_to_use: int
    block_size: int | None = None
    eviction_policy: str = DEFAULT_EVICTION_POLICY
    secondary_tiers: tuple[Mapping[str, Any], ...] = ()
    store_threshold: int = 0
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    failed_promotion_backoff_s: float = DEFAULT_FAILED_PROMOTION_BACKOFF_S
    backfill_earlier_tiers: bool = True
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"

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
        return cls(
            cpu_bytes_to_use=_positive_int(
                extra_config, "cpu_bytes_to_use", "a positive integer number of bytes"
            ),
            block_size=_optional_block_size(extra_config),
            eviction_policy=_eviction_policy(extra_config),
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


# -- value checks ---------------------------------------------------------------------------


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
        raise ConfigError(f"{key} must be {accepted}, got {value!r}")
    return number


def _optional_block_size(extra: Mapping[str, Any]) -> int | None:
    if extra.get("block_size") is None:
        return None
    return _positive_int(
        extra, "block_size", "a positive integer number of tokens per offloaded block"
    )


def _eviction_policy(extra: Mapping[str, Any]) -> str:
    value = _get(extra, "eviction_policy", DEFAULT_EVICTION_POLICY)
    accepted = " or ".join(repr(name) for name in POLICY_NAMES)
    if not isinstance(value, str) or value.strip().lower() not in POLICY_NAMES:
        raise ConfigError(f"eviction_policy must be {accepted}, got {value!r}")
    return value.strip().lower()


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
                f"registered tier type or 'package.module:Class', got {tier_type!r}"
            )
        bad_keys = [k for k in entry if not isinstance(k, str)]
        if bad_keys:
            raise ConfigError(
                f"secondary_tiers[{position}] ({tier_type}): keys must be strings, "
                f"got {bad_keys[0]!r}"
            )
        tiers.append(MappingProxyType(dict(entry)))
    return tuple(tiers)


def _store_threshold(extra: Mapping[str, Any]) -> int:
    value = _get(extra, "store_threshold", 0)
    number = _integral(value)
    if number is None or number < 0:
        raise ConfigError(f"store_threshold must be 0 or 1 (store on first offload), got {value!r}")
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
        raise ConfigError(f"{key} must be {kind} finite number of seconds, got {value!r}")
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
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _warn_about_likely_typos(extra: Mapping[str, Any]) -> None:
    for key in extra:
        if not isinstance(key, str) or key in KNOWN_KEYS:
            continue
        close = difflib.get_close_matches(key, KNOWN_KEYS, n=1, cutoff=0.8)
        if close:
            logger.warning(
                "kv_connector_extra_config key %r is not used by kv-tiering; did you mean %r?",
                key,
                close[0],
            )
