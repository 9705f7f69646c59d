"""The value checks of ``kv_connector_extra_config``: one reader per key.

This module owns what each key of the stack's config accepts and what it
defaults to: every reader takes the user's mapping, applies the key's default
when the key is absent or ``null``, and returns the checked value or raises
:class:`~tiering.core.errors.ConfigError` naming the key, what is accepted and the
value given (quoted by :func:`~tiering.support.quoting.shown`). :mod:`tiering.config`
assembles them into a :class:`~tiering.config.TieringConfig`; the vLLM adapter
reuses a few for the keys it reads itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from tiering.core.errors import ConfigError
from tiering.policies import PolicyChoice, resolve_admission, resolve_policy
from tiering.support.quoting import shown
from tiering.support.units import config_bytes

DEFAULT_EVICTION_POLICY = "lru"
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
DEFAULT_FAILED_PROMOTION_BACKOFF_S = 10.0
#: Back-pressure: the share of the primary tier one secondary tier's cascades may pin.
DEFAULT_CASCADE_MAX_PINNED_FRACTION = 0.25


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _get(extra: Mapping[str, Any], key: str, default: Any) -> Any:
    """``extra[key]``, with an absent key or a JSON ``null`` meaning the default."""
    value = extra.get(key)
    return default if value is None else value


def _integral(value: object) -> int | None:
    """``value`` as an int if it is an int or an integral float (JSON's 1e10), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def _positive_int(extra: Mapping[str, Any], key: str, accepted: str) -> int:
    value = extra[key]
    number = _integral(value)
    if number is None or number <= 0:
        raise ConfigError(f"{key} must be {accepted}, got {shown(value)}")
    return number


def _cpu_bytes(extra: Mapping[str, Any]) -> int:
    value = extra["cpu_bytes_to_use"]
    try:
        number = config_bytes("cpu_bytes_to_use", value)
    except ConfigError as exc:
        if "larger than any machine" in str(exc):
            raise
        number = 0
    if number <= 0:
        raise ConfigError(
            "cpu_bytes_to_use must be a positive integer number of bytes or a size with a "
            f"unit (e.g. 10737418240 or '10GiB'), got {shown(value)}"
        )
    return number


def _optional_block_size(extra: Mapping[str, Any]) -> int | None:
    if extra.get("block_size") is None:
        return None
    return _positive_int(
        extra, "block_size", "a positive integer number of tokens per offloaded block"
    )


def _eviction_policy(extra: Mapping[str, Any]) -> PolicyChoice:
    """A built-in name, ``pkg.mod:Class``, an entry point, or vLLM's class + module spelling."""
    value = _get(extra, "eviction_policy", DEFAULT_EVICTION_POLICY)
    module_path = _get(extra, "cache_policy_module_path", None)
    return resolve_policy(value, module_path=module_path)


def _cascade_admission(extra: Mapping[str, Any]) -> PolicyChoice | None:
    """None (cascade everything, no per-block work) unless a policy other than "all" is named."""
    value = _get(extra, "cascade_admission", None)
    if value is None:
        return None
    choice = resolve_admission(value)
    return None if choice.label == "all" else choice


def _secondary_tiers(extra: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    value = extra.get("secondary_tiers")
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
        raise ConfigError(
            'secondary_tiers must be a list of tier configurations like [{"type": "memory"}], '
            f"got {type(value).__name__}"
        )
    tiers: list[Mapping[str, Any]] = []
    for position, entry in enumerate(value):
        if not isinstance(entry, Mapping):
            raise ConfigError(
                f"secondary_tiers[{position}] must be a mapping with a 'type' key, "
                f"got {type(entry).__name__}"
            )
        tier_type = entry.get("type")
        if not isinstance(tier_type, str) or not tier_type.strip():
            raise ConfigError(
                f"secondary_tiers[{position}].type is required: a non-empty string naming a "
                f"registered tier type or 'package.module:Class', got {shown(tier_type)}"
            )
        bad_keys = [k for k in entry if not isinstance(k, str)]
        if bad_keys:
            raise ConfigError(
                f"secondary_tiers[{position}] ({tier_type}): keys must be strings, "
                f"got {shown(bad_keys[0])}"
            )
        tiers.append(MappingProxyType(dict(entry)))
    return tuple(tiers)


def _store_threshold(extra: Mapping[str, Any]) -> int:
    value = _get(extra, "store_threshold", 0)
    number = _integral(value)
    if number is None or number < 0:
        raise ConfigError(
            f"store_threshold must be 0 or 1 (store on first offload), got {shown(value)}"
        )
    if number >= 2:
        raise ConfigError(
            f"store_threshold={number} is not supported by the tiering spec: blocks are "
            "offloaded on first eviction; use 0 or 1, or leave store_threshold out"
        )
    return number


def _finite(value: object) -> bool:
    """Whether ``value`` is an int or float with a finite float value (10**400 is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float
        return False


def _seconds(extra: Mapping[str, Any], key: str, default: float, *, positive: bool) -> float:
    value = _get(extra, key, default)
    if not _finite(value) or value < 0 or (positive and value == 0):
        kind = "a positive" if positive else "a non-negative"
        raise ConfigError(f"{key} must be {kind} finite number of seconds, got {shown(value)}")
    return float(value)


def pinned_fraction(extra: Mapping[str, Any]) -> float:
    """``cascade_max_pinned_fraction``: a number in (0, 1] (raises naming the key)."""
    key = "cascade_max_pinned_fraction"
    value = _get(extra, key, DEFAULT_CASCADE_MAX_PINNED_FRACTION)
    if not _finite(value) or not 0 < value <= 1:
        raise ConfigError(
            f"{key} must be a number in (0, 1] (the share of the CPU primary tier one "
            f"secondary tier's cascades in flight may pin), got {shown(value)}"
        )
    return float(value)


def _metrics_port(extra: Mapping[str, Any]) -> int | None:
    value = _get(extra, "metrics_port", None)
    if value is None:
        return None
    from tiering.metrics.server import check_metrics_port

    return check_metrics_port(value)


def _metrics_host(extra: Mapping[str, Any]) -> str:
    value = _get(extra, "metrics_host", None)
    if value is None:
        return "0.0.0.0"
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"metrics_host must be a host name or address to listen on, got {value!r}"
        )
    if extra.get("metrics_port") is None:
        raise ConfigError("metrics_host is set but metrics_port is not: give the port too")
    return value


def _flag(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = _get(extra, key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {shown(value)}")
    return value
