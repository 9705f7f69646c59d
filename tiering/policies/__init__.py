"""Eviction policies (pure synchronous code) and the one resolver that names them.

Every place that chooses a policy (the primary tier, the fs and memory tiers,
``tiering replay`` and ``tiering sweep``) goes through
:func:`~tiering.policies.registry.resolve_policy`: a built-in name, an import
path ``"pkg.mod:Class"``, an entry point in group ``kv_tiering.policies``, or
vLLM's ``eviction_policy`` + ``cache_policy_module_path`` spelling, with options.
"""

from __future__ import annotations

from tiering.policies.adaptive import AdaptivePolicy
from tiering.policies.admission import (
    ADMISSION_ENTRY_POINT_GROUP,
    ADMISSION_NAMES,
    AdmissionPolicy,
    AdmitAll,
    ReuseAdmission,
    resolve_admission,
)
from tiering.policies.arc import ARCPolicy
from tiering.policies.base import EvictionPolicy
from tiering.policies.kvaware import KVAwarePolicy
from tiering.policies.lru import LRUPolicy
from tiering.policies.registry import (
    BUILTIN_POLICIES,
    ENTRY_POINT_GROUP,
    POLICY_NAMES,
    PolicyChoice,
    known_policy_names,
    make_policy,
    parse_policy_text,
    resolve_policy,
    split_policy_list,
)
from tiering.policies.request import (
    RequestAwarePolicy,
    RequestContext,
    access_with,
    insert_with,
)

__all__ = [
    "ADMISSION_ENTRY_POINT_GROUP",
    "ADMISSION_NAMES",
    "AdmissionPolicy",
    "AdmitAll",
    "ReuseAdmission",
    "resolve_admission",
    "BUILTIN_POLICIES",
    "ENTRY_POINT_GROUP",
    "POLICY_NAMES",
    "AdaptivePolicy",
    "ARCPolicy",
    "RequestAwarePolicy",
    "RequestContext",
    "access_with",
    "insert_with",
    "EvictionPolicy",
    "KVAwarePolicy",
    "LRUPolicy",
    "PolicyChoice",
    "known_policy_names",
    "make_policy",
    "parse_policy_text",
    "resolve_policy",
    "split_policy_list",
]
