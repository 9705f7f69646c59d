"""vLLM 0.33 integration: kv-tiering's tiers inside vLLM's own tiering manager.

The only part of kv-tiering that imports vLLM. A vLLM user selects one of our
tiers in ``--kv-transfer-config`` with vLLM's ``TieringOffloadingSpec``::

    "secondary_tiers": [{"type": "KVTieringFileSystemTier",
                         "module_path": "tiering.integrations.vllm",
                         "root_dir": "/mnt/nvme/kv"}]

For a whole engine, :class:`KVTieringOffloadingSpec` (``"spec_name":
"KVTieringOffloadingSpec", "spec_module_path": "tiering.integrations.vllm"``)
keeps vLLM's tiering manager and puts our copy engine on the worker side.

Tier classes: :class:`KVTieringFileSystemTier`, :class:`KVTieringRedisTier`,
:class:`KVTieringMemoryTier`, and :class:`KVTieringTier` for any other
:class:`~tiering.tier.AsyncTier` (``"tier": "package.module:Class"``). See
``docs/vllm.md``.
"""

from tiering.integrations.vllm.spec import CopyEngineOffloadingWorker, KVTieringOffloadingSpec
from tiering.integrations.vllm.tiers import (
    MODULE_PATH,
    KVTieringFileSystemTier,
    KVTieringMemoryTier,
    KVTieringRedisTier,
    KVTieringTier,
)

__all__ = [
    "MODULE_PATH",
    "CopyEngineOffloadingWorker",
    "KVTieringOffloadingSpec",
    "KVTieringFileSystemTier",
    "KVTieringMemoryTier",
    "KVTieringRedisTier",
    "KVTieringTier",
]
