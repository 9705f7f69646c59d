"""Run a test suite inside an environment a script builds (the vLLM suites).

vLLM is not installed in the project's virtualenv (its dependencies would pull
CUDA); each vLLM suite runs in its own environment, built once by a script in
``scripts/`` and reused while its pins are unchanged. The outer test fails,
never skips, when the environment cannot be built, any inner test fails, or
the inner suite skipped or deselected anything: it is the project's evidence.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def build_environment(builder: str, timeout_s: float) -> str:
    """Run ``scripts/<builder>`` and return the python it prints last."""
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / builder)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
    )
    if done.returncode != 0:
        log = done.stderr[-6000:]
        pytest.fail(f"scripts/{builder} failed ({done.returncode}); its log:\n{log}")
    python = done.stdout.strip().splitlines()[-1]
    assert Path(python).is_file(), f"scripts/{builder} printed {python!r}, not a python"
    return python


def run_inner_suite(
    builder: str,
    suite: str,
    *,
    build_timeout_s: float,
    inner_timeout_s: float,
    env: dict[str, str],
) -> None:
    """Build the environment, run ``pytest suite`` in it, fail on anything but a clean pass."""
    python = build_environment(builder, build_timeout_s)
    inner_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        **env,
    }
    inner_env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(
        [python, "-m", "pytest", suite, "-q", "-p", "no:cacheprovider", "-rfE"],
        capture_output=True,
        text=True,
        timeout=inner_timeout_s,
        cwd=REPO,
        env=inner_env,
    )
    output = done.stdout + done.stderr
    sys.stdout.write(output[-4000:])  # shown with -s / on failure
    assert done.returncode == 0, f"the inner suite {suite} failed:\n{output[-12000:]}"
    # pytest's summary is the last line of its stdout (stderr may carry later warnings).
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    assert " passed" in summary and "no tests ran" not in summary, output[-2000:]
    assert "skipped" not in summary and "deselected" not in summary, summary
