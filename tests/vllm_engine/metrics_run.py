"""A real vLLM engine with ``metrics_port`` set, scraped while it runs.

    python -m tests.vllm_engine.metrics_run RUN.json

``RUN.json`` is ``engine_run``'s (``model``, ``out``, ``kv_transfer_config``,
``schedule``, sizes). After the schedule, while the engine is still up, this
finds the endpoint our tiers serve in the engine's scheduler process (its port
was 0: any free one) among the listening sockets of this process's children,
scrapes it, and writes ``{"url": ..., "scrape": ..., "results": ...}`` to ``out``.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.vllm_engine.engine_run import kv_bytes_per_block, prompt_words


def _scrape_our_endpoint() -> tuple[str, str]:
    """(url, text) of the first local /metrics endpoint serving kv_tiering_* series."""
    import psutil

    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            sockets = process.net_connections(kind="tcp")
        except (psutil.Error, OSError):
            continue
        for sock in sockets:
            if sock.status != psutil.CONN_LISTEN or sock.laddr.ip != "127.0.0.1":
                continue
            url = f"http://127.0.0.1:{sock.laddr.port}/metrics"
            try:
                with urllib.request.urlopen(url, timeout=10) as response:
                    text = response.read().decode()
            except OSError:
                continue
            if "kv_tiering_secondary_" in text:
                return url, text
    raise RuntimeError("no process of the engine serves kv_tiering_* metrics on 127.0.0.1")


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    block_size = spec.get("block_size", 32)
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 2048),
        block_size=block_size,
        seed=0,
        kv_cache_memory_bytes=kv_bytes_per_block(spec["model"], block_size)
        * spec.get("engine_blocks", 96),
        enable_prefix_caching=True,
        kv_transfer_config=spec["kv_transfer_config"],
    )
    results = []
    for name, seed, words, max_tokens in spec["schedule"]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        (output,) = llm.generate([prompt_words(seed, words)], params, use_tqdm=False)
        results.append({"name": name, "num_cached_tokens": output.num_cached_tokens})
        time.sleep(spec.get("pause_s", 0.5))  # asynchronous stores and cascades finish
    url, text = _scrape_our_endpoint()
    del llm
    return {"url": url, "scrape": text, "results": results}


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(spec["out"]).write_text(json.dumps(run(spec), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
