"""The state one check runs with: seeded keys and bytes, tracked tier calls, verification.

This module owns what every check shares: :class:`Kit` derives each key and
each block's bytes from the run's seed and the check's name (so a failure
reproduces exactly with the same seed), opens fresh tiers from the factory
with a sink recording the keys they report removed, and verifies blocks in
full, naming the key and saying whose bytes came back. :class:`TrackedTier`
wraps a tier so that every call has a deadline (a hung operation fails the
check naming the operation and the key) and the calls still running can be
listed when a whole check times out. :class:`KitFailure` is the one-line
verdict a check raises.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

import numpy as np

from tiering.core.errors import BlockNotFound
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.testing.conformance.options import KitOptions
from tiering.tier import AsyncTier, TierContext

#: Returns a fresh, unopened tier (sync or async). See :func:`check_tier`.
TierFactory = Callable[[], AsyncTier | Awaitable[AsyncTier]]

T = TypeVar("T")

#: A block's bytes as the kit holds them.
Block = bytes | bytearray


class KitFailure(AssertionError):
    """A check's verdict: the tier broke the contract (the message says how and on which key)."""


class Skip(Exception):
    """Raised by a check that does not apply to this tier."""


def show_key(key: bytes) -> str:
    """A key as the kit prints it: hex, shortened."""
    text = bytes(key).hex()
    return text if len(text) <= 24 else f"{text[:20]}..{text[-4:]}"


class TrackedTier:
    """A tier whose every call has a deadline and is listed while it runs.

    Only the calls the checks make go through here; the tier itself is
    untouched (``tier`` is the real one, e.g. for the runtime).
    """

    def __init__(self, tier: AsyncTier, op_timeout_s: float, pending: dict[object, str]) -> None:
        self.tier = tier
        self._timeout = op_timeout_s
        self._pending = pending  # shared by the check's tiers: call token -> description

    @property
    def max_concurrency(self) -> int:
        return self.tier.max_concurrency

    async def _call(self, what: str, operation: Awaitable[T]) -> T:
        call = object()
        self._pending[call] = what
        try:
            deadline = asyncio.timeout(self._timeout)
            try:
                async with deadline:
                    return await operation
            except TimeoutError:
                if deadline.expired():
                    raise KitFailure(
                        f"{what} did not finish within {self._timeout:g} s "
                        "(op_timeout_s): the operation hangs"
                    ) from None
                raise
        finally:
            del self._pending[call]

    async def open(self, context: TierContext) -> None:
        await self._call("open()", self.tier.open(context))

    async def aclose(self) -> None:
        await self._call("aclose()", self.tier.aclose())

    async def contains(self, key: OffloadKey) -> bool:
        return await self._call(f"contains(key {show_key(key)})", self.tier.contains(key))

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        await self._call(f"read(key {show_key(key)})", self.tier.read(key, into))

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        await self._call(f"write(key {show_key(key)})", self.tier.write(key, data))

    async def delete(self, key: OffloadKey) -> None:
        await self._call(f"delete(key {show_key(key)})", self.tier.delete(key))

    async def touch(self, keys: Sequence[OffloadKey]) -> None:
        await self._call(f"touch({_keys(keys)})", self.tier.touch(keys))

    async def list_keys(self) -> Iterable[OffloadKey]:
        return await self._call("list_keys()", self.tier.list_keys())

    async def contains_many(self, keys: Sequence[OffloadKey]) -> list[bool]:
        return await self._call(f"contains_many({_keys(keys)})", self.tier.contains_many(keys))

    async def read_many(self, keys: Sequence[OffloadKey], into: Sequence[memoryview]) -> None:
        await self._call(f"read_many({_keys(keys)})", self.tier.read_many(keys, into))

    async def write_many(self, keys: Sequence[OffloadKey], data: Sequence[memoryview]) -> None:
        await self._call(f"write_many({_keys(keys)})", self.tier.write_many(keys, data))


def _keys(keys: Sequence[OffloadKey]) -> str:
    if len(keys) == 1:
        return f"key {show_key(keys[0])}"
    first = f", first {show_key(keys[0])}" if keys else ""
    return f"{len(keys)} keys{first}"


class Kit:
    """One check's run: options (seed fixed), factory, keys, bytes and tiers it opened."""

    def __init__(self, check: str, factory: TierFactory, options: KitOptions) -> None:
        assert options.seed is not None, "resolve the seed first (KitOptions.with_seed)"
        self.check = check
        self.factory = factory
        self.options = options
        self.seed = options.seed
        self._counter = 0
        #: Keys any tier of this check reported removed (report_removed).
        self.removed: set[bytes] = set()
        #: digest of bytes written -> the key they were written for (to name a collision).
        self._written: dict[bytes, tuple[OffloadKey, int]] = {}
        #: Tier calls in flight, for the message of a check that times out.
        self.pending: dict[object, str] = {}

    # -- keys and bytes ---------------------------------------------------------------------

    def key(self) -> OffloadKey:
        """The next key of this check: a function of the seed, the check's name and a counter."""
        self._counter += 1
        digest = hashlib.blake2b(
            f"{self.seed}/{self.check}/{self._counter}".encode(), digest_size=16
        ).digest()
        return make_offload_key(digest, 0)

    def keys(self, count: int) -> list[OffloadKey]:
        return [self.key() for _ in range(count)]

    def data(self, key: OffloadKey, version: int = 0) -> bytearray:
        """The bytes written for ``key`` (``version`` tells an overwrite's bytes apart)."""
        seed = int.from_bytes(
            hashlib.blake2b(bytes(key) + version.to_bytes(4, "big"), digest_size=8).digest()
        )
        block = bytearray(np.random.default_rng(seed).bytes(self.options.block_bytes))
        self._written.setdefault(_digest(block), (key, version))
        return block

    # -- tiers --------------------------------------------------------------------------------

    def context(self) -> TierContext:
        return TierContext(
            block_bytes=self.options.block_bytes,
            layout_fingerprint=self.options.layout_fingerprint,
            name="conformance",
        )

    async def new_raw_tier(self) -> AsyncTier:
        """A fresh, unopened tier from the factory, its removals recorded in :attr:`removed`."""
        made = self.factory()
        tier = await made if inspect.isawaitable(made) else made
        if not isinstance(tier, AsyncTier):
            raise TypeError(f"the factory returned {type(tier).__name__}, not an AsyncTier")
        tier._bind_removed_sink(self.removed.update)
        return tier

    async def new_tier(self, *, open_it: bool = True) -> TrackedTier:
        tier = TrackedTier(await self.new_raw_tier(), self.options.op_timeout_s, self.pending)
        if open_it:
            await tier.open(self.context())
        return tier

    def capacity(self, tier: TrackedTier) -> int | None:
        """The declared capacity in blocks (KitOptions, else the tier's attribute), or None."""
        if self.options.capacity_blocks is not None:
            return self.options.capacity_blocks
        own = getattr(tier.tier, "capacity_blocks", None)
        return own if isinstance(own, int) and not isinstance(own, bool) else None

    def concurrency(self, tier: TrackedTier) -> int:
        wanted = self.options.concurrency or max(2, min(64, tier.max_concurrency))
        return self.within_capacity(tier, wanted)

    def within_capacity(self, tier: TrackedTier, count: int) -> int:
        """``count`` keys, or fewer so that they all fit in a bounded tier at once."""
        capacity = self.capacity(tier)
        return count if capacity is None else max(1, min(count, capacity))

    # -- verification -------------------------------------------------------------------------

    def fail(self, message: str) -> KitFailure:
        return KitFailure(message)

    def mismatch(self, key: OffloadKey, expected: Block, got: Block, what: str) -> KitFailure:
        """A failure naming ``key``, how its bytes differ and, if known, whose bytes came back."""
        ours = np.frombuffer(expected, dtype=np.uint8)
        theirs = np.frombuffer(got, dtype=np.uint8)
        differing = np.flatnonzero(ours != theirs)
        owner = self._written.get(_digest(got))
        if owner is not None and owner[0] != key:
            whose = f"; they are the bytes written for key {show_key(owner[0])} (two keys collide)"
        elif owner is not None:
            whose = f"; they are version {owner[1]} of this key's bytes (a stale block)"
        elif not theirs.any():
            whose = "; all zeros"
        else:
            whose = ""
        return KitFailure(
            f"key {show_key(key)}: {what} returned other bytes than written: "
            f"{differing.size} of {ours.size} bytes differ, first at offset "
            f"{int(differing[0])}{whose}"
        )

    async def read_back(self, tier: TrackedTier, key: OffloadKey) -> bytes:
        into = bytearray(self.options.block_bytes)
        await tier.read(key, memoryview(into))
        return bytes(into)

    async def expect(
        self, tier: TrackedTier, key: OffloadKey, data: Block, what: str = "read()"
    ) -> None:
        """``key`` reads back as ``data`` in full (a key reported removed may be absent)."""
        try:
            got = await self.read_back(tier, key)
        except BlockNotFound:
            if bytes(key) in self.removed:
                return
            raise self.fail(
                f"key {show_key(key)}: {what} raised BlockNotFound for a block written and "
                "never reported removed (report_removed)"
            ) from None
        if got != data:
            raise self.mismatch(key, data, got, what)

    async def write_all(
        self, tier: TrackedTier, keys: Sequence[OffloadKey], blocks: Sequence[bytearray]
    ) -> None:
        """Write every block, ``concurrency`` at once, alternating single and batch forms."""
        step = self.concurrency(tier)
        for wave, start in enumerate(range(0, len(keys), step)):
            chunk = list(zip(keys[start : start + step], blocks[start : start + step], strict=True))
            if wave % 2:
                await tier.write_many([k for k, _ in chunk], [memoryview(b) for _, b in chunk])
            else:
                await gather_all(tier.write(k, memoryview(b)) for k, b in chunk)

    async def verify_all(
        self, tier: TrackedTier, keys: Sequence[OffloadKey], blocks: Sequence[Block]
    ) -> None:
        """Read every key back in full, ``concurrency`` at once; fail naming the first bad key."""
        step = self.concurrency(tier)
        for start in range(0, len(keys), step):
            chunk = list(zip(keys[start : start + step], blocks[start : start + step], strict=True))
            await gather_all(self.expect(tier, k, b) for k, b in chunk)


def _digest(block: Block) -> bytes:
    return hashlib.blake2b(block, digest_size=16).digest()


async def gather_all(operations: Iterable[Awaitable[T]]) -> list[T]:
    """Await every operation to its end, then raise the first failure (none left running)."""
    outcomes = await asyncio.gather(*operations, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes  # type: ignore[return-value]
