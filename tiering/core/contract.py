"""The scheduler-facing contract: ``OffloadingManager`` and its result types.

This is the seed's ``vllm.v1.kv_offload.base`` contract. Every method runs on
the scheduler thread, is synchronous, and must not block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tiering.core.keys import OffloadKey, ReqContext
from tiering.core.specs import LoadStoreSpec


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """What ``prepare_store`` decided.

    ``keys_to_store`` are the requested keys that were not already offloaded,
    in request order; ``store_spec`` says where the worker must write them (one
    destination per key, same order); ``evicted_keys`` were removed to make room.
    """

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass(frozen=True, slots=True)
class OffloadingEvent:
    """Blocks that became available (``removed=False``) or were dropped from a medium."""

    keys: list[OffloadKey]
    block_size: int
    medium: str
    removed: bool
    #: The tier's declared locality (``"LOCAL"`` / ``"REMOTE"``), None if undeclared.
    locality: str | None = None


class OffloadingManager(ABC):
    """Tracks offloaded blocks and decides what is stored, kept and evicted.

    A block's life: ``prepare_store`` reserves room and pins it, the worker
    writes the bytes, ``complete_store`` makes it readable (a hit for
    ``lookup``). ``prepare_load`` pins readable blocks for a worker to read
    until ``complete_load``. A pinned block is never evicted.
    """

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """Whether the block is offloaded and ready to be read.

        Returns True (ready), False (not offloaded) or None (retry later: the
        block is on its way, e.g. being promoted from a secondary tier).
        """

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin the given readable blocks and say where a worker can read them.

        Every key must be readable (``lookup`` returned True). The blocks stay
        protected from eviction until ``complete_load``. Raises
        :class:`~tiering.core.errors.ContractError` otherwise, changing nothing.
        """

    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:  # noqa: B027
        """Mark blocks as recently used for the eviction policy. Unknown keys are ignored."""

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027
        """Release the pins taken by a previous ``prepare_load`` of these keys."""

    @abstractmethod
    def prepare_store(
        self, keys: Sequence[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Reserve room for the blocks not yet offloaded, evicting if needed.

        Returns None, changing nothing, when room cannot be made (every
        candidate is pinned). Reserved blocks are pinned and not readable until
        ``complete_store``.
        """

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:  # noqa: B027
        """Finish a prepared store: readable on success, freed on failure."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events (stored / removed blocks) collected since the last call."""
        return ()

    def shutdown(self) -> None:  # noqa: B027
        """Release every resource (threads, buffers, connections). Idempotent."""
