"""Configuration of the tiering stack, parsed from vLLM's ``kv_connector_extra_config``.

Users write the same dict they would give vLLM's own tiering spec::

    {
        "cpu_bytes_to_use": 10737418240,
        "block_size": 16,
        "eviction_policy": "lru",
        "secondary_tiers": [{"type": "memory", "capacity_blocks": 100000}],
    }

:meth:`TieringConfig.from_extra_config` checks every value and raises
:class:`~tiering.core.errors.ConfigError` naming the key and what is accepted.
:class:`BlockGeometry` turns the KV layout (given as plain numbers, so this
module never imports vLLM) and ``block_size`` into the bytes of one offloaded
block and the number of primary blocks. Tier-specific keys are checked by the
tier registry when the tier is built.

This module owns the config's shape: the keys it knows (:data:`KNOWN_KEYS`, with a
warning for a likely misspelling), the immutable :class:`TieringConfig` assembled
from them, and :class:`BlockGeometry`. What each key accepts and defaults to is
checked in :mod:`tiering.config.checks`; whether the host can give the memory asked
for, in :mod:`tiering.primary.host_memory`. Both are importable from here too.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiering.config.checks import (
    DEFAULT_CASCADE_MAX_PINNED_FRACTION,
    DEFAULT_EVICTION_POLICY,
    DEFAULT_FAILED_PROMOTION_BACKOFF_S,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    _cascade_admission,
    _cpu_bytes,
    _eviction_policy,
    _flag,
    _metrics_host,
    _metrics_port,
    _not_int,
    _optional_block_size,
    _secondary_tiers,
    _seconds,
    _store_threshold,
    pinned_fraction,
)
from tiering.core.errors import ConfigError
from tiering.policies import PolicyChoice, resolve_policy
from tiering.primary.host_buffer import SHM_DIR
from tiering.primary.host_memory import HostMemory, check_host_memory, host_memory
from tiering.support.quoting import shown

logger = logging.getLogger(__name__)

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


def _warn_about_likely_typos(extra: Mapping[str, Any], also_known: tuple[str, ...] = ()) -> None:
    """A WARNING for each key that looks like a misspelling of one we read."""
    known = (*KNOWN_KEYS, *also_known)
    for key in extra:
        if not isinstance(key, str) or key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
        if close:
            logger.warning(
                "kv_connector_extra_config key %s is not used by kv-tiering; did you mean %r?",
                shown(key),
                close[0],
            )


__all__ = [
    "BlockGeometry",
    "KNOWN_KEYS",
    "TieringConfig",
    # defined in tiering.config.checks, tiering.primary.host_memory, tiering.primary.host_buffer and
    # tiering.support.quoting, and importable from here as they were before the split
    "DEFAULT_CASCADE_MAX_PINNED_FRACTION",
    "DEFAULT_EVICTION_POLICY",
    "DEFAULT_FAILED_PROMOTION_BACKOFF_S",
    "DEFAULT_SHUTDOWN_TIMEOUT_S",
    "SHM_DIR",
    "HostMemory",
    "check_host_memory",
    "host_memory",
    "pinned_fraction",
    "shown",
    # the readers the vLLM adapter reuses (tiering/integrations/vllm/)
    "_cascade_admission",
    "_flag",
    "_metrics_host",
    "_metrics_port",
    "_seconds",
    "_warn_about_likely_typos",
]
