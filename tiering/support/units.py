"""Byte sizes in our configs and on our command line: ``8MiB``, ``2GB``, ``4096``.

Every size a user writes for kv-tiering (``cpu_bytes_to_use``, a tier's
``capacity_bytes``, ``--cpu-bytes``) takes either an integer number of bytes (what
vLLM's own spec takes, so one config serves both) or a number with a unit: SI
(``kB``, ``MB``, ``GB``, ``TB``: powers of 1000) or binary (``KiB``/``Ki``, ``MiB``,
``GiB``, ``TiB``: powers of 1024). Units are case-insensitive.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from tiering.core.errors import ConfigError
from tiering.support.quoting import shown

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
#: Longest size string looked at: anything longer is not a size (and is not echoed whole).
_MAX_SIZE_TEXT = 40
#: No buffer or tier of ours can be larger than this (2**63 - 1: what a file offset holds).
MAX_BYTES = 2**63 - 1

SIZE_HINT = "an integer number of bytes or a size with a unit like 64KiB, 8MiB, 2GiB, 500MB"


#: The longest integer read from a config file, a trace or the command line. No size or count
#: needs more than 20 digits, and past 4,300 Python refuses to convert digits at all (with a
#: bare ``ValueError`` that would end a run as an internal error).
MAX_NUMBER_DIGITS = 100


class NumberTooLongError(ValueError):
    """An integer literal of more than :data:`MAX_NUMBER_DIGITS` digits."""

    def __init__(self, digits: int | None = None) -> None:
        count = f"{digits}" if digits is not None else "more than 4,300"
        super().__init__(
            f"a number of {count} digits (no size or count has more than 20; "
            f"at most {MAX_NUMBER_DIGITS} are read)"
        )


def bounded_int(text: str) -> int:
    """``int(text)`` for an integer literal, refusing one longer than :data:`MAX_NUMBER_DIGITS`."""
    digits = len(text.lstrip("+-"))
    if digits > MAX_NUMBER_DIGITS:
        raise NumberTooLongError(digits)
    return int(text)


def loads_json(text: str) -> Any:
    """``json.loads`` whose integers are read by :func:`bounded_int` (raises
    :class:`NumberTooLongError`, a ``ValueError``, besides ``json.JSONDecodeError``)."""
    return json.loads(text, parse_int=bounded_int)


def parse_size(text: str) -> int:
    """Bytes from ``"32768"``, ``"32KiB"``, ``"1.5GB"`` (raises ``ValueError``)."""
    match = _SIZE_RE.match(text) if len(text) <= _MAX_SIZE_TEXT else None
    if not match or match.group(2).lower() not in _UNITS:
        quoted = text if len(text) <= _MAX_SIZE_TEXT else text[:_MAX_SIZE_TEXT] + "..."
        raise ValueError(f"not a size: {quoted!r} (use bytes or a unit like 64KiB, 2GiB, 500MB)")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(value) or value > MAX_BYTES:
        raise ValueError(f"not a size: {text!r} is larger than any machine's memory or disk")
    return int(value)


def config_bytes(key: str, value: object) -> int:
    """A byte size from a config value: an int, an integral float (JSON's ``1e9``) or a string
    with a unit. Raises :class:`~tiering.core.errors.ConfigError` naming ``key``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key} must be {SIZE_HINT}, got {value!r}")
    number: int | None = None
    if isinstance(value, int):
        number = value
    elif isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ConfigError(f"{key} must be {SIZE_HINT}, got {value!r}")
        number = int(value)
    elif isinstance(value, str):
        try:
            number = parse_size(value)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}") from None
    if number is None:
        raise ConfigError(f"{key} must be {SIZE_HINT}, got {shown(value)}")
    if number > MAX_BYTES:
        raise ConfigError(
            f"{key}={shown(value)} is larger than any machine's memory or disk; give {SIZE_HINT}"
        )
    return number


def format_bytes(count: float) -> str:
    """``1.5 GiB``, ``32.0 KiB``, ``512 B``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= size:
            return f"{count / size:.1f} {unit}"
    return f"{int(count)} B"
