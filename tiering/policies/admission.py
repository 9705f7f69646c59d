"""Cascade admission: which blocks stored into the CPU primary tier are written to secondary tiers.

Pure, synchronous and owned by the manager (scheduler thread), like eviction
policies. The manager asks :meth:`AdmissionPolicy.admit` when blocks become ready
in the primary tier and cascades only what it returns; it tells
:meth:`AdmissionPolicy.on_use` which blocks a request used, and cascades then
what that returns (it passes only blocks ready in the primary tier, so what
comes back can be cascaded at once).

Shipped (``cascade_admission`` in ``kv_connector_extra_config``):

* ``"all"`` (default): every stored block is cascaded, as before admission existed.
* ``"reuse"``: a block is written below the primary tier once it has shown reuse:
  when it is used while in the primary tier (a prefix hit), or stored a second
  time (it came back after the primary tier evicted it). Most KV blocks are used
  once, so most never reach the disk. A first-time block is remembered (keys
  only, ``history x capacity`` of them, oldest forgotten first) so its second
  appearance is recognised. Decisions keep prefixes whole: in a batch (request
  order) blocks are admitted up to the first one refused, since a block is
  worthless in a tier that lacks its parent.

Third-party admission policies subclass :class:`AdmissionPolicy` and are named
like eviction policies (built-in name, ``pkg.mod:Class``, an entry point in
group ``kv_tiering.admission``, with options).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, Generic

from tiering.policies.base import K
from tiering.policies.registry import PolicyChoice, PolicyKind, resolve_policy

#: Entry-point group third-party packages use to publish admission policies.
ADMISSION_ENTRY_POINT_GROUP = "kv_tiering.admission"


class AdmissionPolicy(ABC, Generic[K]):
    """Decides which blocks the manager cascades to secondary tiers.

    ``capacity`` is the primary tier's number of blocks (a scale for any
    history the policy keeps). Both methods take keys in request order (a
    prefix's first block first) and return the keys to cascade now, in that
    order; a returned key must be one of the given keys.
    """

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity

    @abstractmethod
    def admit(self, keys: Sequence[K]) -> list[K]:
        """Blocks just stored into the primary tier: the ones to cascade now."""

    def on_use(self, keys: Sequence[K]) -> list[K]:
        """Blocks of a request that are ready in the primary tier: the ones to cascade now.

        By default nothing: admission is decided at store time.
        """
        return []


class AdmitAll(AdmissionPolicy[K]):
    """Cascade every stored block (the behaviour without admission)."""

    def admit(self, keys: Sequence[K]) -> list[K]:
        return list(keys)


class ReuseAdmission(AdmissionPolicy[K]):
    """Cascade a block once it shows reuse: a hit in the primary tier, or a second store.

    ``history`` (default 4.0) sizes the memory of refused blocks as a multiple
    of ``capacity``: a block stored again after more than that many other
    refusals is treated as new.
    """

    def __init__(self, capacity: int, *, history: float = 4.0) -> None:
        super().__init__(capacity)
        if (
            isinstance(history, bool)
            or not isinstance(history, (int, float))
            or not math.isfinite(history)
            or not 0 < history <= 1024
        ):
            raise ValueError(f"history must be a number in (0, 1024], got {history!r}")
        self._max_refused = max(1, int(history * capacity))
        self._refused: OrderedDict[K, None] = OrderedDict()

    @property
    def num_remembered(self) -> int:
        """Refused blocks remembered now (at most ``history x capacity``)."""
        return len(self._refused)

    def admit(self, keys: Sequence[K]) -> list[K]:
        refused = self._refused
        admitted: list[K] = []
        for position, key in enumerate(keys):
            if key in refused:  # stored before: it came back, so it is reused
                del refused[key]
                admitted.append(key)
                continue
            # Refuse this block and, to keep the prefix whole, the rest of the batch.
            for later in keys[position:]:
                refused.pop(later, None)
                refused[later] = None
            while len(refused) > self._max_refused:
                refused.popitem(last=False)
            break
        return admitted

    def on_use(self, keys: Sequence[K]) -> list[K]:
        refused = self._refused
        used: list[K] = []
        for key in keys:
            if key in refused:
                del refused[key]
                used.append(key)
        return used


BUILTIN_ADMISSION: dict[str, type[AdmissionPolicy[Any]]] = {
    "all": AdmitAll,
    "reuse": ReuseAdmission,
}

ADMISSION = PolicyKind(
    "admission policy",
    AdmissionPolicy,
    MappingProxyType(BUILTIN_ADMISSION),
    ADMISSION_ENTRY_POINT_GROUP,
    "docs/policies.md",
)

#: Built-in admission policy names.
ADMISSION_NAMES = tuple(BUILTIN_ADMISSION)


def resolve_admission(
    setting: object, *, key: str = "cascade_admission", **options: Any
) -> PolicyChoice:
    """Resolve a ``cascade_admission`` setting (spellings as for eviction policies)."""
    return resolve_policy(setting, key=key, options=options or None, kind=ADMISSION)
