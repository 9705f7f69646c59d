"""An adaptive eviction policy: recency (LRU) or reuse (ARC), whichever is winning now.

No single order wins everywhere (``docs/policies.md``): on chat workloads with small
caches the reuse order keeps shared heads that LRU thrashes (10-15 points), while near
the footprint, or on follow-ups to recent documents, LRU keeps what a frequency list
costs (0.5-2 points). ``adaptive`` keeps both orders of the same resident set and lets
the one that is doing better choose the victims:

* **two experts over one resident set**: a reuse expert
  (:class:`~tiering.policies.arc.ARCPolicy` by default, ``expert="kvaware"`` for
  :class:`~tiering.policies.kvaware.KVAwarePolicy`) sees every insert, use and removal,
  and stamps each use, so its two resident lists merged by stamp are the LRU order of
  the resident set (:mod:`tiering.policies.recency`): the LRU expert, with no order of
  its own to keep. When the LRU expert chooses, its victims leave the reuse expert as
  removals, not evictions: no ghost entry, so the reuse expert's own adaptation (ARC's ``p``) is
  driven only by its own choices (making them its ghosts measured worse: a switch back
  found the expert's target pulled off by decisions it did not make).
* **shadow caches decide** (Waldspurger et al.'s miniature simulations, the role of
  Caffeine's hill climber and of ARC's ghost hits): a spatial sample of the keys (those
  with ``hash(key) % rate == 0``) drives two standalone caches of ``capacity / rate``
  keys, one per expert, with ``rate`` chosen so each shadow holds at least ``shadow``
  keys (the whole capacity below that: exact; ``hash`` of ``str`` / ``bytes`` keys is
  salted per process, so which keys are sampled, not how many, changes between runs).
  Each shadow's hits are counted with exponential decay over ``memory x`` its capacity
  sampled uses, from the moment the shadows first evict (before that both hit alike,
  and those uses would only dilute the lead), and no switch comes before ``evidence x``
  its capacity of them. The policy follows the reuse expert until the LRU shadow's hit
  rate leads by more than ``margin``, then follows LRU until the reuse shadow leads by
  that margin (hysteresis: flapping between two orders leaves a state worse than
  either).
* **prefix order**: both experts evict oldest first, and the owner touches and stores a
  request's blocks last block first, so a prefix's tail goes before its head.
* **one use per request** (:class:`~tiering.policies.request.RequestAwarePolicy`):
  repeated touches of a block by the same request count once (vLLM touches a request's
  blocks per decoded block); key-only ``access`` counts each call. A repeated touch still
  makes the block the most recently used in both experts (without promoting it), as LRU
  does: a block a request looked up again is never the next victim before its read.

Invariants: at most ``capacity`` resident keys, each of the reuse expert's resident
lists in use order; the expert's and the shadows' own invariants hold; request marks only
for resident keys. Every operation is O(1) (plus the pinned keys ``evict`` skips); the
shadows add work for ``1 / rate`` of the operations only.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Literal

from tiering.policies.arc import ARCPolicy
from tiering.policies.base import K
from tiering.policies.kvaware import KVAwarePolicy
from tiering.policies.request import RequestAwarePolicy, RequestContext

_MISSING: object = object()

Expert = Literal["lru", "reuse"]


def _always(key: object) -> bool:
    return True


def _reuse_expert(expert: str, capacity: int) -> ARCPolicy[K] | KVAwarePolicy[K]:
    if expert == "arc":
        return ARCPolicy(capacity)
    return KVAwarePolicy(capacity)


def _number(name: str, value: object, low: float, high: float) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


class AdaptivePolicy(RequestAwarePolicy[K]):
    """LRU or a reuse expert (ARC), chosen online by sampled shadow caches.

    Options: ``expert`` (``"arc"``, default, or ``"kvaware"``), ``shadow`` (the least
    keys a shadow cache holds, 2048), ``memory`` (the shadows' hit counts decay over
    ``memory x`` shadow capacity sampled uses, 32), ``margin`` (the lead in hit rate,
    over the decayed sampled uses, needed to switch experts: 0.002, i.e. 0.2 point),
    ``start`` (the expert followed first, ``"reuse"`` or ``"lru"``), ``evidence`` (sampled
    uses, per shadow capacity, counted after the shadows first evict before any switch,
    1). See the module docstring.
    """

    def __init__(
        self,
        capacity: int,
        *,
        expert: str = "arc",
        shadow: int = 2048,
        memory: float = 32.0,
        margin: float = 0.002,
        start: str = "reuse",
        evidence: float = 1.0,
        guided: bool = True,
    ) -> None:
        super().__init__(capacity)
        if expert not in ("arc", "kvaware"):
            raise ValueError(f"expert must be 'arc' or 'kvaware', got {expert!r}")
        if isinstance(shadow, bool) or not isinstance(shadow, int) or shadow < 1:
            raise ValueError(f"shadow must be a positive int, got {shadow!r}")
        memory = _number("memory", memory, 0.01, 1e6)
        self._margin = _number("margin", margin, 0, 1)
        self._rate = max(1, capacity // shadow)
        mini = max(1, capacity // self._rate)
        # The resident set, in the reuse expert's order and (merged by use stamp) in LRU's.
        self._reuse: ARCPolicy[K] | KVAwarePolicy[K] = _reuse_expert(expert, capacity)
        # The LRU shadow is a bare ordered dict (oldest first): LRUPolicy's checks, per
        # sampled use, cost more than the order itself.
        self._shadow_lru: OrderedDict[K, None] = OrderedDict()
        self._mini = mini
        self._shadow_reuse: ARCPolicy[K] | KVAwarePolicy[K] = _reuse_expert(expert, mini)
        shadow_reuse = self._shadow_reuse
        # The shadow's one victim per miss (every key evictable): ARC's without the lists.
        self._shadow_evict: Callable[[], K] = (
            shadow_reuse.evict_one
            if isinstance(shadow_reuse, ARCPolicy)
            else lambda: shadow_reuse.evict(1, _always)[0]
        )
        self._shadow_hits = [0.0, 0.0]  # LRU's, the reuse expert's (decayed)
        self._shadow_uses = 0.0  # sampled uses (decayed alike)
        self._shadows_full = False  # counts restart when the shadows first evict
        self._evidence = _number("evidence", evidence, 0, 1e6) * mini
        # At least 0: a memory under one use (memory x shadow capacity < 1) keeps only the
        # latest use, where a negative factor would flip the counts' sign at every use.
        self._decay = max(0.0, 1.0 - 1.0 / (memory * mini))
        if start not in ("lru", "reuse"):
            raise ValueError(f"start must be 'lru' or 'reuse', got {start!r}")
        self._follow_lru = start == "lru"
        self._last_request: dict[K, Hashable] = {}
        if not isinstance(guided, bool):
            raise ValueError(f"guided must be true or false, got {guided!r}")
        # Exact shadows (rate 1) guide eviction: the resident keys each shadow has dropped,
        # oldest drop first (LRU's, the reuse expert's).
        self._guided = guided and self._rate == 1
        self._stale: tuple[OrderedDict[K, None], OrderedDict[K, None]] = (
            OrderedDict(),
            OrderedDict(),
        )

    # -- introspection ----------------------------------------------------------------------

    @property
    def following(self) -> Expert:
        """The expert choosing victims now: ``"lru"`` or ``"reuse"``."""
        return "lru" if self._follow_lru else "reuse"

    @property
    def sample_rate(self) -> int:
        """One key in ``sample_rate`` drives the shadow caches (1: all of them)."""
        return self._rate

    def shadow_hits(self) -> tuple[float, float]:
        """The decayed hit counts of the LRU shadow and of the reuse shadow."""
        return self._shadow_hits[0], self._shadow_hits[1]

    # -- shadows ------------------------------------------------------------------------------

    def _sampled(self, key: K) -> None:
        """One use of a sampled key: each shadow hits, or misses and stores it."""
        hits = self._shadow_hits
        decay = self._decay
        guided, resident = self._guided, self._reuse
        order = self._shadow_lru
        hit_lru = key in order
        if hit_lru:
            order.move_to_end(key)
        else:
            if len(order) >= self._mini:
                gone = order.popitem(last=False)[0]
                if guided and gone in resident:
                    self._stale[0][gone] = None
                if not self._shadows_full:
                    self._shadows_filled()
            order[key] = None
        shadow = self._shadow_reuse
        hit_reuse = shadow.use(key)  # a hit counts its use
        if not hit_reuse:
            if len(shadow) >= shadow.capacity:
                gone = self._shadow_evict()
                if guided and gone in resident:
                    self._stale[1][gone] = None
                if not self._shadows_full:
                    self._shadows_filled()
            shadow.insert(key)
        if guided:
            self._stale[0].pop(key, None)
            self._stale[1].pop(key, None)
        hits[0] = hits[0] * decay + hit_lru
        hits[1] = hits[1] * decay + hit_reuse
        self._shadow_uses = uses = self._shadow_uses * decay + 1.0
        if uses < self._evidence:
            return
        lead = self._margin * uses
        if self._follow_lru:
            if hits[1] - hits[0] > lead:
                self._follow_lru = False
        elif hits[0] - hits[1] > lead:
            self._follow_lru = True

    def _shadows_filled(self) -> None:
        """A shadow evicts for the first time: the counts restart (evidence starts here)."""
        self._shadows_full = True
        self._shadow_hits[0] = self._shadow_hits[1] = self._shadow_uses = 0.0

    # -- the EvictionPolicy interface ---------------------------------------------------------

    def insert(self, key: K) -> None:
        # The reuse expert's insert raises (changing nothing) for a resident key or a full
        # policy. Written out here and in insert_in / access / access_in, not shared: this
        # is the hot path, and a call per block costs (benchmarks/primary.py). access_in
        # never calls access (a subclass may route access through access_in).
        self._reuse.insert(key)
        rate = self._rate
        if rate == 1 or hash(key) % rate == 0:
            self._sampled(key)

    def insert_in(self, key: K, context: RequestContext) -> None:
        self._reuse.insert(key)
        self._last_request[key] = context.request_id
        rate = self._rate
        if rate == 1 or hash(key) % rate == 0:
            self._sampled(key)

    def access(self, key: K) -> None:
        if self._reuse.use(key):
            rate = self._rate
            if rate == 1 or hash(key) % rate == 0:
                self._sampled(key)

    def access_in(self, key: K, context: RequestContext) -> None:
        last = self._last_request
        request = context.request_id
        if last.get(key, _MISSING) != request:
            # Only resident keys have a mark, so a key without this request's mark may be
            # absent: ``use`` answers that, and an absent key is ignored.
            if self._reuse.use(key):
                last[key] = request
                rate = self._rate
                if rate == 1 or hash(key) % rate == 0:
                    self._sampled(key)
        else:
            # The same request again (a lookup before its read, a decode step): not a
            # second use, but the block is the most recently used, as under LRU, so that
            # evictions before the read take what was stored since, never this block.
            self._reuse.refresh(key)

    def remove(self, key: K) -> None:
        self._reuse.remove(key)
        if self._last_request:
            self._last_request.pop(key, None)
        if self._guided:
            self._stale[0].pop(key, None)
            self._stale[1].pop(key, None)

    def evict(self, n: int, can_evict: Callable[[K], bool]) -> list[K]:
        if n <= 0:
            return []
        last = self._last_request
        victims: list[K] = []
        if self._guided:
            victims = self._evict_stale(n, can_evict)
            n -= len(victims)
            if not n:
                return victims
        if self._follow_lru:
            chosen = self._reuse.least_recent(n, can_evict)
        else:
            chosen = self._reuse.evict(n, can_evict)
        if last:
            for key in chosen:
                last.pop(key, None)
        if self._guided:
            for stale in self._stale:
                for key in chosen:
                    stale.pop(key, None)
        victims.extend(chosen)
        return victims

    def _evict_stale(self, n: int, can_evict: Callable[[K], bool]) -> list[K]:
        """Victims among the resident keys the followed expert's exact shadow has dropped,
        oldest drop first: the resident set converges to what that expert alone would hold,
        instead of keeping what the other expert chose while it was followed."""
        follow_lru = self._follow_lru
        stale, other = self._stale if follow_lru else self._stale[::-1]
        picked: list[K] = []
        for key in stale:
            if can_evict(key):
                picked.append(key)
                if len(picked) == n:
                    break
        last = self._last_request
        # The reuse expert's own victims are its ghosts; LRU's are not (see above).
        drop = self._reuse.remove if follow_lru else self._reuse.retire
        for key in picked:
            del stale[key]
            other.pop(key, None)
            last.pop(key, None)
            drop(key)
        return picked

    def __contains__(self, key: object) -> bool:
        return key in self._reuse

    def __len__(self) -> int:
        return len(self._reuse)

    def __iter__(self) -> Iterator[K]:
        return self._reuse.recency_order()  # least recently used first

    def check_invariants(self) -> None:
        reuse = self._reuse
        assert len(reuse) <= self.capacity, (len(reuse), self.capacity)
        assert all(key in reuse for key in self._last_request), "stale request marks"
        for stale, shadow in zip(self._stale, (self._shadow_lru, self._shadow_reuse), strict=True):
            assert all(key in reuse and key not in shadow for key in stale), "stale marks"
        self._reuse.check_invariants()
        assert len(self._shadow_lru) <= self._mini, (len(self._shadow_lru), self._mini)
        self._shadow_reuse.check_invariants()
        assert all(h >= 0.0 for h in self._shadow_hits), self._shadow_hits
