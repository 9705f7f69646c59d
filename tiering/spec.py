"""``TieringOffloadingSpec``: the whole tiering stack, built from ``kv_connector_extra_config``.

This module never imports vLLM: the engine adapter passes the KV layout as
plain numbers, either the bytes of one offloaded block::

    spec = TieringOffloadingSpec(extra_config, block_bytes=2 << 20)

or the engine's GPU geometry, from which ``block_size`` (tokens per offloaded
block, from the config) derives the block bytes as vLLM does::

    spec = TieringOffloadingSpec(
        extra_config, gpu_block_size=16, gpu_page_bytes=131072, world_size=2,
        layout_fingerprint="llama-3-8b/bf16/tp2",
    )
    manager = spec.get_manager()     # built once; spec.shutdown() shuts it down

The constructor checks every key of the stack and, for each tier entry, its
type, option names (unknown or missing options) and the runtime's own keys
(``job_timeout_s``, ...), raising a
:class:`~tiering.core.errors.ConfigError` naming the key before any memory is
allocated or any tier is started. ``get_manager`` then builds the CPU primary
tier, each secondary tier in order (a tier's option values are checked by its
class there, with the tier's position and type in the error), and the
manager; if anything fails, what was already built is shut down again before
the error propagates: nothing is left half-built.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tiering.config import BlockGeometry, TieringConfig, check_host_memory
from tiering.core.errors import ConfigError, TierClosedError
from tiering.core.jobs import SecondaryTierManager
from tiering.manager import TieringOffloadingManager

logger = logging.getLogger(__name__)

#: Row alignment the primary buffer needs for O_DIRECT I/O (``require_alignment``).
ALIGNMENT_BYTES = 4096


class TieringOffloadingSpec:
    """Validated configuration plus geometry; builds the :class:`TieringOffloadingManager`.

    Geometry, exactly one of: ``block_bytes`` (bytes of one offloaded block,
    i.e. one primary row; the config's ``block_size`` is then only the token
    count reported in events), or ``gpu_block_size`` + ``gpu_page_bytes`` (+
    ``world_size``): tokens per GPU block and bytes of one GPU block, all
    layers, on one worker.

    Other arguments: ``layout_fingerprint`` names the KV layout for
    persistent tiers; ``enable_events`` turns on stored/removed events;
    ``shared_name`` puts the primary buffer in named shared memory so worker
    processes can attach; ``require_alignment`` demands 4 KiB-multiple rows
    (for O_DIRECT tiers); ``name`` and ``metrics_registry`` label and route
    the manager's Prometheus metrics.
    """

    def __init__(
        self,
        extra_config: Mapping[str, Any],
        *,
        block_bytes: int | None = None,
        gpu_block_size: int | None = None,
        gpu_page_bytes: int | None = None,
        world_size: int = 1,
        layout_fingerprint: str = "",
        enable_events: bool = True,
        shared_name: str | None = None,
        require_alignment: bool = True,
        name: str = "tiering",
        metrics_registry: Any = None,
    ) -> None:
        self.config = TieringConfig.from_extra_config(extra_config)
        self.geometry = _geometry(
            self.config,
            block_bytes=block_bytes,
            gpu_block_size=gpu_block_size,
            gpu_page_bytes=gpu_page_bytes,
            world_size=world_size,
        )
        if require_alignment and self.geometry.block_bytes % ALIGNMENT_BYTES:
            source = (
                f"block_bytes={block_bytes}"
                if block_bytes is not None
                else f"block_size={self.geometry.block_size} gives offloaded blocks of "
                f"{self.geometry.block_bytes} bytes, which is"
            )
            raise ConfigError(
                f"{source} not a multiple of {ALIGNMENT_BYTES} as aligned (O_DIRECT) I/O "
                "requires; choose a block_size whose blocks are 4 KiB multiples, or build "
                "the spec with require_alignment=False"
            )
        if not isinstance(layout_fingerprint, str):
            raise ConfigError(
                f"layout_fingerprint must be a string, got {type(layout_fingerprint).__name__}"
            )
        self.num_blocks = self.geometry.num_blocks(self.config.cpu_bytes_to_use)
        check_host_memory(
            "cpu_bytes_to_use",
            self.num_blocks * self.geometry.block_bytes,
            shared=shared_name is not None,
        )
        _check_tier_types(self.config)
        self.layout_fingerprint = layout_fingerprint
        self.enable_events = enable_events
        self._shared_name = shared_name
        self._require_alignment = require_alignment
        self._name = name
        self._metrics_registry = metrics_registry
        self._manager: TieringOffloadingManager | None = None
        self._shut_down = False

    @property
    def block_bytes(self) -> int:
        """Bytes of one offloaded block (one primary row)."""
        return self.geometry.block_bytes

    @property
    def block_size(self) -> int | None:
        """Tokens per offloaded block (None when only bytes were given and no block_size)."""
        return self.geometry.block_size

    @property
    def block_size_factor(self) -> int:
        """GPU blocks per offloaded block."""
        return self.geometry.block_size_factor

    def get_manager(self) -> TieringOffloadingManager:
        """The manager over the whole stack, built on the first call.

        Raises the first construction error (a :class:`ConfigError` for a
        bad tier configuration) after shutting down whatever was already
        built, so a failed call leaves no thread, connection or buffer behind
        and can be retried.
        """
        if self._shut_down:
            raise TierClosedError("this TieringOffloadingSpec has been shut down")
        if self._manager is None:
            self._manager = self._build()
        return self._manager

    def shutdown(self) -> None:
        """Shut the manager (and so every tier) down, if it was built. Idempotent."""
        self._shut_down = True
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.shutdown()

    def _build(self) -> TieringOffloadingManager:
        # Imported here: building needs the runtime, validating a config does not.
        from tiering.primary import CPUPrimaryTier
        from tiering.registry import create_secondary_tier

        config = self.config
        if config.metrics_port is not None:
            # Here, not in __init__: vLLM builds specs in worker processes too, and only
            # the process that builds the manager has series to serve.
            from tiering.metrics.server import serve_metrics

            served = serve_metrics(config.metrics_port, config.metrics_host)
            logger.info("serving kv_tiering_* metrics at %s", served.url)
        shared_name = self._shared_name
        if shared_name is None and any(
            tier.get("isolation") == "process" for tier in config.secondary_tiers
        ):
            # A tier in a child process attaches to the primary buffer by name.
            from tiering.primary.host_buffer import make_shared_name

            shared_name = make_shared_name()
        primary = CPUPrimaryTier(
            self.num_blocks,
            self.block_bytes,
            config.policy,
            enable_events=self.enable_events,
            shared_name=shared_name,
            require_alignment=self._require_alignment,
        )
        tiers: list[SecondaryTierManager] = []
        try:
            for position, tier_config in enumerate(config.secondary_tiers):
                tier = create_secondary_tier(
                    dict(tier_config),
                    primary.kv_view,
                    position=position,
                    layout_fingerprint=self.layout_fingerprint,
                    primary_buffer=primary.buffer,
                )
                tiers.append(tier)
                logger.info("created secondary tier #%d (%s)", position, tier.tier_type)
            manager = TieringOffloadingManager(
                primary,
                tiers,
                enable_events=self.enable_events,
                shutdown_timeout_s=config.shutdown_timeout_s,
                failed_promotion_backoff_s=config.failed_promotion_backoff_s,
                backfill_earlier_tiers=config.backfill_earlier_tiers,
                cascade_max_pinned_fraction=config.cascade_max_pinned_fraction,
                cascade_admission=(
                    None
                    if config.cascade_admission is None
                    else config.cascade_admission.build(self.num_blocks)
                ),
                event_block_size=self.block_size,
                name=self._name,
                metrics_registry=self._metrics_registry,
            )
        except BaseException:
            _shut_down_partial(tiers, primary)
            raise
        logger.info(
            "created TieringOffloadingManager: CPU primary tier (%s, %d blocks of %d bytes) "
            "and %d secondary tier(s)",
            config.eviction_policy,
            self.num_blocks,
            self.block_bytes,
            len(tiers),
        )
        return manager


def build_manager(extra_config: Mapping[str, Any], **geometry: Any) -> TieringOffloadingManager:
    """Shorthand: ``TieringOffloadingSpec(extra_config, **geometry).get_manager()``."""
    return TieringOffloadingSpec(extra_config, **geometry).get_manager()


def _geometry(
    config: TieringConfig,
    *,
    block_bytes: int | None,
    gpu_block_size: int | None,
    gpu_page_bytes: int | None,
    world_size: int,
) -> BlockGeometry:
    gpu_given = gpu_block_size is not None or gpu_page_bytes is not None
    if block_bytes is not None and gpu_given:
        raise ConfigError(
            "give either block_bytes or gpu_block_size + gpu_page_bytes to "
            "TieringOffloadingSpec, not both"
        )
    if block_bytes is not None:
        if world_size != 1:
            raise ConfigError("world_size applies to gpu_page_bytes; block_bytes is already total")
        return BlockGeometry(block_bytes=block_bytes, block_size=config.block_size)
    if gpu_block_size is None or gpu_page_bytes is None:
        raise ConfigError(
            "TieringOffloadingSpec needs the KV geometry: block_bytes, or both "
            "gpu_block_size and gpu_page_bytes"
        )
    return BlockGeometry.from_gpu_pages(
        gpu_block_size=gpu_block_size,
        gpu_page_bytes=gpu_page_bytes,
        block_size=config.block_size,
        world_size=world_size,
    )


def _check_tier_types(config: TieringConfig) -> None:
    """Resolve every tier's type and check its option names now, before anything is built."""
    from tiering.registry import check_tier_config

    for position, tier_config in enumerate(config.secondary_tiers):
        check_tier_config(tier_config, position=position)


def _shut_down_partial(tiers: list[SecondaryTierManager], primary: Any) -> None:
    """Undo a half-built stack, newest first; errors here are logged, not raised."""
    for tier in reversed(tiers):
        try:
            tier.shutdown()
        except Exception:
            logger.exception("shutting down tier %s after a failed build", tier.tier_type)
    try:
        primary.shutdown()
    except Exception:
        logger.exception("shutting down the primary tier after a failed build")
