"""Request context for eviction policies that want it, without changing the key-only contract.

vLLM's connector touches a request's blocks once per decoded block, so a policy that
counts every ``access`` as a use counts a long answer as hundreds of uses of its
prompt. A policy that wants to count one use per request per block (and to know where
a block sits in its prefix) subclasses :class:`RequestAwarePolicy` and overrides
:meth:`~RequestAwarePolicy.access_in` / :meth:`~RequestAwarePolicy.insert_in`.

Callers that have the request at hand call :func:`access_with` / :func:`insert_with`:
they pass the :class:`RequestContext` to a request-aware policy and fall back to plain
``access(key)`` / ``insert(key)`` for every other policy, so key-only policies (LRU, ARC,
third-party ones) keep working unchanged, and callers without a request keep calling
``access`` / ``insert``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from tiering.policies.base import EvictionPolicy, K


@dataclass(frozen=True, slots=True)
class RequestContext:
    """Which request uses a block, and where the block sits in that request's prefix.

    ``request_id`` is any hashable the caller uses for the request (vLLM's request id);
    ``position`` is the block's index in the request's token prefix (0 = the first
    block); ``group`` is the KV cache group (0 for a model with one group).
    """

    request_id: Hashable
    position: int = 0
    group: int = 0


class RequestAwarePolicy(EvictionPolicy[K]):
    """An eviction policy that also accepts the request behind each use.

    The defaults ignore the context, so a subclass overrides only what it uses. The
    key-only methods stay the contract: a caller without a request calls ``access`` /
    ``insert``, and the policy must treat each such call as one use.
    """

    def access_in(self, key: K, context: RequestContext) -> None:
        """Record a use of resident ``key`` by ``context``'s request (ignored when absent).

        Repeated calls for the same key and request are one use.
        """
        self.access(key)

    def insert_in(self, key: K, context: RequestContext) -> None:
        """``insert(key)``, stored by ``context``'s request (that store is its use)."""
        self.insert(key)


def access_with(policy: EvictionPolicy[K], key: K, context: RequestContext | None) -> None:
    """``policy.access_in(key, context)`` where the policy takes context, else ``access(key)``."""
    if context is not None and isinstance(policy, RequestAwarePolicy):
        policy.access_in(key, context)
    else:
        policy.access(key)


def insert_with(policy: EvictionPolicy[K], key: K, context: RequestContext | None) -> None:
    """``policy.insert_in(key, context)`` where the policy takes context, else ``insert(key)``."""
    if context is not None and isinstance(policy, RequestAwarePolicy):
        policy.insert_in(key, context)
    else:
        policy.insert(key)
