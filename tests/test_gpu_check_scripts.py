"""The GPU check's own scripts, run on the simulated device so they cannot rot between GPU runs.

``make gpu-check`` runs them on a real GPU; here they run small on the
simulated device: the soak must find no wrong byte, and the benchmark must
print its table and one verdict line per target.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(Path(path).stem, REPO / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_soak_finds_no_wrong_byte_on_the_simulated_device(
    capsys: pytest.CaptureFixture[str],
) -> None:
    soak = load("scripts/gpu_soak.py")
    assert soak.main(["--device", "simulated", "--jobs", "400", "--seed", "3"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("soak (simulated): 400 jobs in ") and line.endswith(": ok")
    assert ", 0 wrong bytes, 0 failed jobs," in line


def test_the_gpu_benchmark_prints_its_rows_and_verdicts(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load("benchmarks/gpu_copy.py")
    out = tmp_path / "rows.json"
    assert (
        bench.main(["--device", "simulated", "--job-mib", "1", "--reps", "1", "--json", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "device: simulated" in printed
    data = json.loads(out.read_text())
    engines = {(r["engine"], r["shape"], r["direction"]) for r in data["rows"]}
    for strategy in ("dma", "kernel", "auto"):
        for shape in ("64 KiB", "256 KiB", "2 MiB", "32 x 16 KiB"):
            assert (f"ours/{strategy}", shape, "store") in engines
            assert (f"ours/{strategy}", shape, "load") in engines
    measured = [r for r in data["rows"] if r["engine"].startswith("ours/")]
    assert all(r["gbps"] > 0 and r["ceiling_gbps"] > 0 for r in measured)
    assert all(r["pipelined_gbps"] > 0 for r in measured)  # the jobs-in-flight column
    # One ceiling verdict per direction at 2 MiB, one peer verdict per shape and direction.
    assert sum("of pinned cudaMemcpyAsync" in v for v in data["verdicts"]) == 2
    assert sum("vs vLLM's worker" in v for v in data["verdicts"]) == 8
    assert all(v in printed for v in data["verdicts"])


def test_the_sources_fingerprint_names_every_engine_file_and_is_stable(tmp_path: Path) -> None:
    """The line a GPU run prints ties it to a commit: same files, same line; one byte, another."""
    import shutil
    import subprocess

    copy = tmp_path / "repo"
    for part in ("tiering", "tests", "benchmarks", "scripts"):
        shutil.copytree(REPO / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    script = copy / "scripts" / "gpu_check_sources.sh"

    def fingerprint() -> str:
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True)
        return done.stdout.strip()

    here = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check_sources.sh")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    first = fingerprint()
    assert len(first) == 12 and int(first, 16) >= 0
    assert first == here  # the copy holds the same sources
    engine = copy / "tiering" / "copy" / "cuda" / "engine.py"
    engine.write_text(engine.read_text() + "\n")
    assert fingerprint() != first
