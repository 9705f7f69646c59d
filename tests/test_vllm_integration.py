"""Runs tests/vllm/ (our tiers inside the released vLLM 0.33 package) from the main suite.

``scripts/vllm_env.sh`` builds a CPU-only environment with vLLM 0.33 from the
package registry, once (about 4 minutes) and reused while its pins are
unchanged; the inner suite (~1 minute) runs there in a subprocess. This test
fails, never skips, when the environment cannot be built or any inner test
fails or skips: it is the project's evidence that the vLLM integration works
against the vLLM users run.
"""

from __future__ import annotations

import pytest

from tests.support.inner_suite import InnerSuite

BUILD_TIMEOUT_S = 1200
INNER_TIMEOUT_S = 900

#: Started in the background when collection ends (see tests/support/inner_suite.py).
INNER_SUITE = InnerSuite(
    "vllm_env.sh",
    "tests/vllm",
    build_timeout_s=BUILD_TIMEOUT_S,
    inner_timeout_s=INNER_TIMEOUT_S,
    env={"VLLM_LOGGING_LEVEL": "WARNING"},
)


@pytest.mark.vllm
@pytest.mark.timeout(BUILD_TIMEOUT_S + INNER_TIMEOUT_S)
def test_our_tiers_inside_vllm_0_33() -> None:
    print(INNER_SUITE.verdict()[-4000:])  # shown with -s / on failure
