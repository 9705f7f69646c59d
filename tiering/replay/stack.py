"""Building the replay's stack from a vLLM-style ``kv_connector_extra_config``.

The config is the dict vLLM users give ``TieringOffloadingSpec`` (``cpu_bytes_to_use``,
``eviction_policy``, ``secondary_tiers``...), read from a JSON or YAML file or made
from command-line flags. The stack is the real one: the CPU primary tier, every
configured secondary tier built by the tier registry (each on its own event-loop
thread behind the sync facade), and the ``TieringOffloadingManager`` over them.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tiering.core.errors import ConfigError
from tiering.replay.replayer import ReplayStack
from tiering.replay.units import parse_size
from tiering.support.units import NumberTooLongError, loads_json

#: Tokens per offloaded block are the trace's (512 for Mooncake), whatever the config says.
IGNORED_FOR_REPLAY = ("block_size",)

#: Default capacities as fractions of the workload's distinct blocks: a GPU cache
#: that catches immediate reuse, a CPU tier a few times larger and a filesystem tier
#: that holds most of the rest, so every tier has work to do.
DEFAULT_GPU_FRACTION = 0.02
DEFAULT_CPU_FRACTION = 0.08
DEFAULT_FS_FRACTION = 0.3


#: Largest config file read: a real one is a few KiB.
MAX_CONFIG_BYTES = 1 << 20
#: Deepest nesting of mappings and lists accepted in a config (a real one has 3 or 4).
MAX_CONFIG_DEPTH = 32
#: YAML aliases (``*name``) a config may use. Each can expand to a copy of a whole
#: structure, so a few lines can stand for gigabytes (a "billion laughs" file).
MAX_YAML_ALIASES = 32


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a ``kv_connector_extra_config`` from a JSON or YAML file.

    A file holding a whole vLLM ``kv_transfer_config`` (with a
    ``kv_connector_extra_config`` key) is accepted too. Raises
    :class:`ConfigError` naming the file for anything unreadable or not a
    mapping, in bounded time and memory whatever the file holds: at most
    :data:`MAX_CONFIG_BYTES`, UTF-8, nested at most :data:`MAX_CONFIG_DEPTH`
    deep, and at most :data:`MAX_YAML_ALIASES` YAML aliases.
    """
    path = Path(path)
    text = _read_config_text(path)
    data: object
    if path.suffix.lower() in (".yaml", ".yml"):
        data = _load_yaml(path, text)
    else:
        try:
            data = loads_json(text)
        except NumberTooLongError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        except json.JSONDecodeError as exc:
            if path.suffix.lower() == ".json":
                raise ConfigError(
                    f"config file {path}: invalid JSON at line {exc.lineno} column {exc.colno}: "
                    f"{exc.msg}"
                ) from None
            data = _load_yaml(path, text)
        except RecursionError:
            raise ConfigError(_too_deep(path)) from None
    _check_depth(path, data)
    if isinstance(data, Mapping) and isinstance(data.get("kv_connector_extra_config"), Mapping):
        data = data["kv_connector_extra_config"]
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"config file {path}: expected a mapping like kv_connector_extra_config, "
            f"got {type(data).__name__}"
        )
    return dict(data)


def _read_config_text(path: Path) -> str:
    try:
        with path.open("rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise ConfigError(f"config file {path}: not a regular file")
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it ({exc.strerror or exc})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config file {path}: larger than {MAX_CONFIG_BYTES // 1024} KiB; a "
            "kv_connector_extra_config is a few lines"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"config file {path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}); "
            "save it as UTF-8"
        ) from None


def _too_deep(path: Path) -> str:
    return f"config file {path}: nested more than {MAX_CONFIG_DEPTH} levels deep"


def _check_depth(path: Path, data: object) -> None:
    """Refuse structures nested deeper than any config (later recursion would fail)."""
    stack: list[tuple[object, int]] = [(data, 0)]
    seen: set[int] = set()  # YAML anchors make shared (even cyclic) structures
    while stack:
        value, depth = stack.pop()
        if isinstance(value, Mapping | list | tuple):
            if depth >= MAX_CONFIG_DEPTH:
                raise ConfigError(_too_deep(path))
            if id(value) in seen:
                continue
            seen.add(id(value))
            children = value.values() if isinstance(value, Mapping) else value
            stack.extend((child, depth + 1) for child in children)


def _load_yaml(path: Path, text: str) -> object:
    try:
        import yaml
    except ImportError:
        raise ConfigError(
            f"config file {path}: reading YAML needs PyYAML (pip install pyyaml), or use JSON"
        ) from None

    class BoundedLoader(yaml.SafeLoader):
        """SafeLoader that refuses more than MAX_YAML_ALIASES aliases and deep nesting."""

        aliases = 0
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_YAML_ALIASES:
                    raise ConfigError(
                        f"config file {path}: more than {MAX_YAML_ALIASES} YAML aliases (*name); "
                        "a config needs few, and each can stand for a whole copy of a structure"
                    )
            self.depth += 1
            try:
                if self.depth > MAX_CONFIG_DEPTH:
                    raise ConfigError(_too_deep(path))
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        message = " ".join(str(exc).split())
        if len(message) > 300:
            message = message[:300] + "..."
        raise ConfigError(f"config file {path}: invalid YAML: {message}") from None
    except ValueError as exc:  # a value YAML's constructors cannot convert
        if "integer string conversion" in str(exc):  # Python's digit limit, past 4,300
            raise ConfigError(f"config file {path}: {NumberTooLongError()}") from None
        raise ConfigError(f"config file {path}: invalid YAML value: {exc}") from None
    except RecursionError:
        raise ConfigError(_too_deep(path)) from None
    finally:
        loader.dispose()


#: Smallest default sizes, in blocks, so a tiny workload still gets a working stack.
MIN_DEFAULT_GPU_BLOCKS = 16
MIN_DEFAULT_CPU_BLOCKS = 64


def default_extra_config(
    *, footprint_blocks: int, block_bytes: int, fs_root: Path | None
) -> dict[str, Any]:
    """The stack used when no config is given: CPU primary and a filesystem tier
    (in ``fs_root``; None leaves ``root_dir`` out for the caller to fill in)."""
    cpu_blocks = max(MIN_DEFAULT_CPU_BLOCKS, math.ceil(footprint_blocks * DEFAULT_CPU_FRACTION))
    fs_blocks = max(cpu_blocks, math.ceil(footprint_blocks * DEFAULT_FS_FRACTION))
    fs: dict[str, Any] = {"type": "fs", "capacity_bytes": fs_blocks * block_bytes}
    if fs_root is not None:
        fs["root_dir"] = str(fs_root)
    return {
        "cpu_bytes_to_use": cpu_blocks * block_bytes,
        "eviction_policy": "lru",
        "secondary_tiers": [fs],
    }


def default_gpu_blocks(footprint_blocks: int) -> int:
    return max(MIN_DEFAULT_GPU_BLOCKS, math.ceil(footprint_blocks * DEFAULT_GPU_FRACTION))


def tier_summary(tier_config: Mapping[str, Any]) -> str:
    """A short human description of one ``secondary_tiers`` entry."""
    details = ", ".join(f"{k}={v}" for k, v in tier_config.items() if k != "type")
    return f"{tier_config.get('type')}({details})"


def configured_capacity(tier_config: Mapping[str, Any], block_bytes: int) -> int | None:
    """Blocks a tier's config allows (``capacity_blocks``, or ``capacity_bytes`` as a
    number or a size like ``"8GiB"``); None when the config does not say."""
    blocks = tier_config.get("capacity_blocks")
    if isinstance(blocks, int) and not isinstance(blocks, bool):
        return blocks
    size = tier_config.get("capacity_bytes")
    if isinstance(size, bool) or size is None:
        return None
    if isinstance(size, int | float):
        return int(size) // block_bytes
    try:
        return parse_size(str(size)) // block_bytes
    except ValueError:
        return None


def layout_fingerprint(block_bytes: int, block_tokens: int) -> str:
    """Names the replay's synthetic KV layout, so a persistent tier never mixes two."""
    return f"kv-tiering-replay/v1/block_bytes={block_bytes}/block_tokens={block_tokens}"


def report_names(
    tier_configs: Sequence[Mapping[str, Any]], stats_names: Sequence[str]
) -> list[str]:
    """The name each secondary tier has in the report: its config's ``name`` where given,
    else the manager's label (its type, with ``#position`` for a repeated type).

    Names must be distinct and not ``gpu`` or ``cpu`` (the report's own rows); a
    clash gets ``#position`` appended.
    """
    names: list[str] = []
    for position, (config, fallback) in enumerate(zip(tier_configs, stats_names, strict=True)):
        given = config.get("name")
        name = given if isinstance(given, str) and given else fallback
        if name in ("gpu", "cpu") or name in names:
            name = f"{name}#{position}"
        names.append(name)
    return names


def build_stack(
    extra_config: Mapping[str, Any], *, block_bytes: int, block_tokens: int
) -> ReplayStack:
    """The real stack for ``extra_config`` with blocks of ``block_bytes`` bytes.

    Built by :class:`~tiering.spec.TieringOffloadingSpec`, exactly as an engine
    builds it. Raises :class:`ConfigError` (naming the key) for a bad config;
    nothing is left running when construction fails.
    """
    from tiering.spec import TieringOffloadingSpec

    spec = TieringOffloadingSpec(
        extra_config,
        block_bytes=block_bytes,
        layout_fingerprint=layout_fingerprint(block_bytes, block_tokens),
        enable_events=False,
        name="replay",
        # Exported only when served (metrics_port): a replay's series are otherwise unused.
        metrics_registry=None if extra_config.get("metrics_port") is not None else False,
    )
    manager = spec.get_manager()
    names = report_names(spec.config.secondary_tiers, [t.name for t in manager.stats().secondary])
    return ReplayStack(
        manager=manager,
        kv_view=manager.primary.kv_view,
        block_bytes=spec.block_bytes,
        secondary=list(zip(names, manager.secondary_tiers, strict=True)),
        step=manager.step,
        stats=manager.stats,
        shutdown=spec.shutdown,
    )
