"""The keys of kv-tiering's own manager, when vLLM's manager runs instead.

``docs/configuration.md`` documents one ``kv_connector_extra_config`` for both
stacks. Inside vLLM the scheduler side is vLLM's ``TieringOffloadingManager``,
which never reads the keys of ours. A documented key must not silently do
nothing, so each one either takes effect through our tiers or is refused when
the spec (or, under vLLM's own spec, our first tier) is built:

``shutdown_timeout_s``          honoured: the default shutdown bound of each of our
                                tiers (an entry's own ``shutdown_timeout_s`` wins)
``failed_promotion_backoff_s``  honoured: the default ``failed_load_backoff_s`` of
                                each of our tiers (MISS for a block whose promotion
                                failed, for this long)
``cascade_admission``           honoured by each of our tiers: it copies only the
                                blocks the policy admits of those vLLM's manager
                                offers it (:mod:`~tiering.integrations.vllm.admission`);
                                a policy other than ``"all"`` with none of our tiers
                                in ``secondary_tiers`` is refused (vLLM's own tiers
                                take every block)
``backfill_earlier_tiers``      ``false`` is what vLLM does; ``true`` is refused:
                                vLLM's manager does not copy a promoted block into
                                the tiers that missed it

Keys only our tiers read (``metrics_port``, ``metrics_host``,
``cascade_max_pinned_fraction`` and the two defaults above) are validated as our
spec validates them, and refused when ``secondary_tiers`` has none of our tiers.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from tiering.config import (
    _cascade_admission,
    _flag,
    _metrics_host,
    _metrics_port,
    _seconds,
    pinned_fraction,
)
from tiering.core.errors import ConfigError

#: What our tiers take from the top level when their entry does not say.
TIER_DEFAULTS = {
    "shutdown_timeout_s": "shutdown_timeout_s",
    "failed_promotion_backoff_s": "failed_load_backoff_s",
}
#: Top-level keys that act only through our tiers (our metrics server is started by them).
_READ_BY_OUR_TIERS = (
    "metrics_port",
    "metrics_host",
    "cascade_max_pinned_fraction",
    *TIER_DEFAULTS,
)
#: Keys of our manager that vLLM's cannot honour (beyond the value that is vLLM's behaviour).
_UNDER_VLLM = "inside vLLM the scheduler side is vLLM's TieringOffloadingManager"


def check_manager_keys(extra: Mapping[str, Any]) -> dict[str, float]:
    """Raise :class:`ConfigError` naming the first key vLLM's manager would ignore.

    Returns the options our tiers take from the top-level keys (validated).
    """
    ours = any(_is_our_tier(entry) for entry in extra.get("secondary_tiers") or ())
    _metrics_port(extra), _metrics_host(extra), pinned_fraction(extra)  # values, as ours checks
    defaults = {
        option: _seconds(extra, key, 0.0, positive=key == "shutdown_timeout_s")
        for key, option in TIER_DEFAULTS.items()
        if extra.get(key) is not None
    }
    idle = [key for key in _READ_BY_OUR_TIERS if extra.get(key) is not None]
    if idle and not ours:
        raise ConfigError(
            f"{idle[0]} has no effect: only kv-tiering's tiers (module_path "
            "'tiering.integrations.vllm') read it, and there is none in secondary_tiers. "
            "Remove the key, or add one of ours"
        )
    if _cascade_admission(extra) is not None and not ours:
        raise ConfigError(
            f"cascade_admission {extra['cascade_admission']!r} has no effect: {_UNDER_VLLM}, "
            "which cascades every stored block to every tier it built, and only kv-tiering's "
            "tiers (module_path 'tiering.integrations.vllm') apply the policy; there is none "
            "in secondary_tiers. Remove the key (or use 'all'), or add one of ours"
        )
    if _flag(extra, "backfill_earlier_tiers", False):
        raise ConfigError(
            f"backfill_earlier_tiers true has no effect: {_UNDER_VLLM}, which does not copy "
            "a promoted block into the tiers that missed it; remove the key (or use false)"
        )
    return defaults


def _is_our_tier(entry: object) -> bool:
    """Whether a ``secondary_tiers`` entry names one of our tier classes (or a subclass)."""
    if not isinstance(entry, Mapping):
        return False
    module_path, type_name = entry.get("module_path"), entry.get("type")
    if not isinstance(module_path, str) or not isinstance(type_name, str):
        return False  # a type vLLM registers itself: not ours
    from tiering.integrations.vllm.tiers import KVTieringTier

    try:
        tier_class = getattr(importlib.import_module(module_path), type_name, None)
    except ImportError:
        return False  # vLLM's factory reports it when it builds the tier
    return isinstance(tier_class, type) and issubclass(tier_class, KVTieringTier)
