"""Loads: answering the engine's lookups, and the pins of the blocks it loads.

:class:`LoadsMixin` implements the load side of the
:class:`~tiering.core.contract.OffloadingManager` contract. ``lookup`` answers from
the primary tier, from a promotion on its way (collecting results first, so a
landed one is a hit this step), from the failed-promotion back-off, and else
asks the secondary tiers in order (those the request's ``kv_load_tiers``
allows), starting a promotion from the first that holds the block
(:mod:`tiering.manager.promotion`). ``prepare_load`` / ``complete_load``
count the engine's own pins, so the engine can release only what it took,
never the pins that protect in-flight cascades.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from tiering.core.errors import ContractError
from tiering.core.keys import OffloadKey, ReqContext
from tiering.core.specs import LoadStoreSpec
from tiering.manager.filters import ALL
from tiering.manager.results import ResultsMixin


class LoadsMixin(ResultsMixin):
    """The engine's lookups and load pins."""

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True if readable in the primary tier; None while being promoted; else False.

        On a primary miss the secondary tiers are asked in order; the first
        that holds the block gets a promotion job (submitted at the next
        :meth:`step` or sooner) and the answer is None until it lands. If no
        primary block can be reserved the answer is False (a miss).

        A block answered True is not evicted to make room for a promotion
        until the step ends (:meth:`step`, :meth:`prepare_store` or
        :meth:`take_events`), so the engine's ``prepare_load`` of this step's
        hits never finds them gone.
        """
        self._check_open()
        self._lookups += 1
        primary = self._primary
        if primary.is_ready(key):
            self._hit(key)
            return True
        if key in self._promoting:
            # The engine retries the lookup of a key on its way: collect results now, so a
            # landed promotion is a hit this step rather than the next.
            self._flush_staged()
            self._poll(landed_only=True)
            if primary.is_ready(key):
                self._hit(key)
                return True
            if key in self._promoting:
                self._retries += 1
                return None
            # The promotion failed during the poll: the back-off below answers False.
        elif primary.is_stored_or_in_flight(key):
            # Being stored from the GPU right now: the primary tier's own answer.
            answer = primary.lookup(key, req_context)
            self._count_answer(key, answer)
            return answer
        if self._backoff:
            retry_at = self._backoff.get(key)
            if retry_at is not None:
                if self._clock() < retry_at:
                    self._primary_counters.misses += 1
                    return False
                del self._backoff[key]
        pending = False
        load_filter = self._filters.of(req_context)[0]
        for position, tier in enumerate(self._tiers):
            if load_filter is not ALL and not load_filter.allows(tier.medium, tier.locality):
                continue  # the request's kv_load_tiers leaves this tier out
            try:
                answer = tier.lookup(key, req_context)
            except Exception:
                self._internal_error(f"lookup in tier {self._tier_counters[position].name}")
                continue
            if answer is True:
                self._tier_counters[position].hits += 1
                return self._start_promotion(key, position, req_context)
            if answer is None:
                pending = True
            else:
                self._tier_counters[position].misses += 1
        if pending:
            self._retries += 1
            return None
        self._primary_counters.misses += 1
        return False

    def prepare_load(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin readable primary blocks for the engine to copy to the GPU (until complete_load).

        Raises :class:`~tiering.core.errors.ContractError` (from the primary tier)
        if a key is not readable, changing nothing.
        """
        self._check_open()
        spec = self._primary.prepare_load(keys, req_context)
        pins = self._user_load_pins
        for key in keys:
            pins[key] = pins.get(key, 0) + 1
        return spec

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Release the pins of a previous :meth:`prepare_load` of these keys.

        Raises :class:`~tiering.core.errors.ContractError`, changing nothing, for a
        key the engine has not pinned (the manager's own pins, which protect
        in-flight cascades, cannot be released through this call).
        """
        self._check_open()
        pins = self._user_load_pins
        wanted: dict[OffloadKey, int] = (
            dict(Counter(keys)) if len(set(keys)) != len(keys) else dict.fromkeys(keys, 1)
        )
        for key, count in wanted.items():
            if pins.get(key, 0) < count:
                raise ContractError(
                    f"complete_load of block {bytes(key).hex()} which is not pinned by a "
                    "prepare_load (or was already completed)"
                )
        self._primary.complete_load(keys)
        for key, count in wanted.items():
            left = pins[key] - count
            if left:
                pins[key] = left
            else:
                del pins[key]
