"""Adapters that embed kv-tiering in inference engines.

Each engine's adapter lives in its own subpackage and is the only code of this
project that imports that engine; importing :mod:`tiering.integrations` itself
imports nothing. See :mod:`tiering.integrations.vllm` (vLLM 0.33's tiering).
"""
