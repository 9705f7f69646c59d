"""The tiers in docs/writing-a-tier.md are real: they pass the conformance kit."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tiering.testing.conformance import check_tier

DOC = Path(__file__).resolve().parent.parent / "docs" / "writing-a-tier.md"
if not DOC.exists():  # pragma: no cover - the docs ship with the repository
    pytest.skip(f"{DOC} is missing", allow_module_level=True)


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def _define(marker: str) -> tuple[dict[str, Any], str]:
    source = next(block for block in _blocks() if marker in block)
    namespace: dict[str, Any] = {"__name__": "docs_example"}
    exec(compile(source, f"{DOC.name}:{marker}", "exec"), namespace)
    return namespace, source


async def test_the_opening_tier_is_short_and_passes_the_kit() -> None:
    namespace, source = _define("class KeyValueTier")
    code_lines = [line for line in source.splitlines() if line.strip()]
    assert len(code_lines) <= 30, f"the opening example grew to {len(code_lines)} lines"
    report = await check_tier(namespace["KeyValueTier"], raise_on_failure=False)
    assert report.ok, str(report)
    # Not persistent, not bounded, no delete: those checks are skipped, nothing else.
    skipped = [o.name for o in report.outcomes if o.skipped]
    assert skipped == ["delete", "eviction_reported", "persistence", "layouts_kept_apart"]


async def test_the_directory_tier_passes_the_kit_including_persistence(tmp_path: Path) -> None:
    namespace, _ = _define("class DirectoryTier")
    root = str(tmp_path / "blocks")
    report = await check_tier(
        lambda: namespace["DirectoryTier"](root), persistent=True, raise_on_failure=False
    )
    assert report.ok, str(report)
    assert [o.name for o in report.outcomes if o.skipped] == ["eviction_reported"]


def test_the_doc_has_both_examples() -> None:
    sources = _blocks()
    assert sources[0].lstrip().startswith("import asyncio"), "the doc must open with the tier"
    assert any("class DirectoryTier" in s for s in sources)
