"""Pure translations between vLLM 0.33's tiering types and kv-tiering's.

Nothing here holds state or threads; every function is called on the thread
that holds vLLM's manager lock (usually the scheduler's).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.tiering.base import JobResult as VllmJobResult

from tiering.core.jobs import JobMetadata, JobResult
from tiering.core.keys import OffloadKey, ReqContext


def lookup_result(answer: bool | None) -> Any:
    """Our facade's answer as vLLM's ``LookupResult``: True HIT, False MISS, None RETRY."""
    if answer is None:
        return LookupResult.RETRY
    return LookupResult.HIT if answer else LookupResult.MISS


def request_context(vllm_context: Any) -> ReqContext:
    """Our :class:`~tiering.core.keys.ReqContext` for a vLLM ``ReqContext``.

    Built once per request and kept in the vLLM context's per-request scratch
    space (``set_state``, keyed by type), so the hot path converts nothing.
    """
    ours: ReqContext | None = vllm_context.get_state(ReqContext)
    if ours is None:
        ours = ReqContext(
            req_id=vllm_context.req_id, kv_transfer_params=vllm_context.kv_transfer_params
        )
        vllm_context.set_state(ours)
    return ours


def job_metadata(transfer_job: Any, *, is_promotion: bool) -> JobMetadata:
    """Our :class:`~tiering.core.jobs.JobMetadata` for a vLLM ``TransferJob``.

    vLLM's ``chunk_ids`` are rows of the primary tier's buffer, exactly our
    ``block_ids``. ``is_promotion`` comes from the entry point vLLM called
    (``submit_load``/``submit_store``), which is authoritative.
    """
    return JobMetadata(
        job_id=transfer_job.job_id,
        keys=tuple(transfer_job.keys),  # vLLM's OffloadKey is ours: hash + 4-byte group
        block_ids=transfer_job.chunk_ids,
        is_promotion=is_promotion,
        req_context=request_context(transfer_job.req_context),
    )


def job_result(result: JobResult, *, is_promotion: bool) -> Any:
    """vLLM's ``JobResult`` for one of ours.

    ``successful_keys`` is vLLM's partial-failure report and only means
    something for a failed promotion (vLLM keeps those blocks and treats the
    rest as misses); anywhere else it is None, "every key shares the job's
    fate". ``transfer_bytes`` are the bytes really moved (keys a store skipped
    because the tier already held them move none), which is what vLLM's
    back-pressure detector wants; zero bytes makes it skip the sample.
    """
    successful: tuple[OffloadKey, ...] | None = None
    if is_promotion and not result.success and result.successful_keys:
        successful = tuple(result.successful_keys)
    return VllmJobResult(
        job_id=result.job_id,
        success=result.success,
        successful_keys=successful,
        transfer_time=result.transfer_time,
        transfer_bytes=result.transfer_bytes,
    )


def vllm_row_layout(canonical: bool) -> str:
    """The row layout vLLM's own ``CPUOffloadingWorker`` writes, named by vLLM's version.

    The version is part of the name because nothing promises that the next
    vLLM lays its rows out the same way.
    """
    from vllm import __version__

    major_minor = ".".join(__version__.split(".")[:2])
    return f"vllm-{major_minor}-worker/{'canonical' if canonical else 'direct'}"


def layout_fingerprint(offloading_spec: Any, block_bytes: int) -> str:
    """A name for the KV layout whose bytes a persistent tier stores.

    Made of what decides the meaning of a chunk's bytes - the model, KV dtype,
    tokens per hash, blocks per chunk, the KV-cache groups and their layers,
    the parallel layout (collapsed when vLLM declares the bytes
    parallelism-agnostic, as its own filesystem tier does), the replicated and
    canonical layouts, the row layout the copy worker writes (``row_layout`` of
    ``KVTieringOffloadingSpec``; vLLM's own worker for vLLM's spec) - and the
    chunk's size in bytes. A tier must never serve bytes written under another
    fingerprint.
    """
    config = offloading_spec.config
    row_layout = getattr(offloading_spec, "row_layout", None)
    if not isinstance(row_layout, str):
        row_layout = vllm_row_layout(bool(config.canonical_layout))
    parallel = config.parallel
    agnostic = bool(parallel.is_parallelism_agnostic or config.replicated_layout)
    fields: dict[str, Any] = {
        "engine": "vllm",
        "model": config.model.name,
        "dtype": str(config.model.dtype),
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "parallel": None
        if agnostic
        else [
            parallel.tp_size,
            parallel.pp_size,
            parallel.pcp_size,
            parallel.dcp_size,
            parallel.world_size,
        ],
        "replicated_layout": bool(config.replicated_layout),
        "canonical_layout": config.kv_cache_layout if config.canonical_layout else None,
        "row_layout": row_layout,
        "chunk_bytes": block_bytes,
    }
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return f"vllm:{config.model.name}:{config.model.dtype}:{block_bytes}:{digest}"
