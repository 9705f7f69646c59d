"""The layers of ``docs/architecture.md`` are true of the code.

Each top-level part of ``tiering/`` has a rank; a module may import (at module
level or inside a function) from its own part and from parts of lower rank,
never from a part of its rank or above. ``ls tiering/`` shows the parts and
nothing else, and the old module paths (from before the parts were packages)
still import, as do the paths the docs and the README name.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tiering"

#: Bottom to top, as docs/architecture.md draws them ("Layers").
LAYERS: list[tuple[str, ...]] = [
    ("core",),  # contract types: errors, keys, specs, jobs, contract, stats
    ("support",),  # units, quoting, native probes
    ("policies", "copy", "tier"),  # eviction/admission, GPU<->CPU copies, the AsyncTier API
    ("primary", "metrics"),  # the CPU primary tier; Prometheus series and endpoint
    ("runtime",),  # a tier on its event-loop thread behind the sync facade
    ("isolation", "config"),  # a tier in a child process; kv_connector_extra_config
    ("manager",),  # our TieringOffloadingManager
    ("registry",),  # secondary tiers from config entries
    ("spec",),  # the whole stack, built from a config
    ("replay", "integrations", "testing"),  # front ends: replay/sweep, vLLM, test kits
    ("cli",),  # the tiering command
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
#: Package plumbing, not a layer.
PLUMBING = {"__init__", "__main__", "_version", "py.typed"}


def part_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "tiering" and len(parts) > 1 else None


def imports_of(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found.extend((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
    return found


def test_ls_tiering_shows_the_layers_and_nothing_else() -> None:
    listed = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if not p.name.startswith(".")}
    listed -= {"__pycache__"} | PLUMBING
    listed = {name for name in listed if not name.endswith(".so") and not name.startswith("_")}
    assert listed == set(RANK)


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        here = part_of(module)
        if here is None or here in PLUMBING:
            continue
        for line, target in imports_of(path):
            there = part_of(target)
            if there is None or there == here or there in PLUMBING or there not in RANK:
                continue
            if RANK[there] >= RANK[here]:
                upward.append(
                    f"{path.relative_to(ROOT)}:{line} ({here}) imports {target} ({there})"
                )
    assert upward == []


def test_no_import_cycles_between_modules() -> None:
    """Module-level imports only (a function-level import runs after both are loaded)."""
    graph: dict[str, set[str]] = {}
    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        deps = set()
        for node in tree.body:
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from pkg import sub`` needs the submodule; ``from mod import name``, mod.
                submodules = [f"{node.module}.{a.name}" for a in node.names]
                found = [n for n in submodules if n in modules]
                names = found if len(found) == len(submodules) else [node.module, *found]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            deps.update(n for n in names if n in modules and n != module)
        graph[module] = deps
    seen: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        seen[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if seen.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in seen:
                visit(dep)
        stack.pop()
        seen[node] = 2

    sys.setrecursionlimit(10_000)
    for module in sorted(graph):
        if module not in seen:
            visit(module)
    assert cycles == []


#: Module paths from before the layers were packages; users' imports of them keep working.
OLD_PATHS = [
    "tiering.errors",
    "tiering.keys",
    "tiering.specs",
    "tiering.jobs",
    "tiering.contract",
    "tiering.stats",
    "tiering.units",
    "tiering.quoting",
    "tiering.native_probe",
    "tiering.host_buffer",
    "tiering.mappings",
    "tiering.host_memory",
    "tiering.auth",
    "tiering.metrics_secondary",
    "tiering.metrics_server",
    "tiering.config_checks",
    "tiering.tier_types",
    "tiering.tier_entries",
    "tiering.primary",
    "tiering.tier",
    "tiering.metrics",
    "tiering.config",
    "tiering.registry",
]


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_module_path_still_imports(old: str) -> None:
    code = f"import {old} as m, importlib; print(m.__name__)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def documented_imports() -> list[str]:
    """``from tiering... import names`` lines in the docs and the README."""
    pages = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
    found = set()
    for page in pages:
        for match in re.finditer(
            r"^\s*from (tiering[\w.]*|tiers[\w.]*) import ([\w, ]+)$", page.read_text(), re.M
        ):
            found.add(f"from {match[1]} import {match[2].strip().rstrip(',')}")
    return sorted(found)


@pytest.mark.parametrize("statement", documented_imports())
def test_a_documented_import_works(statement: str) -> None:
    namespace: dict[str, object] = {}
    exec(statement, namespace)


#: A module a newcomer can hold in their head (benchmarks/: tests/test_benchmarks_smoke.py).
MAX_MODULE_LINES = 450


def test_every_module_is_small_and_says_what_it_owns() -> None:
    too_long, silent = [], []
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "tiers").rglob("*.py")]):
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        if text.strip() and ast.get_docstring(ast.parse(text)) is None:
            silent.append(str(path.relative_to(ROOT)))
    assert too_long == []
    assert silent == []
