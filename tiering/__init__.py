"""kv-tiering: an asyncio-native KV-cache tiering framework.

``import tiering`` never imports torch or vLLM. The public names below are the
seed contract's core types; each layer of ``docs/architecture.md`` is a package
of its own (``ls tiering/``). Module paths from before that grouping
(``tiering.keys``, ``tiering.host_buffer``...) still import: :mod:`tiering._moved`.
"""

from tiering import _moved
from tiering._version import __version__
from tiering.core.contract import OffloadingEvent, OffloadingManager, PrepareStoreOutput
from tiering.core.errors import (
    BlockNotFound,
    ConfigError,
    ContractError,
    CorruptBlock,
    PartialBatchError,
    TierClosedError,
    TieringError,
)
from tiering.core.jobs import JobId, JobMetadata, JobResult, SecondaryTierManager
from tiering.core.keys import (
    NO_CONTEXT,
    OffloadKey,
    ReqContext,
    make_offload_key,
    split_offload_key,
)
from tiering.core.specs import (
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

_moved.install()  # before anyone imports an old path: it imports this package first
