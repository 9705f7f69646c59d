"""GPU <-> CPU copy engine: the worker side of offloading.

Moves KV blocks between the GPU KV cache (in its canonical form,
:class:`CanonicalKVCaches`) and the CPU primary tier's host buffer, as the
scheduler's ``prepare_store`` / ``prepare_load`` specs say. Two engines share
one interface: :class:`~tiering.copy.cuda.CudaCopyEngine` (CUDA streams and
events; imported on demand, as it imports torch) and :class:`HostCopyEngine`
(CPU memory, used everywhere else). :class:`CopyWorker` and
:class:`TransferHandler` are the job-id driven handlers vLLM's connector calls.

Importing this package never imports torch.
"""

from tiering.copy.engine import CopyEngine, CopyJob, CopyOutcome
from tiering.copy.handlers import (
    CopyWorker,
    OffloadingHandler,
    TransferHandler,
    TransferResult,
    TransferSpec,
    make_copy_worker,
)
from tiering.copy.host import HostCopyEngine
from tiering.copy.layout import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    KVLayout,
    required_cpu_block_bytes,
)
from tiering.copy.plan import BlockCopies, Lane, TransferPlan, plan_transfer

__all__ = [
    "BlockCopies",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "CopyEngine",
    "CopyJob",
    "CopyOutcome",
    "CopyWorker",
    "HostCopyEngine",
    "KVLayout",
    "Lane",
    "OffloadingHandler",
    "TransferHandler",
    "TransferPlan",
    "TransferResult",
    "TransferSpec",
    "make_copy_worker",
    "plan_transfer",
    "required_cpu_block_bytes",
]
