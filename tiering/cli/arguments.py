"""Reading command-line values: the argparse types (sizes, counts, seconds, a metrics
port), ``--tier`` specs, policy settings, and the check that an output path can be written."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tiering.cli.exits import UsageError
from tiering.core.errors import ConfigError
from tiering.support.units import NumberTooLongError, loads_json, parse_size

N = TypeVar("N", int, float)


def size_arg(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _number(text: str, convert: Callable[[str], N], kind: str) -> N:
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {kind}: {text!r}") from None


def positive_int(text: str) -> int:
    value = _number(text, int, "an integer")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float, "a number")
    if not value >= 0:  # not `value < 0`: NaN is refused too
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float, "a number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def parse_tier_spec(text: str) -> dict[str, Any]:
    """One ``secondary_tiers`` entry from ``--tier``.

    Either a JSON object (``'{"type": "memory", "capacity_bytes": 1048576}'``) or
    ``TYPE[:KEY=VALUE,...]`` (``fs:root_dir=/mnt/kv,capacity_bytes=8GiB``), where
    each value is read as JSON when it parses (numbers, true/false) and as a string
    otherwise; a value in brackets is a list (``root_dirs=[/mnt/a,/mnt/b]``), its
    items read the same way.
    """
    text = text.strip()
    if text.startswith("{"):
        try:
            entry = loads_json(text)
        except NumberTooLongError as exc:
            raise UsageError(f"--tier {text[:40]!r}...: {exc}") from None
        except json.JSONDecodeError as exc:
            raise UsageError(f"--tier {text[:80]!r}: invalid JSON ({exc.msg})") from None
        except RecursionError:
            raise UsageError(f"--tier {text[:40]!r}...: JSON nested too deeply") from None
        if not isinstance(entry, dict):
            raise UsageError(f"--tier {text!r}: expected a JSON object")
        return entry
    tier_type, _, rest = text.partition(":")
    head, _, tail = rest.partition(":")
    if head and "=" not in head and all(part.isidentifier() for part in head.split(".")):
        # A "package.module:Class" type, optionally followed by ":KEY=VALUE,...".
        tier_type, rest = f"{tier_type}:{head}", tail
    if not tier_type:
        raise UsageError(f"--tier {text!r}: expected TYPE[:KEY=VALUE,...] or a JSON object")
    entry = {"type": tier_type}
    for item in filter(None, (part.strip() for part in _split_items(text, rest))):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--tier {text!r}: {item!r} is not KEY=VALUE")
        raw = raw.strip()
        if raw.startswith("[") and raw.endswith("]"):
            parts = filter(None, (part.strip() for part in raw[1:-1].split(",")))
            entry[key.strip()] = [_tier_value(tier_type, key, part) for part in parts]
        else:
            entry[key.strip()] = _tier_value(tier_type, key, raw)
    return entry


def _tier_value(tier_type: str, key: str, raw: str) -> Any:
    """A ``--tier`` value: JSON when it parses (numbers, true/false), else the string."""
    try:
        return loads_json(raw)
    except NumberTooLongError as exc:
        raise UsageError(f"--tier {tier_type}: {key.strip()}: {exc}") from None
    except json.JSONDecodeError:
        return raw


def _split_items(text: str, rest: str) -> list[str]:
    """``rest`` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(rest):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise UsageError(f"--tier {text!r}: ']' without its '['")
        elif char == "," and depth == 0:
            items.append(rest[start:i])
            start = i + 1
    if depth:
        raise UsageError(f"--tier {text!r}: '[' without its ']'")
    items.append(rest[start:])
    return items


def check_writable(path: Path, what: str) -> None:
    """Fail now, before any work, if ``path`` cannot be written later."""
    if path.is_dir():
        raise UsageError(f"{what} {path} is a directory; give a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{what} {path}: directory {parent} does not exist")
    try:
        if path.exists():
            with path.open("r+b"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".tiering-probe-"):
                pass
    except OSError as exc:
        raise UsageError(f"{what} {path} is not writable ({exc.strerror})") from None


def metrics_port_arg(text: str) -> int:
    from tiering.metrics.server import check_metrics_port

    try:
        return check_metrics_port(int(text), "--metrics-port")
    except (ValueError, ConfigError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def policy_setting(text: str, option: str) -> Any:
    """A policy given on the command line: ``NAME`` or ``NAME(key=value,...)``."""
    from tiering.policies import parse_policy_text

    if "(" not in text:
        return text.strip()
    try:
        return parse_policy_text(text, key=option)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
