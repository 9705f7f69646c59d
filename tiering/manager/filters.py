"""Per-request tier filters: ``kv_load_tiers`` and ``kv_store_tiers`` in ``kv_transfer_params``.

vLLM 0.33 (#48123) lets a request name the tiers it may load from::

    "kv_transfer_params": {"kv_load_tiers": [{"medium": "CPU"},
                                             {"medium": "STORAGE", "locality": "LOCAL"}]}

Each entry matches tiers by ``medium`` (``"CPU"``, ``"STORAGE"``) and/or
``locality`` (``"LOCAL"``, ``"REMOTE"``), case-insensitive; a key left out, or
a tier that does not declare it, matches anything. A tier takes part when any
entry matches. The same rules as vLLM's ``_parse_tier_filter``: a value that
is not a list means every tier (with a warning), an entry that is not a dict
or names an unknown medium or locality is skipped (with a warning), an empty
list means no tier, and a list whose entries were all skipped means every
tier. The CPU primary tier is always consulted, as in vLLM.

``kv_store_tiers`` has the same form and chooses the secondary tiers a
request's blocks are cascaded to (vLLM 0.33 has no such key: its manager
cascades every block to every tier; ours honours it).

Parsing runs once per ``kv_transfer_params`` object (a small cache), so the
per-key cost of a filtered request is one dict probe.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiering.core.keys import ReqContext

logger = logging.getLogger("tiering.manager")

MEDIA = ("CPU", "STORAGE")
LOCALITIES = ("LOCAL", "REMOTE")
LOAD_TIERS_KEY = "kv_load_tiers"
STORE_TIERS_KEY = "kv_store_tiers"
#: Most parsed ``kv_transfer_params`` remembered (requests in flight rarely exceed it).
_CACHE_SIZE = 4096


@dataclass(frozen=True, slots=True)
class TierMatcher:
    """One entry of a filter: a medium and/or a locality (None matches anything)."""

    medium: str | None = None
    locality: str | None = None

    def matches(self, medium: str | None, locality: str | None) -> bool:
        return (self.medium is None or medium is None or self.medium == medium) and (
            self.locality is None or locality is None or self.locality == locality
        )


@dataclass(frozen=True, slots=True)
class TierFilter:
    """Which tiers a request may use; :data:`ALL` allows every tier."""

    matchers: tuple[TierMatcher, ...] = ()

    def allows(self, medium: str | None, locality: str | None) -> bool:
        if self is ALL:
            return True
        return any(m.matches(medium, locality) for m in self.matchers)


ALL = TierFilter((TierMatcher(),))


def parse_tier_filter(raw: object, key: str = LOAD_TIERS_KEY) -> TierFilter:
    """A :class:`TierFilter` from a request's ``kv_load_tiers`` / ``kv_store_tiers`` value."""
    if not isinstance(raw, list):
        logger.warning(
            "%s: expected a list of matchers, got %s; every tier", key, type(raw).__name__
        )
        return ALL
    matchers: list[TierMatcher] = []
    for entry in raw:
        if not isinstance(entry, Mapping):
            logger.warning("%s: an entry is not a dict (%r); skipped", key, entry)
            continue
        medium_ok, medium = _choice(entry.get("medium"), MEDIA)
        locality_ok, locality = _choice(entry.get("locality"), LOCALITIES)
        if not (medium_ok and locality_ok):
            logger.warning("%s: unknown medium or locality in %r; skipped", key, dict(entry))
            continue
        matchers.append(TierMatcher(medium, locality))
    if matchers:
        return TierFilter(tuple(matchers))
    return TierFilter(()) if not raw else ALL


def _choice(value: object, allowed: tuple[str, ...]) -> tuple[bool, str | None]:
    """``(known, value upper-cased)``; an absent value is known and None."""
    if value is None:
        return True, None
    if isinstance(value, str) and value.upper() in allowed:
        return True, value.upper()
    return False, None


class RequestFilters:
    """The load and store filters of each request's ``kv_transfer_params``, parsed once."""

    def __init__(self) -> None:
        self._parsed: dict[int, tuple[Mapping[str, Any], TierFilter, TierFilter]] = {}

    def of(self, req_context: ReqContext) -> tuple[TierFilter, TierFilter]:
        """``(load filter, store filter)`` of the request (both :data:`ALL` by default)."""
        params = req_context.kv_transfer_params
        if not params:
            return ALL, ALL
        cached = self._parsed.get(id(params))
        if cached is not None and cached[0] is params:
            return cached[1], cached[2]
        load, store = (
            parse_tier_filter(params[key], key) if key in params else ALL
            for key in (LOAD_TIERS_KEY, STORE_TIERS_KEY)
        )
        if len(self._parsed) >= _CACHE_SIZE:
            del self._parsed[next(iter(self._parsed))]
        self._parsed[id(params)] = (params, load, store)  # holding params keeps its id unique
        return load, store
