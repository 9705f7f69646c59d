"""Remove each of the CUDA engine's ordering waits in turn and show which tests catch it.

For every mutation below, the repository's ``tiering/`` and ``tests/`` are
copied to a scratch directory, the line is deleted there (the run stops if it
is not found exactly once, so a renamed line cannot pass silently), and the
CUDA engine's tests run on the simulated device. A mutation no test catches
is a hole in the tests: the script exits 1.

Run: ``make mutation-check`` (or ``.venv/bin/python scripts/mutation_check.py``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENGINE = "tiering/copy/cuda/engine.py"
TESTS = [
    "tests/test_copy_cuda.py",
    "tests/test_copy_cuda_faults.py",
    "tests/test_copy_cuda_machine.py",
]
MUTATIONS = {
    "the compute-stream wait": (ENGINE, "stream.wait_stream(compute)"),
    "the cross-lane wait": (ENGINE, "stream.wait_event(dep.end_event)"),
}


def mutate(root: Path, path: str, line: str) -> None:
    target = root / path
    lines = target.read_text().splitlines(keepends=True)
    hits = [i for i, text in enumerate(lines) if text.strip() == line]
    if len(hits) != 1:
        raise SystemExit(f"{path}: expected the line {line!r} once, found it {len(hits)} times")
    indent = lines[hits[0]][: len(lines[hits[0]]) - len(lines[hits[0]].lstrip())]
    lines[hits[0]] = f"{indent}pass  # mutation: {line}\n"
    target.write_text("".join(lines))


def failing_tests(root: Path) -> tuple[list[str], str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *TESTS],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
    )
    failed = [
        line.split(" ", 1)[1].split(" - ")[0]
        for line in proc.stdout.splitlines()
        if line.startswith("FAILED ")
    ]
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    return failed, tail


def main() -> int:
    holes = 0
    print("mutation check: the CUDA engine's tests on the simulated device")
    for name, (path, line) in MUTATIONS.items():
        with tempfile.TemporaryDirectory(prefix="kv-mutation-") as scratch:
            root = Path(scratch)
            for part in ("tiering", "tests", "pyproject.toml"):
                source = REPO / part
                if source.is_dir():
                    shutil.copytree(
                        source, root / part, ignore=shutil.ignore_patterns("__pycache__")
                    )
                else:
                    shutil.copy2(source, root / part)
            mutate(root, path, line)
            failed, summary = failing_tests(root)
        print(f"\n- without {name} ({path}: `{line}`): {summary}")
        for test in failed:
            print(f"    caught by {test}")
        if not failed:
            print("    NOT CAUGHT by any test")
            holes += 1
    return 1 if holes else 0


if __name__ == "__main__":
    sys.exit(main())
