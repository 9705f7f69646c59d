"""kv-tiering: an asyncio-native KV-cache tiering framework.

``import tiering`` never imports torch or vLLM. The public names below are the
seed contract's core types; the primary tier, the async tier runtime and the
tiering manager live in their own modules.
"""

from tiering._version import __version__
from tiering.contract import OffloadingEvent, OffloadingManager, PrepareStoreOutput
from tiering.errors import (
    BlockNotFound,
    ConfigError,
    ContractError,
    CorruptBlock,
    PartialBatchError,
    TierClosedError,
    TieringError,
)
from tiering.jobs import JobId, JobMetadata, JobResult, SecondaryTierManager
from tiering.keys import NO_CONTEXT, OffloadKey, ReqContext, make_offload_key, split_offload_key
from tiering.specs import (
    BlockIDsLoadStoreSpec,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
)
from tiering.tier import AsyncTier, TierContext

__all__ = [
    "__version__",
    "NO_CONTEXT",
    "AsyncTier",
    "BlockIDsLoadStoreSpec",
    "BlockNotFound",
    "CPULoadStoreSpec",
    "ConfigError",
    "ContractError",
    "CorruptBlock",
    "GPULoadStoreSpec",
    "JobId",
    "JobMetadata",
    "JobResult",
    "LoadStoreSpec",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "PartialBatchError",
    "PrepareStoreOutput",
    "ReqContext",
    "SecondaryTierManager",
    "TierClosedError",
    "TierContext",
    "TieringError",
    "make_offload_key",
    "split_offload_key",
]
