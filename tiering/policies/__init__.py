"""Eviction policies (pure synchronous code) and their registry by name."""

from __future__ import annotations

from collections.abc import Hashable

from tiering.errors import ConfigError
from tiering.policies.base import EvictionPolicy
from tiering.policies.lru import LRUPolicy

POLICY_NAMES = ("lru", "arc")


def make_policy(name: str, capacity: int) -> EvictionPolicy[Hashable]:
    """Build the eviction policy called ``name`` (``"lru"`` or ``"arc"``)."""
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "arc":
        from tiering.policies.arc import ARCPolicy

        return ARCPolicy(capacity)
    raise ConfigError(f"eviction_policy must be one of {', '.join(POLICY_NAMES)}; got {name!r}")


__all__ = ["POLICY_NAMES", "EvictionPolicy", "LRUPolicy", "make_policy"]
