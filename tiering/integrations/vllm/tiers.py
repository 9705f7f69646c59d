"""kv-tiering's async tiers as vLLM 0.33 secondary tiers.

vLLM's ``TieringOffloadingManager`` loads an out-of-tree tier from a
``secondary_tiers`` entry ``{"type": "<Class>", "module_path": "<module>",
**kwargs}`` and constructs ``Class(offloading_spec=..., primary_kv_view=...,
tier_type=..., backpressure_detector=..., **kwargs)``. Each class here is such
a tier: a subclass of vLLM's ``SecondaryTierManager`` that runs one of our
:class:`~tiering.tier.AsyncTier` s on its own event-loop thread through our
runtime (:class:`~tiering.runtime.AsyncTierManager`, built by
:func:`tiering.registry.create_secondary_tier`) and translates vLLM's contract
to ours. Every method runs under vLLM's manager lock and returns at once,
except ``drain_jobs`` (blocks by contract) and ``shutdown``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Iterable
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    Medium,
    OffloadingEvent,
    OffloadPolicy,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiering.config import pinned_fraction
from tiering.core.errors import ConfigError, TierClosedError
from tiering.core.keys import OffloadKey
from tiering.integrations.vllm import translate
from tiering.integrations.vllm.admission import OfferAdmission, admission_policy
from tiering.integrations.vllm.backpressure import PinnedShareDetector
from tiering.integrations.vllm.manager_keys import check_manager_keys
from tiering.integrations.vllm.positions import position_in_spec
from tiering.manager.backpressure import JobsInFlight
from tiering.metrics.secondary import SecondaryTierExport
from tiering.metrics.server import DEFAULT_METRICS_HOST, check_metrics_port, serve_metrics
from tiering.registry import create_secondary_tier
from tiering.runtime import AsyncTierManager, TierStats
from tiering.runtime.options import check_runtime_options

logger = logging.getLogger("tiering.integrations.vllm")

#: Import path users put in ``module_path``.
MODULE_PATH = "tiering.integrations.vllm"

#: How long a block whose promotion failed answers MISS (see ``failed_load_backoff_s``).
DEFAULT_FAILED_LOAD_BACKOFF_S = 10.0
#: Our tiers' ``shutdown_timeout_s`` under vLLM unless configured: vLLM's process manager
#: force-kills the engine core 5 s after SIGTERM (``vllm.v1.utils.shutdown``'s default), so
#: a tier given longer is killed before it has flushed, closed and logged its totals.
VLLM_SHUTDOWN_TIMEOUT_S = 4.0

_HIT_SOURCE = {Medium.CPU: CacheHitSource.HOST, Medium.STORAGE: CacheHitSource.DISK}


class KVTieringTier(SecondaryTierManager):  # type: ignore[misc]  # vLLM is untyped here
    """Any kv-tiering tier as a vLLM secondary tier; ``tier`` names which.

    ``{"type": "KVTieringTier", "module_path": "tiering.integrations.vllm",
    "tier": "fs", "root_dir": "/mnt/kv"}``: ``tier`` is one of our tier type
    names (``memory``, ``fs``, ``redis``, a registered or entry-point name) or
    a ``"package.module:Class"`` path to any :class:`~tiering.tier.AsyncTier`.

    Options read here (the rest configure the runtime - ``job_timeout_s``,
    ``shutdown_timeout_s``, ``name``... - or the tier itself, see
    :mod:`tiering.registry`):

    ``medium``                ``"STORAGE"`` (default) or ``"CPU"``: what vLLM
                              reports for hits served from this tier (DISK / HOST)
    ``locality``              ``"LOCAL"`` / ``"REMOTE"`` (vLLM's tier filters, events)
    ``enable_kv_events``      emit vLLM KV events for blocks stored in / evicted from
                              this tier (only when KV events are enabled globally)
    ``failed_load_backoff_s`` after a promotion of a block fails, answer MISS for
                              it this long (default: the top-level
                              ``failed_promotion_backoff_s``, else 10), so vLLM
                              recomputes it instead of retrying a doomed load
                              every step

    The top-level ``shutdown_timeout_s`` is each tier's default too; the other keys
    of our manager are refused (:mod:`tiering.integrations.vllm.manager_keys`).
    Without a ``backpressure`` config of vLLM's, the tier drops cascades when it
    falls behind its share of the CPU tier (``cascade_max_pinned_fraction``,
    :mod:`tiering.integrations.vllm.backpressure`).
    """

    medium: Any = Medium.STORAGE
    #: Our tier type the subclass always runs (None: the ``tier`` option says).
    fixed_tier: ClassVar[str | None] = None

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        tier: str | None = None,
        medium: str | None = None,
        locality: str | None = None,
        enable_kv_events: object = False,  # checked below: a bool (JSON may send anything)
        failed_load_backoff_s: float | None = None,
        **options: Any,
    ) -> None:
        extra = getattr(offloading_spec, "extra_config", None) or {}
        where = f"secondary tier {tier_type!r}"
        given = {  # the entry's options as vLLM passed them (to find its position)
            "tier": tier,
            "medium": medium,
            "locality": locality,
            "enable_kv_events": enable_kv_events,
            "failed_load_backoff_s": failed_load_backoff_s,
            **options,
        }
        # Back-pressure on by default: our rule unless the operator configured vLLM's.
        self._in_flight = JobsInFlight()
        self._pinned_share: PinnedShareDetector | None = None
        num_chunks = int(getattr(offloading_spec, "num_chunks", 0) or 0)
        if backpressure_detector is None:
            budget = int(num_chunks * pinned_fraction(extra))
            backpressure_detector = self._pinned_share = PinnedShareDetector(
                self._in_flight, budget
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        # Top-level keys of our manager that our tiers honour under vLLM's (the rest refused).
        defaults = check_manager_keys(extra)
        admission = admission_policy(extra, num_chunks)  # checked before any thread starts
        if failed_load_backoff_s is None:
            failed_load_backoff_s = defaults.get(
                "failed_load_backoff_s", DEFAULT_FAILED_LOAD_BACKOFF_S
            )
        our_type = self._our_tier_type(tier, where)
        if medium is not None:
            try:
                self.medium = Medium(str(medium).upper())
            except ValueError:
                raise ConfigError(
                    f"{where}: medium must be 'STORAGE' or 'CPU', got {medium!r}"
                ) from None
            self.cache_hit_source = _HIT_SOURCE[self.medium]
        try:
            self.locality = None if locality is None else Locality(str(locality).upper())
        except ValueError:
            raise ConfigError(
                f"{where}: locality must be 'LOCAL' or 'REMOTE', got {locality!r}"
            ) from None
        position = position_in_spec(offloading_spec, tier_type, given)
        if options.get("shutdown_timeout_s") is None:  # absent or null: vLLM's bound
            options["shutdown_timeout_s"] = defaults.get(
                "shutdown_timeout_s", VLLM_SHUTDOWN_TIMEOUT_S
            )
        if enable_kv_events is None:  # JSON null: the default
            enable_kv_events = False
        if not isinstance(enable_kv_events, bool):  # bool("false") would be True
            raise ConfigError(
                f"{where}: enable_kv_events must be true or false, got {enable_kv_events!r}"
            )
        self._events_enabled = self._events_wanted(enable_kv_events, where)
        if not self._events_enabled:
            if options.get("max_events") is not None:  # the user's value is still checked
                check_runtime_options(max_events=options["max_events"])
            options["max_events"] = 0  # nobody takes them: do not keep any

        # vLLM's manager promotes every HIT again at once: a block whose read keeps
        # failing must turn into a MISS, or it would be retried every step.
        options["failed_load_backoff_s"] = failed_load_backoff_s
        config: dict[str, Any] = {"type": our_type, **options}
        config.setdefault("name", f"vllm-{tier_type}-{position}")
        if config.get("isolation") == "process":  # the registry's remedy names no vLLM key
            raise ConfigError(
                f"secondary_tiers[{position}] (type {our_type!r}): isolation 'process' is not "
                "available inside vLLM: the tier's process would have to map vLLM's CPU tier, "
                "which is not a kv-tiering primary buffer; remove the key (the default, "
                "'thread', runs the tier on its own loop thread)"
            )
        block_bytes = self.block_size_bytes
        _serve_metrics(offloading_spec)  # before the runtime: a taken port leaves nothing behind
        self._runtime: AsyncTierManager = create_secondary_tier(
            config,
            primary_kv_view,
            position=position,
            layout_fingerprint=translate.layout_fingerprint(offloading_spec, block_bytes),
        )
        self._admission: OfferAdmission | None = None
        if admission is not None:
            self._admission = OfferAdmission(admission, self._runtime.holds)
        self._loads: set[int] = set()  # job ids of the promotions in flight
        self._hash_seed_checked = False
        self._shut_down = False
        self._metrics = SecondaryTierExport(self._runtime)
        logger.info(
            "kv-tiering tier %r (%s, %s) ready for vLLM: %d-byte blocks, events %s",
            tier_type,
            our_type,
            type(self._runtime.tier).__name__,
            block_bytes,
            "on" if self._events_enabled else "off",
        )

    def _our_tier_type(self, tier: str | None, where: str) -> str:
        if self.fixed_tier is not None:
            if tier is not None:
                raise ConfigError(
                    f"{where}: {type(self).__name__} always runs our {self.fixed_tier!r} tier; "
                    "drop the 'tier' option or use KVTieringTier"
                )
            return self.fixed_tier
        if not isinstance(tier, str) or not tier:
            raise ConfigError(
                f"{where}: KVTieringTier needs a 'tier' option naming one of our tier types "
                "(memory, fs, redis, ...) or a 'package.module:Class' AsyncTier path"
            )
        return tier

    def _events_wanted(self, requested: bool, where: str) -> bool:
        if not requested:
            return False
        config = getattr(self._offloading_spec, "kv_events_config", None)
        if config is not None and config.enable_kv_cache_events:
            return True
        logger.warning(
            "%s: enable_kv_events is set but KV cache events are disabled globally; "
            "the tier will not emit events",
            where,
        )
        return False

    # -- per request and per step --------------------------------------------------------

    def on_new_request(self, req_context: Any) -> Any:
        """Converts the request's context once; asks for request-level offloading when an
        admission policy needs to see reuse (:mod:`tiering.integrations.vllm.admission`),
        chunk-level (vLLM's default) otherwise."""
        translate.request_context(req_context)
        if self._admission is not None:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: Any) -> None:
        """Nothing is kept per request (the converted context lives in vLLM's)."""

    def has_pending_work(self) -> bool:
        """True while any submitted job's result has not been collected yet."""
        return not self._shut_down and self._runtime.has_pending_work()

    # -- lookups and jobs -----------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: Any) -> Any:
        """HIT / MISS from the runtime's presence view; RETRY while in flight or being checked."""
        answer = self._runtime.lookup(key, translate.request_context(req_context))
        if answer and self._pinned_share is not None and not self._pinned_share.should_promote():
            answer = False  # the promotion would wait behind this tier's backlog
        return translate.lookup_result(answer)

    def submit_store(self, job_metadata: Any) -> None:
        """Cascade: copy the job's primary chunks into the tier (keys it holds are skipped).

        With ``cascade_admission``, only the chunks the policy admits are
        copied; the job's result still covers (and unpins) them all.
        """
        if not self._hash_seed_checked:
            self._hash_seed_checked = True  # vLLM resolves its hash seed after building tiers
            _warn_if_keys_are_per_process(self.tier_type, self.medium)
        job = translate.job_metadata(job_metadata, is_promotion=False)
        pinned = len(job.keys)  # vLLM pins every offered chunk until the result
        if self._admission is not None:
            job = self._admission.admit(job)
        self._runtime.submit_store(job)
        self._in_flight.started(job.job_id, pinned, time.monotonic())

    def submit_load(self, job_metadata: Any) -> None:
        """Promotion: copy the keys' blocks into the job's primary chunks."""
        job = translate.job_metadata(job_metadata, is_promotion=True)
        self._runtime.submit_load(job)
        self._loads.add(job.job_id)
        self._in_flight.started(job.job_id, len(job.keys), time.monotonic())

    def get_finished_jobs(self) -> Iterable[Any]:
        """vLLM ``JobResult`` s of the jobs finished since the last call (never blocks)."""
        if self._shut_down:
            return ()
        finished = self._runtime.get_finished()
        if not finished:
            return ()
        results = []
        for result in finished:
            is_load = result.job_id in self._loads
            self._loads.discard(result.job_id)
            self._in_flight.finished(result.job_id)
            results.append(translate.job_result(result, is_promotion=is_load))
        return results

    def drain_jobs(self) -> None:
        """Block until every submitted job has finished; results stay queued for collection.

        Nothing is aborted: every job ends by itself or at its deadline
        (``job_timeout_s``), so this returns within that bound.
        """
        if self._shut_down:
            return
        self._runtime.drain(None)

    def touch(self, keys: Collection[OffloadKey], req_context: Any) -> None:
        """Tell the tier's eviction policy these blocks were used (in the background)."""
        if keys and not self._shut_down:
            self._runtime.touch(keys, translate.request_context(req_context))

    def take_events(self) -> Iterable[Any]:
        """vLLM ``OffloadingEvent`` s for blocks stored in or removed from this tier.

        ``ownership`` is this tier's ``tier_type`` and ``removal_expected`` is
        True: our tiers report their evictions, so vLLM's event tracker keeps a
        block's metadata until this tier says the block is gone.
        """
        if not self._events_enabled or self._shut_down:
            return ()
        return [
            OffloadingEvent(
                keys=list(keys),
                medium=self.medium,
                removed=removed,
                locality=self.locality,
                ownership=self.tier_type,
                removal_expected=True,
            )
            for keys, removed in self._runtime.take_events()
        ]

    def shutdown(self) -> None:
        """Stop the tier's loop thread and close the tier (bounded); idempotent.

        vLLM unmaps the primary buffer right after this, so the runtime
        releases every view of it here.
        """
        if self._shut_down:
            return
        self._shut_down = True
        self._metrics.close()
        self._runtime.shutdown()
        stats = self._runtime.stats()
        refused = (
            ""
            if self._admission is None
            else (
                f", {self._admission.refused} of {self._admission.offered} offered blocks "
                "refused by cascade_admission"
            )
        )
        logger.info(
            "kv-tiering tier %r shut down: %d blocks stored, %d loaded%s",
            self.tier_type,
            stats.blocks_stored,
            stats.blocks_loaded,
            refused,
        )

    # -- introspection ----------------------------------------------------------------------

    @property
    def runtime(self) -> AsyncTierManager:
        """The runtime running our tier (its ``.tier`` is the AsyncTier instance)."""
        return self._runtime

    def stats(self) -> TierStats:
        """The runtime's statistics snapshot of this tier."""
        return self._runtime.stats()

    def get_num_chunks(self) -> int:
        """Blocks known to be in the tier."""
        if self._shut_down:
            raise TierClosedError(f"tier {self.tier_type} is shut down")
        return self._runtime.get_num_blocks()


class KVTieringFileSystemTier(KVTieringTier):
    """Our filesystem tier (slab files, O_DIRECT, checksums, bounded, survives restarts).

    ``{"type": "KVTieringFileSystemTier", "module_path": "tiering.integrations.vllm",
    "root_dir": "/mnt/nvme/kv", "capacity_bytes": "200GiB"}``; options: see
    :class:`tiers.fs.FileSystemTier` and :class:`KVTieringTier`.
    """

    medium: Any = Medium.STORAGE
    cache_hit_source: Any = CacheHitSource.DISK
    fixed_tier: ClassVar[str | None] = "fs"


class KVTieringRedisTier(KVTieringTier):
    """Our Redis tier (one server or a cluster, shared by every engine that uses it).

    ``{"type": "KVTieringRedisTier", "module_path": "tiering.integrations.vllm",
    "url": "redis://cache:6379/0"}``; options: see :class:`tiers.redis.RedisTier`.
    """

    medium: Any = Medium.STORAGE
    cache_hit_source: Any = CacheHitSource.DISK
    fixed_tier: ClassVar[str | None] = "redis"


class KVTieringMemoryTier(KVTieringTier):
    """Our in-memory tier (host memory of the scheduler process, bounded with eviction).

    ``{"type": "KVTieringMemoryTier", "module_path": "tiering.integrations.vllm",
    "capacity_bytes": 8589934592}``; options: see :class:`tiers.memory.MemoryTier`.
    """

    medium: Any = Medium.CPU
    cache_hit_source: Any = CacheHitSource.HOST
    fixed_tier: ClassVar[str | None] = "memory"


def _warn_if_keys_are_per_process(tier_type: str, medium: Any) -> None:
    """One WARNING when block keys will differ in any other process, for a tier that outlives
    this one (storage: a restart, another engine): vLLM seeds a non-cryptographic prefix hash
    (``xxhash``) randomly per process unless ``PYTHONHASHSEED`` is set."""
    if medium is not Medium.STORAGE or os.getenv("PYTHONHASHSEED") is not None:
        return
    from vllm.v1.core import kv_cache_utils

    if kv_cache_utils.get_none_hash_seed() == kv_cache_utils.DEFAULT_NONE_HASH_SEED:
        return  # a cryptographic hash with vLLM's fixed seed: the same keys everywhere
    logger.warning(
        "tier %r keeps blocks beyond this process, but vLLM hashes prefixes with a random "
        "per-process seed (a non-cryptographic prefix_caching_hash_algo without "
        "PYTHONHASHSEED): no other engine, nor this one after a restart, will hit them; set "
        "PYTHONHASHSEED to one value in every engine, or use sha256",
        tier_type,
    )


def _serve_metrics(offloading_spec: Any) -> None:
    """With ``metrics_port`` in kv_connector_extra_config, serve the metrics (once per process).

    Called by each tier vLLM's manager builds, in the scheduler process only
    (workers build no tiers); every tier after the first gets the running server.
    """
    extra = getattr(offloading_spec, "extra_config", None) or {}
    port = extra.get("metrics_port")
    if port is not None:
        served = serve_metrics(
            check_metrics_port(port), extra.get("metrics_host") or DEFAULT_METRICS_HOST
        )
        logger.info("serving kv_tiering_* metrics at %s", served.url)
