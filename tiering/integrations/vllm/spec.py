"""``KVTieringOffloadingSpec``: vLLM's tiered offloading, our tiers and a choice of copy worker.

Selected in ``kv_connector_extra_config`` with ``"spec_name":
"KVTieringOffloadingSpec", "spec_module_path": "tiering.integrations.vllm"``.

Scheduler side: vLLM's own ``TieringOffloadingManager`` (inherited from
``TieringOffloadingSpec``): its CPU primary tier in a shared-memory region and
the ``secondary_tiers`` list, in which our tiers are named through
``module_path`` (:mod:`tiering.integrations.vllm.tiers`). Keeping vLLM's
manager keeps everything the engine relies on around it (its metrics, KV
events, ``reset_cache``, request-level policies, peer tiers) exactly as vLLM
tests it, and puts our code where it adds to it: the tiers and the copies.

Worker side, by ``copy_engine`` (:func:`resolve_copy_engine`):

* ``"auto"`` (default): our CUDA engine on NVIDIA GPUs, where it passed the
  GPU check on real hardware (``make gpu-check``, recorded in
  ``docs/copy-engine.md``); vLLM's own ``CPUOffloadingWorker`` on ROCm and XPU,
  where ours has never run; our host engine on CPU platforms, where vLLM's
  worker refuses to start;
* ``"cuda"``: our CUDA engine (streams and events, :mod:`tiering.copy.cuda`) on
  NVIDIA and ROCm GPUs (torch's ``cuda`` device);
* ``"host"``: our host engine (CPU KV tensors);
* ``"vllm"``: vLLM's worker, explicitly.

The bytes a worker writes into a CPU row are its row layout; persistent and
shared tiers name it in their layout fingerprint (:attr:`row_layout`), so a
block written by one worker is never read by another.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Collection
from typing import Any

from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

import tiering.integrations.vllm.platform as platform_probe
from tiering.config import _warn_about_likely_typos, check_host_memory, shown
from tiering.copy import CopyWorker, make_copy_worker
from tiering.core.errors import ConfigError
from tiering.core.specs import CPULoadStoreSpec, GPULoadStoreSpec
from tiering.integrations.vllm.manager_keys import check_manager_keys
from tiering.integrations.vllm.platform import DeviceKind
from tiering.integrations.vllm.policy import vllm_cache_policy
from tiering.integrations.vllm.translate import vllm_row_layout
from tiering.support.units import config_bytes

logger = logging.getLogger("tiering.integrations.vllm")

_UNSUPPORTED_FAILURE = (
    "{} (see the log above); vLLM's offloading connector cannot recover from a failed "
    "transfer, so the worker stops here"
)


class CopyEngineOffloadingWorker(OffloadingWorker):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's ``OffloadingWorker`` over our :class:`~tiering.copy.CopyWorker`.

    Converts vLLM's spec objects to ours (same fields) and our results to
    vLLM's ``TransferResult``. Owns the worker's mapping of the shared region
    and releases it at :meth:`shutdown`.
    """

    def __init__(self, copy_worker: CopyWorker, region: Any) -> None:
        self._copy = copy_worker
        self._region = region
        self._closed = False

    @property
    def copy_worker(self) -> CopyWorker:
        return self._copy

    # vLLM's offloading connector (0.32, 0.33) asserts that every submission is
    # accepted and every transfer succeeds ("we currently do not support job
    # failures"): it cannot turn a failed copy into a miss. A failure therefore
    # raises here, naming its cause, instead of surfacing as a bare AssertionError.

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Engine KV blocks -> CPU tier chunks, asynchronously. Raises if rejected."""
        if not self._copy.submit_store(job_id, _gpu_spec(src_spec), _cpu_spec(dst_spec)):
            raise RuntimeError(_UNSUPPORTED_FAILURE.format(f"store job {job_id} was rejected"))
        return True

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        """CPU tier chunks -> engine KV blocks, asynchronously. Raises if rejected."""
        accepted = self._copy.submit_load(
            job_id, _cpu_spec(src_spec), _gpu_spec(dst_spec), expedited=expedited
        )
        if not accepted:
            raise RuntimeError(_UNSUPPORTED_FAILURE.format(f"load job {job_id} was rejected"))
        return True

    def get_finished(self) -> list[Any]:
        """vLLM ``TransferResult`` s of the jobs finished since the last call.

        Raises :class:`RuntimeError` naming the first failed job's error.
        """
        results = []
        for result in self._copy.get_finished():
            if not result.success:
                raise RuntimeError(
                    _UNSUPPORTED_FAILURE.format(f"copy job {result.job_id} failed: {result.error}")
                )
            results.append(
                TransferResult(
                    job_id=result.job_id,
                    success=result.success,
                    transfer_size=result.transfer_bytes,
                    transfer_time=result.transfer_time,
                )
            )
        return results

    def wait(self, job_ids: Collection[int]) -> None:
        """Block until these jobs finished (vLLM waits before reusing their blocks)."""
        self._copy.wait(job_ids)

    def shutdown(self) -> None:
        """Wait for the copies in flight, stop the engine, unmap the region. Idempotent."""
        if self._closed:
            return
        self._closed = True
        still_copying = 0
        try:
            self._copy.shutdown()
            still_copying = self._copy.engine.jobs_left_running
        finally:
            self._copy = None  # type: ignore[assignment]  # drop its views of the region
            gc.collect()
            if still_copying:  # a DMA may still write into the region: leak it, never unmap
                logger.error(
                    "%d copy job(s) still running at shutdown; the shared region stays mapped",
                    still_copying,
                )
            else:
                self._region.cleanup()


#: What ``copy_engine: "auto"`` runs on each kind of platform, and why (logged at start-up).
_AUTO = {
    "cuda": (
        "cuda",
        "our CUDA engine: it passed the GPU check on real hardware (docs/copy-engine.md); "
        "copy_engine 'vllm' selects vLLM's CPUOffloadingWorker",
    ),
    "rocm": (
        "vllm",
        "vLLM's CPUOffloadingWorker: our CUDA engine has never run on ROCm; "
        "copy_engine 'cuda' selects it",
    ),
    "xpu": ("vllm", "vLLM's CPUOffloadingWorker: our CUDA engine does not run on XPU"),
    "cpu": (
        "host",
        "our host engine: the KV cache is in CPU memory, where vLLM's worker does not run",
    ),
}
#: ``"auto"`` with ``canonical_layout`` on a GPU.
_AUTO_CANONICAL = ("vllm", "vLLM's CPUOffloadingWorker: canonical_layout rows are only its own")
#: What ``copy_engine`` may name.
COPY_ENGINES = ("auto", "vllm", "cuda", "host")
#: The row layout our copy engines (host and CUDA) write: ``tiering.copy.layout.KVLayout``.
OUR_ROW_LAYOUT = "kv-tiering-worker/1"


def auto_copy_engine(platform: DeviceKind, canonical_layout: bool) -> tuple[str, str]:
    """What ``copy_engine: "auto"`` runs on this platform, and why (see the module docstring)."""
    if canonical_layout and platform != "cpu":
        return _AUTO_CANONICAL
    return _AUTO[platform]


def resolve_copy_engine(
    requested: object, *, platform: DeviceKind, canonical_layout: bool = False
) -> str:
    """The worker ``copy_engine: requested`` runs on this platform.

    ``platform`` is :func:`tiering.integrations.vllm.platform.device_kind`.
    ``"auto"`` with ``canonical_layout`` on a GPU is vLLM's worker, the one
    that writes canonical rows. Raises ``ValueError`` naming the key for a
    value it does not know or an engine this platform cannot run.
    """
    if requested not in COPY_ENGINES:
        raise ValueError(
            f"copy_engine must be one of {', '.join(map(repr, COPY_ENGINES))}, got {requested!r}"
        )
    if requested == "auto":
        return auto_copy_engine(platform, canonical_layout)[0]
    if requested == "cuda" and platform not in ("cuda", "rocm"):
        raise ValueError(
            f"copy_engine 'cuda' needs a CUDA or ROCm GPU, and this vLLM platform is {platform!r}; "
            f"use 'auto' or {'vllm' if platform == 'xpu' else 'host'!r}"
        )
    if requested == "vllm" and platform == "cpu":
        raise ValueError(
            "copy_engine 'vllm' needs a GPU, and this vLLM platform has none; use 'auto' or 'host'"
        )
    if requested == "host" and platform != "cpu":
        raise ValueError(
            "copy_engine 'host' copies CPU KV tensors, and this vLLM platform keeps them on "
            "the GPU; use 'auto', 'vllm' or 'cuda'"
        )
    return str(requested)


class KVTieringOffloadingSpec(TieringOffloadingSpec):  # type: ignore[misc]  # vLLM is untyped
    """vLLM's ``TieringOffloadingSpec`` with our tiers' policies and a choice of copy worker.

    ``kv_connector_extra_config`` is the same as for vLLM's tiering spec
    (``cpu_bytes_to_use``, ``block_size``, ``eviction_policy``,
    ``secondary_tiers``...) plus ``copy_engine`` (see the module docstring).
    ``eviction_policy`` also takes every policy kv-tiering resolves
    (``"kvaware"``, ``"pkg.mod:Class"``, entry points, options), run inside
    vLLM's CPU tier through :mod:`tiering.integrations.vllm.policy`.
    """

    def __init__(self, config: Any) -> None:
        super().__init__(_with_sizes_in_bytes(config))
        chunk = int(self.kv_bytes_per_chunk)
        if chunk and self.num_chunks < 1:  # vLLM would fail later: "cannot mmap an empty file"
            raise ConfigError(
                f"cpu_bytes_to_use={self.extra_config['cpu_bytes_to_use']} is smaller than one "
                f"offloaded block ({chunk} bytes); give at least {chunk} bytes"
            )
        # Read by vLLM when it builds its CPU primary tier (in get_manager).
        self.eviction_policy, self.cache_policy_module_path = vllm_cache_policy(self.extra_config)
        check_manager_keys(self.extra_config)  # our manager's keys: honoured or refused
        _warn_about_likely_typos(self.extra_config, also_known=("copy_engine",))
        requested = self.extra_config.get("copy_engine")
        if requested is None:  # absent, or JSON null: the default
            requested = "auto"
        platform = platform_probe.device_kind()
        canonical = bool(self.config.canonical_layout)
        self.copy_engine = resolve_copy_engine(
            requested, platform=platform, canonical_layout=canonical
        )
        if self.copy_engine != "vllm" and canonical:
            fix = (
                "use copy_engine 'vllm'"
                if platform != "cpu"
                else "vLLM's worker, the one that writes them, needs a GPU"
            )
            raise ValueError(
                f"copy_engine {requested!r} (here: {self.copy_engine!r}) does not write "
                f"canonical_layout rows; remove canonical_layout from kv_connector_extra_config "
                f"({fix})"
            )
        #: The row layout the worker writes (part of persistent tiers' layout fingerprint).
        self.row_layout = (
            vllm_row_layout(canonical) if self.copy_engine == "vllm" else OUR_ROW_LAYOUT
        )
        if requested == "auto":
            logger.info("copy_engine 'auto' chose %s", auto_copy_engine(platform, canonical)[1])

    def get_manager(self) -> Any:
        """vLLM's manager, after checking that its shared CPU tier fits this host.

        Here, not in ``__init__``: only the process that builds the manager creates the
        shared region (worker processes build the spec too, after it exists).
        """
        if not getattr(self, "_manager", None):
            check_host_memory(
                "cpu_bytes_to_use", self.num_chunks * self.kv_bytes_per_chunk, shared=True
            )
            if self.copy_engine == "host":
                _warn_if_no_core_is_reserved(int(self.config.parallel.world_size))
        return super().get_manager()

    def get_worker(self, kv_caches: Any) -> Any:
        """The copy worker, built once (vLLM's refuses anything but CUDA and XPU)."""
        worker: Any = getattr(self, "_worker", None)  # set by vLLM's CPUOffloadingSpec
        if not worker:
            worker = self._worker = self.create_worker(kv_caches)
        return worker

    def create_worker(self, kv_caches: Any) -> Any:
        if self.copy_engine == "vllm":
            logger.info("kv-tiering: the copies run on vLLM's CPUOffloadingWorker")
            return super().create_worker(kv_caches)
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            rows = region.create_kv_memoryview()  # (num_chunks, row) over the same memory
            copy_worker = make_copy_worker(
                kv_caches,
                rows,
                block_size_factor=self.blocks_per_chunk,
                worker_index=rank,
                engine=self.copy_engine,  # type: ignore[arg-type]  # 'host' or 'cuda' here
            )
            del rows
        except Exception:
            gc.collect()
            region.cleanup()
            raise
        logger.info(
            "kv-tiering copy worker (%s engine) for rank %d: %d chunks of %d bytes, "
            "%d KV-cache group(s), %d GPU block(s) per chunk",
            type(copy_worker.engine).__name__,
            rank,
            self.num_chunks,
            self.kv_bytes_per_chunk,
            copy_worker.engine.layout.num_groups,
            self.blocks_per_chunk,
        )
        return CopyEngineOffloadingWorker(copy_worker, region)


def _warn_if_no_core_is_reserved(world_size: int) -> None:
    """vLLM's CPU backend: say so when a KV connector leaves the scheduler no core of its own.

    It reserves one core per worker for the scheduler process and, whenever a KV
    connector is configured, one more (for NIXL's P/D transfers). Where that is every
    core, it reserves none: the scheduler's spin-wait then shares the model's cores, and
    decode steps took about twice as long on a 2-core machine (docs/vllm.md).
    """
    if os.getenv("VLLM_CPU_NUM_OF_RESERVED_CPU") is not None:
        return
    cores = len(os.sched_getaffinity(0))
    if cores <= 2 * world_size:
        logger.warning(
            "vLLM's CPU backend reserves %d core(s) when a KV connector is configured and this "
            "process may use %d, so it reserves none: the scheduler process will share the "
            "model's cores (decode steps about 2x slower on 2 cores); set "
            "VLLM_CPU_NUM_OF_RESERVED_CPU=%d to keep the binding it uses without offloading",
            2 * world_size,
            cores,
            world_size,
        )


def _with_sizes_in_bytes(config: Any) -> Any:
    """``config`` with ``cpu_bytes_to_use`` in bytes: vLLM's spec reads it with ``int()``,
    and ours documents sizes with units (``"16GiB"``). Raises ``ConfigError`` naming it."""
    extra = getattr(config, "extra_config", None)
    if not isinstance(extra, dict) or extra.get("cpu_bytes_to_use") is None:
        return config
    size = config_bytes("cpu_bytes_to_use", extra["cpu_bytes_to_use"])
    if size <= 0:
        raise ConfigError(
            f"cpu_bytes_to_use must be positive, got {shown(extra['cpu_bytes_to_use'])}"
        )
    return dataclasses.replace(config, extra_config={**extra, "cpu_bytes_to_use": size})


def _gpu_spec(spec: Any) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(spec.block_ids, spec.group_sizes, spec.block_indices)


def _cpu_spec(spec: Any) -> CPULoadStoreSpec:
    return CPULoadStoreSpec(spec.block_ids)
