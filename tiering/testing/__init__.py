"""Public testing helpers: test your own tiers and eviction policies with these.

- :mod:`tiering.testing.conformance`: the behaviour suite every tier must pass
  (``check_tier``, ``conformance_tests``).
- :mod:`tiering.testing.faults`: wrapper tiers injecting errors, delays, hangs,
  short reads and corruption (``FaultyTier``, ``FaultPlan``).
- :mod:`tiering.testing.policy_machine`: a Hypothesis state machine for any
  eviction policy (``make_policy_state_machine``, ``make_policy_test_case``,
  ``ReferenceLRU``, ``ReferenceARC``, ``ReferenceKVAware``).

Names are re-exported lazily, so importing one helper never imports the
others' dependencies (Hypothesis, the runtime). The ``testing`` extra installs
what they need (Hypothesis, pytest): ``pip install -e '.[testing]'`` from a
checkout (the package is not on PyPI yet).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "check_tier": "tiering.testing.conformance",
    "conformance_tests": "tiering.testing.conformance",
    "run_check": "tiering.testing.conformance",
    "KitOptions": "tiering.testing.conformance",
    "ConformanceReport": "tiering.testing.conformance",
    "FaultPlan": "tiering.testing.faults",
    "FaultyTier": "tiering.testing.faults",
    "make_policy_state_machine": "tiering.testing.policy_machine",
    "make_policy_test_case": "tiering.testing.policy_machine",
    "ReferenceLRU": "tiering.testing.policy_machine",
    "ReferenceARC": "tiering.testing.policy_machine",
    "ReferenceKVAware": "tiering.testing.policy_machine",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tiering.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
