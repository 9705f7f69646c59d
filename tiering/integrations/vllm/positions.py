"""Which ``secondary_tiers`` entry a tier vLLM builds came from.

vLLM's factory passes a tier class each entry's options but not the entry's
index, which our tiers need for their default name (``vllm-<type>-<position>``,
also the label of their metrics) and for messages naming the entry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

#: The keyword arguments our tier class names, and their defaults (an entry without them).
_NAMED_DEFAULTS = {
    "tier": None,
    "medium": None,
    "locality": None,
    "enable_kv_events": False,
    "failed_load_backoff_s": None,
}
#: Keys vLLM's factory takes out of an entry before it builds the tier.
_TAKEN_BY_VLLM = ("type", "module_path", "backpressure")


def position_in_spec(offloading_spec: Any, tier_type: str, given: Mapping[str, Any]) -> int:
    """This tier's index in ``secondary_tiers`` (names, metrics, errors); 0 if not found.

    vLLM passes each entry's options but not its index: the entry is the first
    of this type, not yet claimed by an earlier tier, whose options are exactly
    ``given`` (keyword arguments at their defaults count as absent). vLLM builds
    the tiers in order, so identical entries get their own positions.
    """
    entries = getattr(offloading_spec, "secondary_tier_configs", None) or []
    claimed: set[int] = getattr(offloading_spec, "_kv_tiering_claimed_positions", set())

    def normal(options: Mapping[str, Any]) -> dict[str, Any]:
        return {
            k: v
            for k, v in options.items()
            if k not in _TAKEN_BY_VLLM and not (k in _NAMED_DEFAULTS and v == _NAMED_DEFAULTS[k])
        }

    wanted = normal(given)
    matches = [
        position
        for position, entry in enumerate(entries)
        if isinstance(entry, Mapping) and entry.get("type") == tier_type and normal(entry) == wanted
    ]
    position = next((p for p in matches if p not in claimed), matches[0] if matches else 0)
    claimed.add(position)
    with contextlib.suppress(AttributeError):  # a spec that takes no attributes: no claims
        offloading_spec._kv_tiering_claimed_positions = claimed
    return position
