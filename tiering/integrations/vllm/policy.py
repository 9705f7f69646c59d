"""Our eviction policies inside vLLM's CPU primary tier: a ``CachePolicy`` adapter.

vLLM 0.33's ``CPUOffloadingManager`` asks a ``CachePolicy`` (its own interface:
chunks, ref counts, request hooks) for victims and builds it as
``policy_cls(cache_capacity=n)`` from ``eviction_policy`` and
``cache_policy_module_path``. :func:`vllm_cache_policy` reads those two keys of
``kv_connector_extra_config`` the way :func:`tiering.policies.resolve_policy`
does everywhere else and answers what to hand vLLM:

* ``"lru"`` / ``"arc"``: vLLM's own policies, as vLLM tests them;
* a vLLM ``CachePolicy`` class (vLLM's spelling, ``cache_policy_module_path``):
  passed through unchanged;
* anything else our resolver accepts (``"kvaware"``, ``"pkg.mod:Class"``, an
  entry point, options): an :class:`EvictionPolicyCachePolicy` subclass bound to
  the resolved choice, published as an attribute of this module so vLLM's
  ``CachePolicyFactory`` can import it by name.

Bad settings raise :class:`~tiering.core.errors.ConfigError` when the spec is built.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from tiering.core.errors import ConfigError
from tiering.policies import EvictionPolicy, PolicyChoice, resolve_policy

#: Policies vLLM ships; these names keep vLLM's implementation.
VLLM_BUILTIN_POLICIES = ("lru", "arc")

_adapters: dict[str, str] = {}  # policy label -> attribute name of its adapter class here


class EvictionPolicyCachePolicy(CachePolicy):  # type: ignore[misc]  # vLLM is untyped
    """vLLM's ``CachePolicy`` over one of our :class:`~tiering.policies.EvictionPolicy` objects.

    Subclasses made by :func:`vllm_cache_policy` set :attr:`choice`. The chunk
    statuses and which chunks are evictable (ref count 0) live here; the
    policy only orders keys. Touches follow our primary tier's convention (a
    request's last block first, so its first block ends most recently used),
    and only blocks a request *reused* count as uses: a block stored by the
    request is not a second use of it.
    """

    choice: ClassVar[PolicyChoice]

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[Any, ChunkStatus] = {}
        self._evictable: set[Any] = set()
        self._policy: EvictionPolicy[Any] = self.choice.build(cache_capacity)

    @property
    def policy(self) -> EvictionPolicy[Any]:
        return self._policy

    def get(self, key: Any) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: Any, chunk: ChunkStatus, req_context: Any) -> None:
        self._policy.insert(key)
        self.chunks[key] = chunk
        if chunk.ref_cnt == 0:
            self._evictable.add(key)

    def remove(self, key: Any) -> None:
        del self.chunks[key]
        self._evictable.discard(key)
        self._policy.remove(key)

    def touch(self, keys: Iterable[Any], req_context: Any) -> None:
        access = self._policy.access
        for key in reversed(list(keys)):
            access(key)

    def on_store_miss(self, keys: Iterable[Any], req_context: Any) -> None:
        return  # a miss is not a use; ghost lists learn from the insert that follows

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[Any]],
        insertion_only_keys: set[Any],
        reused_keys: set[Any],
        req_context: Any,
    ) -> None:
        access = self._policy.access
        for key in reversed(order_request_keys(key_groups, req_context)):
            if key in reused_keys:
                access(key)

    def evict(self, n: int, protected: set[Any]) -> list[tuple[Any, ChunkStatus]] | None:
        if n <= 0:
            return []
        evictable = self._evictable
        available = len(evictable) - sum(1 for key in protected if key in evictable)
        if available < n:
            return None  # atomic: nothing changes
        victims = self._policy.evict(n, lambda key: key in evictable and key not in protected)
        if len(victims) != n:
            raise RuntimeError(
                f"{type(self._policy).__name__}.evict returned {len(victims)} of {n} evictable keys"
            )
        evicted = []
        for key in victims:
            evictable.discard(key)
            evicted.append((key, self.chunks.pop(key)))
        return evicted

    def clear(self) -> None:
        self.chunks.clear()
        self._evictable.clear()
        self._policy = self.choice.build(self.cache_capacity)

    def mark_evictable(self, key: Any) -> None:
        self._evictable.add(key)

    def mark_non_evictable(self, key: Any) -> None:
        self._evictable.discard(key)


def vllm_cache_policy(extra_config: Mapping[str, Any]) -> tuple[str, str | None]:
    """``(eviction_policy, cache_policy_module_path)`` to give vLLM's CPU manager.

    Raises :class:`ConfigError` naming the key for a setting neither vLLM nor
    our resolver accepts.
    """
    setting = extra_config.get("eviction_policy")
    module_path = extra_config.get("cache_policy_module_path")
    if setting is None:
        setting = "lru"
    plain_name = isinstance(setting, str) and ":" not in setting and "(" not in setting
    if module_path is None and plain_name and setting.strip().lower() in VLLM_BUILTIN_POLICIES:
        return setting.strip().lower(), None
    if module_path is None and plain_name and _registered_with_vllm(setting):
        return setting, None  # a name registered with vLLM's CachePolicyFactory: vLLM's
    if module_path is not None and plain_name and _is_vllm_cache_policy(module_path, setting):
        return setting, module_path
    choice = resolve_policy(setting, module_path=module_path)
    return _publish_adapter(choice), __name__


def _registered_with_vllm(name: str) -> bool:
    """Whether ``name`` is registered with vLLM's ``CachePolicyFactory`` (vLLM resolves it)."""
    try:
        from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
    except ImportError:  # not inside vLLM: only our names
        return False
    registry = getattr(CachePolicyFactory, "_registry", None)
    return isinstance(registry, dict) and name in registry


def _is_vllm_cache_policy(module_path: object, name: str) -> bool:
    if not isinstance(module_path, str):
        return False  # resolve_policy reports it
    try:
        obj = getattr(importlib.import_module(module_path), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"eviction_policy: cannot import {name!r} from cache_policy_module_path "
            f"{module_path!r}: {exc}"
        ) from exc
    return isinstance(obj, type) and issubclass(obj, CachePolicy)


def _publish_adapter(choice: PolicyChoice) -> str:
    """The name of an adapter class for ``choice``, made once and kept in this module."""
    label = choice.label
    name = _adapters.get(label)
    if name is None:
        name = f"KVTieringPolicy{len(_adapters)}"
        adapter = type(name, (EvictionPolicyCachePolicy,), {"choice": choice})
        adapter.__doc__ = f"vLLM CachePolicy adapter for the kv-tiering policy {label}."
        setattr(sys.modules[__name__], name, adapter)
        _adapters[label] = name
    return name
