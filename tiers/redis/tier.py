"""``RedisTier``: KV blocks in Redis or Redis Cluster, shared by every engine that uses it.

One Redis string per block (see :mod:`tiers.redis.layout`), written and read
with pipelines: a job's blocks travel in one round trip per node (redis-py's
cluster pipeline groups commands per node and runs the nodes concurrently).
Jobs larger than ``max_pipeline_bytes`` are split into several round trips so
neither side buffers an unbounded request. The round trips themselves (the
client, the outage gate, the time budget) live in :mod:`tiers.redis.round_trips`,
the deletes that must spare a value rewritten since in :mod:`tiers.redis.deletes`,
the verification of each loaded value in :mod:`tiers.redis.loads`, and what a
failed first contact means in :mod:`tiers.redis.opening`; this module owns the
tier's API and lifecycle: which commands each operation sends, in what chunks,
and what their replies mean for the runtime.

The server's contents change behind our back (other engines write, the server
evicts under ``maxmemory``, keys expire), so the tier is ``shared``: the
runtime resolves presence with :meth:`RedisTier.contains_many`, and a load of
a key that vanished raises :class:`~tiering.core.errors.BlockNotFound` (a miss).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from typing import Any

from tiering.core.errors import ConfigError, PartialBatchError
from tiering.core.keys import OffloadKey
from tiering.tier import AsyncTier, TierContext
from tiering.tier import auth as _auth
from tiering.tier.auth import OffLoopWork
from tiers.redis.config import RedisTierConfig
from tiers.redis.connection import build_client, translate
from tiers.redis.deletes import delete_if_header, delete_rejected
from tiers.redis.errors import RedisTierCommandError, RedisTierTimeout, RedisTierUnavailable
from tiers.redis.layout import BlockLayout, ValueBuffers, encode_off_loop
from tiers.redis.loads import ChunkChecks, Load, LoadOutcomes, load_reply, settle_checked
from tiers.redis.opening import start_error
from tiers.redis.rejections import RejectionLog
from tiers.redis.round_trips import RoundTrips
from tiers.redis.stats import RedisTierStats

logger = logging.getLogger(__name__)

_SETTINGS = frozenset(field.name for field in dataclasses.fields(RedisTierConfig) if field.init)


class RedisTier(AsyncTier):
    """A shared secondary tier in Redis (standalone) or Redis Cluster.

    Construct it with the keyword settings of :class:`RedisTierConfig` (what
    users write in ``secondary_tiers``); every value is validated here and a
    bad one raises :class:`~tiering.core.errors.ConfigError`. No connection is made
    before :meth:`open`.
    """

    shared = True
    # Set per instance: True only with an auth key. A checksum stored inside the
    # value proves the bytes intact, not who wrote them (anyone with write access
    # to the server can write a valid one), so without a key the runtime keeps
    # its own checksum of every block this process stored and verifies loads.
    verifies_reads = False

    def __init__(self, **settings: Any) -> None:
        unknown = sorted(set(settings) - _SETTINGS)
        if unknown:
            raise ConfigError(
                f"redis tier: unknown setting(s) {', '.join(map(repr, unknown))}; "
                f"accepted: {', '.join(sorted(_SETTINGS))}"
            )
        self.config = RedisTierConfig(**settings)
        self._authenticator = self.config.authenticator()
        # With an auth key every value carries a tag only key holders can make: the
        # tier's own check is then authoritative for every writer's blocks.
        self.verifies_reads = self._authenticator is not None
        # The runtime hands over at most this many blocks at once, in batch calls of
        # up to this many keys: one batch call is one pipeline, so it must be large
        # for a job to be one round trip. Connections are bounded separately.
        self.max_concurrency = self.config.max_blocks_in_flight
        self.stats = RedisTierStats()
        self._round_trips = RoundTrips(self.config, self.stats, self._name)
        self._layout: BlockLayout | None = None
        self._buffers: ValueBuffers | None = None
        self._rejections: RejectionLog | None = None
        # Headers of the values the last loads served, by key: a delete right after a
        # load (the runtime's, of a block that failed its checksum) removes only that
        # value, never a block another engine wrote since. Bounded; loop-owned.
        self._served_headers: OrderedDict[OffloadKey, bytes] = OrderedDict()
        self._max_served_headers = 2 * self.config.max_blocks_in_flight

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self, context: TierContext) -> None:
        """Build the client and check the server answers.

        With ``on_start_unreachable="fail"`` (the default) an unreachable
        server raises :class:`RedisTierUnavailable`; with ``"degrade"`` the tier
        opens anyway, reports misses and keeps retrying the connection.
        Rejected credentials and failed TLS handshakes always raise
        :class:`RedisTierCommandError`. Cancellation: the client is closed.
        """
        await super().open(context)
        self._layout = BlockLayout(
            self.config.namespace,
            context.layout_fingerprint,
            context.block_bytes,
            self._authenticator,
        )
        self._rejections = RejectionLog(logger, f"redis tier {context.name!r}")
        # Enough reusable value buffers for one full pipeline.
        self._buffers = ValueBuffers(
            self._layout.value_len, self.config.max_pipeline_bytes // self._layout.value_len
        )
        client = build_client(self.config)
        # Loads verify and copy each value while redis-py parses the pipeline's replies,
        # with the value still hot in cache, and drop it at once (see _load_reply).
        for command in ("GET", "GETEX"):
            client.set_response_callback(command, self._load_reply)
        self._round_trips.start(client)
        try:
            async with asyncio.timeout(self._round_trips.budget_s):
                await client.ping()
        except BaseException as exc:
            if not isinstance(exc, Exception):
                await self.aclose()
                raise
            error = await start_error(exc, self.config, context.name)
            if error is not None:
                await self.aclose()
                raise error from exc
            self._round_trips.note_unreachable(log=False)
            logger.warning(
                "%s: Redis at %s is unreachable at start (%s); the tier reports misses "
                "and retries the connection (on_start_unreachable='degrade')",
                context.name,
                self.config.safe_url(),
                exc,
            )
            return
        logger.info(
            "%s: connected to Redis%s at %s, namespace %r",
            context.name,
            " Cluster" if self.config.cluster else "",
            self.config.safe_url(),
            self.config.namespace,
        )

    async def aclose(self) -> None:
        """Close every connection. Idempotent.

        Cancellation: connections not yet closed are dropped with the client.
        """
        await self._round_trips.aclose()

    # -- the tier API ----------------------------------------------------------------------

    async def contains(self, key: OffloadKey) -> bool:
        """Whether ``key``'s block is in Redis now (another engine may drop it next).

        Cancellation: no side effects.
        """
        return (await self.contains_many([key]))[0]

    async def contains_many(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Presence of several blocks in one round trip per node (``STRLEN`` each).

        A key counts as present only if its value has exactly the length this
        tier writes. While the server is unreachable every key is reported
        absent (a miss), so lookups never wait on an outage.
        Cancellation: no side effects.
        """
        if not keys:
            return []
        layout = self._require_layout()
        names = [layout.redis_key(k) for k in keys]

        def fill(pipe: Any) -> None:
            for name in names:
                pipe.strlen(name)

        try:
            replies = await self._round_trips.run("STRLEN", fill)
        except (RedisTierUnavailable, RedisTierTimeout):
            return [False] * len(keys)
        return [reply == layout.value_len for reply in replies]

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        """Load ``key``'s block into ``into``; see :meth:`read_many`.

        Cancellation: the connection is dropped; ``into`` may be partly written.
        """
        await _single(self.read_many([key], [into]), key)

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        """Store ``data`` as ``key``'s block; see :meth:`write_many`.

        Cancellation: the block is either absent or complete (one atomic ``SET``).
        """
        await _single(self.write_many([key], [data]), key)

    async def read_many(self, keys: Sequence[OffloadKey], into: Sequence[memoryview]) -> None:
        """Load blocks with ``GET`` (``GETEX`` refreshing the TTL when one is set).

        Each value is verified (header, fingerprint, key, length, and the
        checksum or, with an auth key, the tag) before its bytes are copied
        into the destination row: a vanished key raises :class:`BlockNotFound`,
        a bad value :class:`~tiers.redis.errors.RejectedValue` (a
        ``CorruptBlock``), counted by reason, logged (rate limited) and deleted
        if the server still holds that same value, so no engine finds it
        again. Failures are collected into one
        :class:`PartialBatchError`. With an auth key, a chunk of at least
        ``OFFLOAD_MIN_BYTES`` is verified and copied on the hashing threads of
        :mod:`tiering.tier.auth` as its replies arrive (on machines with at least
        ``OFFLOAD_MIN_CPUS`` CPUs). Cancellation: the
        connection is dropped; destination rows may be partly written; returns
        only once no hashing thread writes into them any more.
        """
        if len(keys) != len(into):
            raise ValueError(f"{len(keys)} keys but {len(into)} destination buffers")
        layout = self._require_layout()
        ttl_ms = self.config.ttl_ms
        outcomes = LoadOutcomes()
        for lo, hi in self._chunks(len(keys)):
            chunk = keys[lo:hi]
            # Cleared once this chunk's round trip ends: a reply parsed later (a node's
            # pipeline that outlived a failed or cancelled round trip) must not write
            # into ``into``.
            live = [True]
            checks = ChunkChecks(layout) if self._off_loop(len(chunk)) else None
            loads = [
                (layout.redis_key(k), Load(k, dest, live, checks))
                for k, dest in zip(chunk, into[lo:hi], strict=True)
            ]

            def fill(pipe: Any, loads: list[tuple[bytes, Load]] = loads) -> None:
                for name, load in loads:
                    if ttl_ms is None:
                        pipe.execute_command("GET", name, kvt_load=load)
                    else:
                        pipe.execute_command("GETEX", name, "PX", ttl_ms, kvt_load=load)

            complete = False
            try:
                replies = await self._round_trips.run("GET", fill)
                complete = True
            except Exception as exc:
                outcomes.fail(chunk, exc)
                continue
            finally:
                live[0] = False
                if checks is not None:  # hashing threads may still write into ``into``
                    await checks.finish(complete)
                served = self._served_headers
                while len(served) > self._max_served_headers:
                    served.popitem(last=False)
            for key, reply in zip(chunk, replies, strict=True):
                reply = settle_checked(self._served_headers, key, reply)
                outcomes.sort(key, reply, self._translate)
        outcomes.count(self.stats, layout.block_bytes, self._rejections)
        gone, corrupt = outcomes.gone, outcomes.corrupt
        if gone or corrupt:
            self.report_removed(gone + [OffloadKey(r.key) for r in corrupt])
        if corrupt:
            await delete_rejected(self._round_trips, layout, corrupt, self.stats, self._rejections)
        if outcomes.errors:
            raise PartialBatchError(outcomes.succeeded, outcomes.errors)

    async def write_many(self, keys: Sequence[OffloadKey], data: Sequence[memoryview]) -> None:
        """Store blocks with one ``SET`` each (``PX`` when a TTL is set), pipelined.

        A ``SET`` is atomic on the server, so a block is either absent or
        complete: never readable half written. Refusals (``OOM`` under
        ``maxmemory`` with ``noeviction``, ...) fail their keys with
        :class:`RedisTierCommandError`, collected into one
        :class:`PartialBatchError`. With an auth key, a chunk of at least
        ``OFFLOAD_MIN_BYTES`` is tagged and encoded on the hashing threads of
        :mod:`tiering.tier.auth` and the loop (on machines with at least
        ``OFFLOAD_MIN_CPUS`` CPUs). Cancellation: the connection is dropped;
        each block is absent or complete; returns only once no hashing thread
        reads ``data`` any more.
        """
        if len(keys) != len(data):
            raise ValueError(f"{len(keys)} keys but {len(data)} source buffers")
        layout = self._require_layout()
        expiry = () if self.config.ttl_ms is None else ("PX", self.config.ttl_ms)
        errors: dict[bytes, BaseException] = {}
        succeeded: list[bytes] = []
        buffers = self._require_buffers()
        served = self._served_headers
        for lo, hi in self._chunks(len(keys)):
            chunk = keys[lo:hi]
            if served:  # a later delete of these keys is of the value written now
                for key in chunk:
                    served.pop(key, None)
            taken = [buffers.take() for _ in chunk]
            names = [layout.redis_key(k) for k in chunk]
            if not self._off_loop(len(chunk)):
                values = [
                    layout.encode_into(k, d, value)
                    for k, d, value in zip(chunk, data[lo:hi], taken, strict=True)
                ]
            else:
                values = await encode_off_loop(layout, OffLoopWork(), chunk, data[lo:hi], taken)
            commands = list(zip(names, values, strict=True))

            def fill(pipe: Any, commands: list[tuple[bytes, memoryview]] = commands) -> None:
                # execute_command, not pipe.set: set()'s argument checks cost more per
                # block than everything else the tier does for a 64 KiB block.
                for name, value in commands:
                    pipe.execute_command("SET", name, value, *expiry)

            try:
                replies = await self._round_trips.run("SET", fill)
            except Exception as exc:
                errors.update(dict.fromkeys(chunk, exc))
                continue
            finally:
                # redis-py has sent (copied) the values once the round trip is over.
                # Released views make any reference it kept fail loudly instead of
                # reading a reused buffer; a buffer still exported is not reused.
                reusable = []
                for (_, view), value in zip(commands, taken, strict=True):
                    try:
                        view.release()
                    except BufferError:
                        continue
                    reusable.append(value)
                buffers.give_back(reusable)
            for key, reply in zip(chunk, replies, strict=True):
                if isinstance(reply, BaseException):
                    errors[key] = self._translate(reply, "SET", key)
                else:
                    succeeded.append(key)
        self.stats.blocks_written += len(succeeded)
        self.stats.bytes_written += len(succeeded) * layout.block_bytes
        self.stats.write_failures += len(errors)
        if errors:
            raise PartialBatchError(succeeded, errors)

    async def delete(self, key: OffloadKey) -> None:
        """Remove ``key``'s block (no error if absent).

        When a recent load of this tier served ``key``, only the value it served
        is removed (compared by header on the server): what the caller saw, not
        a block another engine wrote since. Cancellation: the block is either
        still present and intact, or gone.
        """
        layout = self._require_layout()
        name = layout.redis_key(key)
        header = self._served_headers.pop(key, None)
        if header is None:
            (reply,) = await self._round_trips.run("DEL", lambda pipe: pipe.delete(name))
        else:
            (reply,) = await self._round_trips.run("DEL", delete_if_header(name, header))
        if isinstance(reply, BaseException):
            raise self._translate(reply, "DEL", key)

    async def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark blocks recently used: refresh their TTL, or their LRU clock without one.

        Best effort: an unreachable server is ignored (touch is advisory).
        Cancellation: some keys may have been touched.
        """
        if not keys:
            return
        layout = self._require_layout()
        ttl_ms = self.config.ttl_ms
        names = [layout.redis_key(k) for k in keys]

        def fill(pipe: Any) -> None:
            for name in names:
                if ttl_ms is None:
                    pipe.touch(name)
                else:
                    pipe.pexpire(name, ttl_ms)

        try:
            await self._round_trips.run("TOUCH", fill)
        except (RedisTierUnavailable, RedisTierTimeout):
            return

    # -- internals -------------------------------------------------------------------------

    def _require_buffers(self) -> ValueBuffers:
        if self._buffers is None:
            raise RuntimeError("RedisTier has not been opened")
        return self._buffers

    def _require_layout(self) -> BlockLayout:
        if self._layout is None:
            raise RuntimeError("RedisTier has not been opened")
        return self._layout

    def _chunks(self, count: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` ranges of at most ``max_pipeline_bytes`` of values each."""
        per_chunk = max(1, self.config.max_pipeline_bytes // self._require_layout().value_len)
        return [(lo, min(lo + per_chunk, count)) for lo in range(0, count, per_chunk)]

    def _name(self) -> str:
        return self._context.name if self._context is not None else "redis"

    def _translate(self, exc: BaseException, op: str, key: OffloadKey) -> BaseException:
        error = translate(exc, f"{self._round_trips.where(op)} of block {key.hex()}")
        if isinstance(error, RedisTierCommandError) and error.out_of_memory:
            self.stats.out_of_memory_rejections += 1
        return error

    def _off_loop(self, blocks: int) -> bool:
        """Whether a chunk of ``blocks`` blocks is tagged or verified on the hashing threads
        (with an auth key, where :func:`~tiering.tier.auth.offload_pays`) rather than on
        the loop thread."""
        layout = self._require_layout()
        return layout.authenticated and _auth.offload_pays(blocks * layout.block_bytes)

    def _load_reply(self, response: Any, **options: Any) -> Any:
        """redis-py's response callback for ``GET``/``GETEX`` on this tier's client.

        A load's reply (``kvt_load`` option) is verified and copied into its
        destination as it is parsed (:func:`~tiers.redis.loads.load_reply`);
        never raises. Other replies pass through.
        """
        load: Load | None = options.get("kvt_load")
        if load is None:
            return response
        return load_reply(self._require_layout(), self._served_headers, load, response)


async def _single(batch: Coroutine[Any, Any, None], key: OffloadKey) -> None:
    """Await a one-key batch operation and raise that key's own error, unwrapped."""
    try:
        await batch
    except PartialBatchError as exc:
        raise exc.errors[key] from None
