"""Eviction policies (pure synchronous code) and their registry by name."""

from __future__ import annotations

from collections.abc import Hashable

from tiering.errors import ConfigError
from tiering.policies.arc import ARCPolicy
from tiering.policies.base import EvictionPolicy
from tiering.policies.lru import LRUPolicy

POLICY_NAMES = ("lru", "arc")


def make_policy(name: str, capacity: int) -> EvictionPolicy[Hashable]:
    """Build the eviction policy called ``name`` (``"lru"`` or ``"arc"``) for ``capacity`` keys.

    Raises :class:`~tiering.errors.ConfigError` for an unknown name or a
    capacity that is not a positive int.
    """
    if name not in POLICY_NAMES:
        raise ConfigError(f"eviction_policy must be one of {', '.join(POLICY_NAMES)}; got {name!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise ConfigError(f"eviction policy capacity must be a positive int, got {capacity!r}")
    if name == "arc":
        return ARCPolicy(capacity)
    return LRUPolicy(capacity)


__all__ = ["POLICY_NAMES", "ARCPolicy", "EvictionPolicy", "LRUPolicy", "make_policy"]
