"""Nothing in the repository depends on a path outside it.

Every tracked text file is read: a reference to the development machines'
shared folder (``../shared/...``) or to an absolute checkout path would work
on those machines and break in a user's clone. Data a test needs lives under
``tests/data/`` with its licence (``tests/data/README.md``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.])/work/(?:main|shared)\b")
THIS = Path(__file__).resolve()


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    files = []
    for name in filter(None, listed):
        path = REPO / name.decode()
        if path.resolve() == THIS or not path.is_file():
            continue
        head = path.read_bytes()[:4096]
        if b"\0" in head or path.suffix in {".gz", ".png", ".whl"}:
            continue
        files.append(path)
    return files


def test_no_tracked_file_points_outside_the_repository() -> None:
    files = tracked_text_files()
    assert len(files) > 100  # the listing worked
    offenders = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert offenders == []


def test_the_trace_the_tests_read_is_shipped_with_its_licence() -> None:
    data = REPO / "tests" / "data"
    assert (data / "mooncake_synthetic_trace.jsonl.gz").is_file()
    assert "Apache License 2.0" in (data / "README.md").read_text()
