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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiering.errors import ConfigError
from tiering.replay.replayer import ReplayStack
from tiering.replay.units import parse_size

#: Tokens per offloaded block are the trace's (512 for Mooncake), whatever the config says.
IGNORED_FOR_REPLAY = ("block_size",)

#: Default capacities as fractions of the workload's distinct blocks: a GPU cache
#: that catches immediate reuse, a CPU tier a few times larger and a filesystem tier
#: that holds most of the rest, so every tier has work to do.
DEFAULT_GPU_FRACTION = 0.02
DEFAULT_CPU_FRACTION = 0.08
DEFAULT_FS_FRACTION = 0.3


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a ``kv_connector_extra_config`` from a JSON or YAML file.

    A file holding a whole vLLM ``kv_transfer_config`` (with a
    ``kv_connector_extra_config`` key) is accepted too. Raises
    :class:`ConfigError` naming the file for anything unreadable or not a mapping.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it ({exc.strerror})") from None
    data: object
    if path.suffix.lower() in (".yaml", ".yml"):
        data = _load_yaml(path, text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            if path.suffix.lower() == ".json":
                raise ConfigError(
                    f"config file {path}: invalid JSON at line {exc.lineno} column {exc.colno}: "
                    f"{exc.msg}"
                ) from None
            data = _load_yaml(path, text)
    if isinstance(data, Mapping) and isinstance(data.get("kv_connector_extra_config"), Mapping):
        data = data["kv_connector_extra_config"]
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"config file {path}: expected a mapping like kv_connector_extra_config, "
            f"got {type(data).__name__}"
        )
    return dict(data)


def _load_yaml(path: Path, text: str) -> object:
    try:
        import yaml
    except ImportError:
        raise ConfigError(
            f"config file {path}: reading YAML needs PyYAML (pip install pyyaml), or use JSON"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: invalid YAML: {exc}") from None


#: Smallest default sizes, in blocks, so a tiny workload still gets a working stack.
MIN_DEFAULT_GPU_BLOCKS = 16
MIN_DEFAULT_CPU_BLOCKS = 64


def default_extra_config(
    *, footprint_blocks: int, block_bytes: int, fs_root: Path
) -> dict[str, Any]:
    """The stack used when no config is given: CPU primary and a filesystem tier."""
    cpu_blocks = max(MIN_DEFAULT_CPU_BLOCKS, math.ceil(footprint_blocks * DEFAULT_CPU_FRACTION))
    fs_blocks = max(cpu_blocks, math.ceil(footprint_blocks * DEFAULT_FS_FRACTION))
    return {
        "cpu_bytes_to_use": cpu_blocks * block_bytes,
        "eviction_policy": "lru",
        "secondary_tiers": [
            {"type": "fs", "root_dir": str(fs_root), "capacity_bytes": fs_blocks * block_bytes}
        ],
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
    names = [tier.name for tier in manager.stats().secondary]
    return ReplayStack(
        manager=manager,
        kv_view=manager.primary.kv_view,
        block_bytes=spec.block_bytes,
        secondary=list(zip(names, manager.secondary_tiers, strict=True)),
        step=manager.step,
        stats=manager.stats,
        shutdown=spec.shutdown,
    )
