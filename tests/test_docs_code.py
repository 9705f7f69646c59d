"""Every code block in docs/ and README.md is run here or marked as not runnable
(docs/docs-conventions.md).

Python blocks run (a page's blocks in order, in one namespace); JSON, YAML and TOML blocks
parse, and configurations among them are validated as the spec validates them; every other
language must carry a ``<!-- not-runnable: reason -->`` or ``<!-- tested-by: test file -->``
comment on the line before its fence.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import json
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tiering.config import TieringConfig
from tiering.registry import check_tier_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

#: Languages that are not code: diagrams and program output.
NOT_CODE = {"", "text", "mermaid"}
#: Languages the test runs (or parses and validates).
RUN_HERE = {"python", "json", "yaml", "toml"}

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARK = re.compile(r"^\s*<!--\s*(?P<kind>not-runnable|tested-by)\s*:\s*(?P<what>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    source: str
    mark: tuple[str, str] | None  # (kind, reason or test path)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence = opening["fence"]
        info = opening["info"].strip()
        language = info.split()[0].lower() if info else ""
        end = i + 1
        closing = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        indent = len(opening["indent"])
        body = "\n".join(line[indent:] for line in lines[i + 1 : end])
        mark = _MARK.match(lines[i - 1]) if i > 0 else None
        found.append(
            Block(page, i + 1, language, body, (mark["kind"], mark["what"]) if mark else None)
        )
        i = end + 1
    return found


PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
ALL_BLOCKS = [block for page in PAGES for block in blocks_of(page)]


def test_the_docs_have_code_blocks_and_the_parser_finds_them() -> None:
    assert len(ALL_BLOCKS) >= 40
    assert {"python", "json", "bash"} <= {b.language for b in ALL_BLOCKS}


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.where for b in ALL_BLOCKS])
def test_every_code_block_is_run_or_marked_with_a_reason(block: Block) -> None:
    if block.mark is not None:
        kind, what = block.mark
        assert what, f"{block.where}: '<!-- {kind}: ... -->' needs a reason or a test file"
        if kind == "tested-by":
            test_file = ROOT / what
            assert test_file.is_file(), f"{block.where}: tested-by names no file: {what}"
            assert block.page.name in test_file.read_text(encoding="utf-8"), (
                f"{block.where}: {what} does not refer to {block.page.name}"
            )
        return
    assert block.language in NOT_CODE | RUN_HERE, (
        f"{block.where}: a {block.language!r} block is neither run by the tests nor marked; put "
        "'<!-- not-runnable: <why> -->' or '<!-- tested-by: <test file> -->' on the line before "
        "its fence (see docs/docs-conventions.md)"
    )


# -- JSON, YAML, TOML: parse, and validate configurations ---------------------------------------


def _validate_config(data: Any, where: str) -> None:
    """A kv_connector_extra_config (or a vLLM transfer config holding one) passes the checks."""
    if isinstance(data, Mapping) and isinstance(data.get("kv_connector_extra_config"), Mapping):
        data = data["kv_connector_extra_config"]
    if isinstance(data, Mapping) and "cpu_bytes_to_use" in data:
        config = TieringConfig.from_extra_config(data)
        for position, entry in enumerate(config.secondary_tiers):
            check_tier_config(entry, position=position)
    elif isinstance(data, Mapping) and isinstance(data.get("type"), str):
        check_tier_config(data, position=0)  # one secondary_tiers entry


def _data_blocks() -> list[Block]:
    return [b for b in ALL_BLOCKS if b.mark is None and b.language in {"json", "yaml", "toml"}]


@pytest.mark.parametrize("block", _data_blocks(), ids=[b.where for b in _data_blocks()])
def test_data_blocks_parse_and_configurations_are_valid(block: Block) -> None:
    if block.language == "toml":
        tomllib.loads(block.source)
        return
    if block.language == "yaml":
        yaml = pytest.importorskip("yaml")
        data = yaml.safe_load(block.source)
    else:
        data = json.loads(block.source)
    _validate_config(data, block.where)


_TRANSFER_CONFIG = re.compile(r"--kv-transfer-config\s+'(?P<json>\{.*?\})'", re.DOTALL)


def _command_lines_with_configs() -> list[tuple[Block, str]]:
    return [
        (block, match["json"])
        for block in ALL_BLOCKS
        for match in _TRANSFER_CONFIG.finditer(block.source)
    ]


def test_vllm_command_lines_carry_valid_configs() -> None:
    """The ``--kv-transfer-config`` of every ``vllm serve`` example parses and validates."""
    found = _command_lines_with_configs()
    assert len(found) >= 3
    for block, text in found:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AssertionError(
                f"{block.where}: --kv-transfer-config is not JSON: {exc}"
            ) from None
        assert "kv_connector_extra_config" in data, block.where
        _validate_config(data, block.where)


# -- Python: each page's blocks run in order in one namespace -----------------------------------


def _python_pages() -> list[Path]:
    return sorted(
        {b.page for b in ALL_BLOCKS if b.mark is None and b.language == "python"}, key=str
    )


@contextlib.contextmanager
def _in_directory(path: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


async def _run_page(blocks: list[Block]) -> None:
    namespace: dict[str, Any] = {"__name__": "docs_example"}
    for block in blocks:
        code = compile(block.source, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(code, namespace)  # exec, but a top-level await gives a coroutine
        if inspect.isawaitable(result):
            await result


@pytest.mark.parametrize("page", _python_pages(), ids=[p.name for p in _python_pages()])
def test_python_blocks_run(page: Path, tmp_path: Path) -> None:
    blocks = [b for b in ALL_BLOCKS if b.page == page and b.mark is None and b.language == "python"]
    with _in_directory(tmp_path):
        asyncio.run(_run_page(blocks))


def test_the_site_builds_with_strict(tmp_path: Path) -> None:
    """``mkdocs build --strict`` (what ``make docs`` runs): links, anchors and nav all resolve."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    import subprocess
    import sys

    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=240,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "metrics" / "index.html").is_file()
