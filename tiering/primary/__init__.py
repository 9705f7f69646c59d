"""The CPU primary tier: a block pool over one host buffer, with pins and an eviction policy.

Every block of the host buffer is in exactly one state:

* **free**: on the free list (a stack, so allocation is O(1));
* **storing**: reserved by ``prepare_store`` for a key whose bytes a worker is
  writing; pinned by the store until ``complete_store``, not readable;
* **ready**: holds a key's bytes; readable (``lookup`` is True) and known to
  the eviction policy; evictable unless pinned by loads
  (``prepare_load`` ... ``complete_load``, which nest).

All methods run on the scheduler thread, never block and do O(1) work per key
(``check_invariants`` excepted). Misuse raises
:class:`~tiering.core.errors.ContractError` naming the offending keys, before
anything changes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

from tiering.core.contract import OffloadingEvent, OffloadingManager, PrepareStoreOutput
from tiering.core.errors import ConfigError, ContractError, TierClosedError
from tiering.core.keys import OffloadKey, ReqContext
from tiering.core.specs import CPULoadStoreSpec
from tiering.policies import EvictionPolicy, PolicyChoice, make_policy
from tiering.policies.request import RequestAwarePolicy, RequestContext, insert_with
from tiering.primary.host_buffer import BlockGeometry, HostBuffer, validate_geometry

MEDIUM = "CPU"
_KEYS_SHOWN = 4


def describe_keys(keys: Sequence[object]) -> str:
    """``"2 keys: 0a1b..., 0c2d..."``: a short, readable list for error messages."""
    shown = []
    for key in keys[:_KEYS_SHOWN]:
        shown.append(key.hex() if isinstance(key, (bytes, bytearray)) else repr(key))
    more = f", ... ({len(keys) - _KEYS_SHOWN} more)" if len(keys) > _KEYS_SHOWN else ""
    noun = "key" if len(keys) == 1 else "keys"
    return f"{len(keys)} {noun}: {', '.join(shown)}{more}"


class CPUPrimaryTier(BlockGeometry, OffloadingManager):
    """The seed's CPU ``OffloadingManager``: ``num_blocks`` rows of ``block_bytes`` in host memory.

    ``eviction_policy`` is any setting :func:`~tiering.policies.resolve_policy`
    accepts (``"lru"``, ``"arc"``, ``"kvaware"``, ``"pkg.mod:Class"``, a mapping
    with options) or a resolved :class:`~tiering.policies.PolicyChoice`. The buffer is created
    (anonymous, or the shared-memory object ``shared_name`` that a worker
    process attaches to) unless an existing :class:`HostBuffer` of the same
    geometry is passed as ``buffer``; only a buffer the tier created is closed
    (and unlinked) by :meth:`shutdown`. With ``enable_events`` the tier
    collects an :class:`OffloadingEvent` per batch of blocks stored or
    evicted, for :meth:`take_events`.

    Raises :class:`~tiering.core.errors.ConfigError` for a bad policy name,
    geometry or buffer, before allocating anything.
    """

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        eviction_policy: str | Mapping[str, Any] | PolicyChoice = "lru",
        *,
        enable_events: bool = True,
        buffer: HostBuffer | None = None,
        shared_name: str | None = None,
        require_alignment: bool = True,
    ) -> None:
        validate_geometry(num_blocks, block_bytes, require_alignment)
        policy = cast("EvictionPolicy[OffloadKey]", make_policy(eviction_policy, num_blocks))
        if buffer is None:
            buffer = HostBuffer.create(
                num_blocks,
                block_bytes,
                shared_name=shared_name,
                require_alignment=require_alignment,
            )
            self._owns_buffer = True
        else:
            if shared_name is not None:
                raise ConfigError("pass either buffer or shared_name, not both")
            if buffer.closed:
                raise ConfigError(f"{buffer!r} is closed")
            if (buffer.num_blocks, buffer.block_bytes) != (num_blocks, block_bytes):
                raise ConfigError(
                    f"buffer has {buffer.num_blocks} x {buffer.block_bytes} bytes, expected "
                    f"{num_blocks} x {block_bytes}"
                )
            self._owns_buffer = False
        self._buffer = buffer
        self._num_blocks = num_blocks
        self._block_bytes = block_bytes
        self._policy = policy
        self._enable_events = enable_events
        # Popped from the end: block 0 is handed out first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._storing: dict[OffloadKey, int] = {}
        #: For a request-aware policy: the request that prepared each key being stored.
        self._storing_for: dict[OffloadKey, RequestContext] = {}
        self._ready: dict[OffloadKey, int] = {}
        # Load pins of ready keys (absent = 0). A storing key is pinned once, by its store.
        self._load_pins: dict[OffloadKey, int] = {}
        self._events: list[OffloadingEvent] = []
        self._closed = False

    # -- geometry -------------------------------------------------------------------------

    @property
    def medium(self) -> str:
        return MEDIUM

    @property
    def buffer(self) -> HostBuffer:
        return self._buffer

    @property
    def kv_view(self) -> memoryview:
        """The host buffer as a ``(num_blocks, block_bytes)`` memoryview (secondary tiers' rows)."""
        return self._buffer.view

    @property
    def eviction_policy(self) -> EvictionPolicy[OffloadKey]:
        """The policy ordering ready keys (read it; only this tier may change it)."""
        return self._policy

    # -- state queries (O(1)) -------------------------------------------------------------

    def is_ready(self, key: OffloadKey) -> bool:
        """Whether ``key``'s bytes are stored and readable."""
        return key in self._ready

    def is_stored_or_in_flight(self, key: OffloadKey) -> bool:
        """Whether ``key`` is ready or being stored (a ``prepare_store`` would skip it)."""
        return key in self._ready or key in self._storing

    def block_id(self, key: OffloadKey) -> int:
        """The buffer row of a ready or storing key; ContractError for any other key."""
        block = self._ready.get(key)
        if block is None:
            block = self._storing.get(key)
            if block is None:
                raise ContractError(
                    f"block_id: not stored nor being stored: {describe_keys([key])}"
                )
        return block

    def pin_count(self, key: OffloadKey) -> int:
        """Pins on ``key``: its loads in progress, plus one while it is being stored."""
        return self._load_pins.get(key, 0) + (key in self._storing)

    def num_ready(self) -> int:
        return len(self._ready)

    def num_free(self) -> int:
        return len(self._free)

    def num_storing(self) -> int:
        return len(self._storing)

    def num_pinned(self) -> int:
        """Blocks that cannot be evicted now (being stored or being loaded)."""
        return len(self._storing) + len(self._load_pins)

    # -- the OffloadingManager contract ---------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True if ``key`` is ready; False otherwise (a store in flight is not readable yet)."""
        return key in self._ready

    def prepare_load(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        """Pin ready blocks for a worker to read; the spec lists their rows in key order.

        A key listed twice is pinned twice (and must be completed twice).
        Raises :class:`~tiering.core.errors.ContractError` naming the keys that are
        not ready, changing nothing.
        """
        self._check_open()
        keys = _as_sequence(keys)
        ready = self._ready
        try:
            block_ids = [ready[key] for key in keys]
        except KeyError:
            raise self._not_ready_error("prepare_load", keys) from None
        pins = self._load_pins
        for key in keys:
            pins[key] = pins.get(key, 0) + 1
        return CPULoadStoreSpec.of_own_rows(block_ids)

    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:
        """Record a use of the ready keys; unknown or storing keys are ignored.

        The first key ends most recently used: a prefix's later blocks are
        worthless without its earlier ones, so those go first. A request-aware
        policy (:class:`~tiering.policies.request.RequestAwarePolicy`) gets the
        request with each key - its id, the key's position in ``keys`` (the
        request's blocks in prefix order) and its KV group - so that an engine
        touching a request's blocks once per decoded token counts one use.
        """
        keys = _as_sequence(keys)
        policy = self._policy
        request = req_context.req_id
        if request and isinstance(policy, RequestAwarePolicy):
            for position in range(len(keys) - 1, -1, -1):
                key = keys[position]
                policy.access_in(key, RequestContext(request, position, _group(key)))
            return
        access = policy.access
        for key in reversed(keys):
            access(key)

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Release one load pin per listed key (a key listed twice releases two).

        Raises :class:`~tiering.core.errors.ContractError` naming the keys without
        that many load pins, changing nothing.
        """
        pins = self._load_pins
        keys = list(keys)
        if len(set(keys)) == len(keys):
            unpinned = [key for key in keys if key not in pins]
        else:
            counts = Counter(keys)
            unpinned = [key for key, n in counts.items() if pins.get(key, 0) < n]
        if unpinned:
            raise ContractError(
                f"complete_load of keys not pinned by a prepare_load: {describe_keys(unpinned)}"
            )
        for key in keys:
            remaining = pins[key] - 1
            if remaining:
                pins[key] = remaining
            else:
                del pins[key]

    def prepare_store(
        self, keys: Sequence[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Reserve rows for the keys neither ready nor being stored, evicting if needed.

        ``keys_to_store`` keeps request order (duplicates once); the spec's
        rows match it. Victims are the policy's choice among ready blocks that
        are not pinned and not among ``keys`` (evicting part of the prefix
        being stored would be self-defeating). Returns None, changing nothing,
        when that leaves too few blocks; the check is O(1) counting, done
        before any state changes.
        """
        self._check_open()
        ready, storing, pins = self._ready, self._storing, self._load_pins
        requested = dict.fromkeys(keys)  # distinct, in order
        to_store: list[OffloadKey] = []
        protected = 0  # ready, unpinned keys of this request: not evicted for it
        for key in requested:
            if key in ready:
                if key not in pins:
                    protected += 1
            elif key not in storing:
                to_store.append(key)
        free = self._free
        shortfall = len(to_store) - len(free)
        evicted: list[OffloadKey] = []
        if shortfall > 0:
            evictable = len(ready) - len(pins) - protected
            if shortfall > evictable:
                return None
            evicted = self._evict(shortfall, lambda k: k not in pins and k not in requested)
        count = len(to_store)
        block_ids = free[len(free) - count :]
        block_ids.reverse()  # as if popped one by one: low rows first on a fresh pool
        del free[len(free) - count :]
        storing.update(zip(to_store, block_ids, strict=True))
        request = req_context.req_id
        if request and isinstance(self._policy, RequestAwarePolicy):
            positions = {key: i for i, key in enumerate(requested)}
            self._storing_for.update(
                (key, RequestContext(request, positions[key], _group(key))) for key in to_store
            )
        return PrepareStoreOutput(
            keys_to_store=to_store,
            store_spec=CPULoadStoreSpec.of_own_rows(block_ids),
            evicted_keys=evicted,
        )

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """Finish prepared stores: ready (and announced) on success, rows freed on failure.

        Every key must be being stored, listed once. Raises
        :class:`~tiering.core.errors.ContractError` naming the keys that are not
        (already completed, never prepared, or duplicated), changing nothing.
        """
        storing = self._storing
        keys = list(keys)
        bad = [key for key in keys if key not in storing]
        if bad or len(set(keys)) != len(keys):
            raise self._bad_complete_store_error(keys, bad)
        storing_for = self._storing_for
        if success:
            ready, policy = self._ready, self._policy
            # Last key first, so the first key of a prefix ends most recently used.
            for key in reversed(keys):
                ready[key] = storing.pop(key)
                insert_with(policy, key, storing_for.pop(key, None) if storing_for else None)
            if self._enable_events and keys:
                self._events.append(OffloadingEvent(keys, self._block_bytes, MEDIUM, False))
        else:
            free = self._free
            for key in keys:
                free.append(storing.pop(key))
                storing_for.pop(key, None)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored / evicted batches since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        """Forget every block and release the buffer if this tier created it. Idempotent.

        Views of the buffer held elsewhere stay valid until released.
        """
        if self._closed:
            return
        self._closed = True
        # Forgotten, so that no lookup answers a hit for a row nobody can read any more;
        # every row free again (the bookkeeping stays consistent for check_invariants).
        policy = self._policy
        for key in self._ready:
            policy.remove(key)
        self._ready.clear()
        self._storing.clear()
        self._storing_for.clear()
        self._load_pins.clear()
        self._free = list(range(self._num_blocks - 1, -1, -1))
        if self._owns_buffer:
            self._buffer.close()
            self._buffer.unlink()

    # -- invariants -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the pool's bookkeeping is inconsistent (O(num_blocks))."""
        ready, storing, free, pins = self._ready, self._storing, self._free, self._load_pins
        n = self._num_blocks
        assert len(free) + len(ready) + len(storing) == n, (
            f"{len(free)} free + {len(ready)} ready + {len(storing)} storing != {n} blocks"
        )
        blocks = [*free, *ready.values(), *storing.values()]
        assert sorted(blocks) == list(range(n)), "a block is lost or held twice"
        assert not ready.keys() & storing.keys(), "a key is both ready and storing"
        assert self._storing_for.keys() <= storing.keys(), "a request kept for no store"
        assert pins.keys() <= ready.keys(), "a load pin on a key that is not ready"
        assert all(count > 0 for count in pins.values()), "a zero load-pin count is kept"
        assert set(self._policy) == ready.keys(), "policy and ready blocks disagree"
        self._policy.check_invariants()

    # -- internals ------------------------------------------------------------------------

    def _evict(self, count: int, can_evict: Callable[[OffloadKey], bool]) -> list[OffloadKey]:
        victims = self._policy.evict(count, can_evict)
        if len(victims) != count:
            # The caller counted enough evictable keys: the policy broke its contract.
            raise RuntimeError(
                f"{type(self._policy).__name__}.evict returned {len(victims)} of {count} "
                "evictable keys"
            )
        ready, free = self._ready, self._free
        for key in victims:
            free.append(ready.pop(key))
        if self._enable_events:
            self._events.append(OffloadingEvent(victims, self._block_bytes, MEDIUM, True))
        return victims

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError("the CPU primary tier was shut down")

    def _not_ready_error(self, operation: str, keys: Sequence[OffloadKey]) -> ContractError:
        storing = [key for key in keys if key in self._storing]
        unknown = [key for key in keys if key not in self._ready and key not in self._storing]
        parts = []
        if unknown:
            parts.append(f"not stored: {describe_keys(unknown)}")
        if storing:
            parts.append(f"store still in flight: {describe_keys(storing)}")
        return ContractError(f"{operation} of keys that are not ready ({'; '.join(parts)})")

    def _bad_complete_store_error(
        self, keys: list[OffloadKey], bad: list[OffloadKey]
    ) -> ContractError:
        completed = [key for key in bad if key in self._ready]
        unprepared = [key for key in bad if key not in self._ready]
        duplicated = [key for key, n in Counter(keys).items() if n > 1]
        parts = []
        if completed:
            parts.append(f"already completed: {describe_keys(completed)}")
        if unprepared:
            parts.append(f"never prepared (or already failed): {describe_keys(unprepared)}")
        if duplicated:
            parts.append(f"listed more than once: {describe_keys(duplicated)}")
        return ContractError(f"complete_store rejected ({'; '.join(parts)})")


def _as_sequence(keys: Iterable[OffloadKey]) -> Sequence[OffloadKey]:
    # Callers pass lists or tuples; anything else (a generator, a set) is read once here.
    return keys if isinstance(keys, (list, tuple)) else list(keys)


def _group(key: OffloadKey) -> int:
    """The KV group of ``key`` (``make_offload_key``'s 4-byte suffix)."""
    return int.from_bytes(key[-4:], "big")
