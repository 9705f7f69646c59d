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
``cascade_admission``           ``"all"`` is what vLLM does; any other policy is
                                refused: vLLM's manager cascades every stored block
                                to every tier
``backfill_earlier_tiers``      ``false`` is what vLLM does; ``true`` is refused:
                                vLLM's manager does not copy a promoted block into
                                the tiers that missed it
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiering.config import _cascade_admission, _flag, _seconds
from tiering.errors import ConfigError

#: What our tiers take from the top level when their entry does not say.
TIER_DEFAULTS = {
    "shutdown_timeout_s": "shutdown_timeout_s",
    "failed_promotion_backoff_s": "failed_load_backoff_s",
}
#: Keys of our manager that vLLM's cannot honour (beyond the value that is vLLM's behaviour).
_UNDER_VLLM = "inside vLLM the scheduler side is vLLM's TieringOffloadingManager"


def check_manager_keys(extra: Mapping[str, Any]) -> dict[str, float]:
    """Raise :class:`ConfigError` naming the first key vLLM's manager would ignore.

    Returns the options our tiers take from the top-level keys (validated).
    """
    if _cascade_admission(extra) is not None:
        raise ConfigError(
            f"cascade_admission {extra['cascade_admission']!r} has no effect: {_UNDER_VLLM}, "
            "which cascades every stored block to every secondary tier; remove the key (or "
            "use 'all')"
        )
    if _flag(extra, "backfill_earlier_tiers", False):
        raise ConfigError(
            f"backfill_earlier_tiers true has no effect: {_UNDER_VLLM}, which does not copy "
            "a promoted block into the tiers that missed it; remove the key (or use false)"
        )
    return {
        option: _seconds(extra, key, 0.0, positive=key == "shutdown_timeout_s")
        for key, option in TIER_DEFAULTS.items()
        if extra.get(key) is not None
    }
