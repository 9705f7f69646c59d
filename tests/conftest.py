"""Suite-wide pytest configuration: Hypothesis profiles, the inner suites in the background.

``ci`` (the default) runs enough examples to matter in a few minutes;
``deep`` is for local soak runs: ``HYPOTHESIS_PROFILE=deep make unit``.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

from tests.support.inner_suite import start_selected, stop_children

settings.register_profile(
    "ci",
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "deep",
    max_examples=2000,
    stateful_step_count=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=30, stateful_step_count=30, deadline=None)
# scripts/mutation_check.py: is a failure found at all (shrinking it would take minutes).
settings.register_profile(
    "no-shrink",
    parent=settings.get_profile("ci"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the selected vLLM inner suites now; their outer tests wait for them."""
    start_selected(session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    stop_children()
