"""One real vLLM engine run (``LLM``, engine core, CPU worker, OffloadingConnector).

    python -m tests.vllm_engine.engine_run RUN.json

``RUN.json`` says: ``model``, ``out`` (where the results go, JSON),
``kv_transfer_config`` (None: no offloading), ``schedule`` (a list of
``[name, seed, words, max_tokens]``: each request is generated alone, greedy,
in order, with a pause after it so asynchronous offload stores finish), and
engine sizes (``block_size``, ``engine_blocks``, ``max_model_len``), and
``final_pause_s`` (a wait after the schedule, for a slow tier to finish its backlog
before the engine stops), ``scrape_metrics`` (true: after the schedule, while the
engine is still up, scrape the ``kv_tiering_*`` endpoint our tiers serve with
``metrics_port``), ``engine_process`` (true: the engine core in its own process, as
``LLM`` and ``vllm serve`` run it by default; false, the default here: in this
process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which starts in about a fifth of the
time - the same scheduler, connector, worker and tiers, without the second
interpreter's imports and handshake).

The results: for every request its token ids, ``num_cached_tokens`` (prompt
tokens the engine did not compute: prefix cache or loaded from offload), time
to first token and mean decode-step time from vLLM's request metrics; the
engine's offload metrics (bytes each way, per tier); wall times.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # skips a 15-25 s compile per engine

#: vLLM's processes log through this config (read when each imports vLLM): vLLM's own lines,
#: and kv-tiering's INFO lines, which vLLM's default config leaves without a handler.
LOGGING_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s"}},
    "handlers": {
        "out": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "level": "INFO",
            "stream": "ext://sys.stdout",
        }
    },
    "loggers": {
        name: {"handlers": ["out"], "level": "INFO", "propagate": False}
        for name in ("vllm", "tiering")
    },
}


def prompt_words(seed: int, words: int) -> str:
    """A deterministic prompt of ``words`` one-token words (distinct per seed)."""
    return " ".join(f"w{(seed * 7919 + j * 31 + (j * j) % 17) % 990}" for j in range(words))


def kv_bytes_per_block(model: str, block_size: int) -> int:
    """Engine KV bytes of one block: K and V, every layer, bf16."""
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return (
        2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * block_size
    )


def _metrics(llm: Any) -> dict[str, Any]:
    wanted = ("prefix_cache", "kv_offload", "external", "connector")
    found: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if not any(w in metric.name for w in wanted):
            continue
        value = getattr(metric, "value", None)
        if value is None:
            value = getattr(metric, "values", None)
        labels = getattr(metric, "labels", {}) or {}
        tier = labels.get("tier")
        name = metric.name if tier is None else f"{metric.name}{{tier={tier}}}"
        if isinstance(value, (int, float)):
            found[name] = found.get(name, 0) + value
        else:
            found[name] = value
    return found


def _record(name: str, seconds: float, output: Any) -> dict[str, Any]:
    completion = output.outputs[0]
    record: dict[str, Any] = {
        "name": name,
        "seconds": round(seconds, 4),
        "prompt_tokens": len(output.prompt_token_ids),
        "num_cached_tokens": output.num_cached_tokens,
        "token_ids": list(completion.token_ids),
    }
    stats = getattr(output, "metrics", None)
    if stats is not None and stats.first_token_latency:
        record["ttft_s"] = stats.first_token_latency
        generated = stats.num_generation_tokens
        if generated > 1 and stats.last_token_ts > stats.first_token_ts:
            record["decode_step_s"] = (stats.last_token_ts - stats.first_token_ts) / (generated - 1)
    return record


def run(spec: dict[str, Any]) -> dict[str, Any]:
    # Read by vLLM when it builds the engine: set before vLLM is imported.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("engine_process") else "0"
    from vllm import LLM, SamplingParams

    block_size = spec.get("block_size", 32)
    engine_blocks = spec.get("engine_blocks", 96)
    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "dtype": "bfloat16",
        "enforce_eager": True,
        "max_model_len": spec.get("max_model_len", 2048),
        "block_size": block_size,
        "seed": 0,
        "kv_cache_memory_bytes": kv_bytes_per_block(spec["model"], block_size) * engine_blocks,
        "enable_prefix_caching": True,
        "disable_log_stats": False,
    }
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    started = time.monotonic()
    llm = LLM(**kwargs)
    init_s = time.monotonic() - started
    results = []
    for name, seed, words, max_tokens in spec["schedule"]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.monotonic()
        (output,) = llm.generate([prompt_words(seed, words)], params, use_tqdm=False)
        record = _record(name, time.monotonic() - t0, output)
        results.append(record)
        print(
            f"{name}: {record['seconds']:.2f}s prompt={record['prompt_tokens']} "
            f"cached={record['num_cached_tokens']} ttft={record.get('ttft_s')}",
            flush=True,
        )
        time.sleep(spec.get("pause_s", 0.5))  # asynchronous stores and cascades finish
    time.sleep(spec.get("final_pause_s", 0.0))
    summary = {"init_s": round(init_s, 2), "results": results, "metrics": _metrics(llm)}
    if spec.get("scrape_metrics"):
        summary["url"], summary["scrape"] = _scrape_our_endpoint()
    del llm
    return summary


def _scrape_our_endpoint() -> tuple[str, str]:
    """(url, text) of the local /metrics endpoint serving kv_tiering_* series.

    Our tiers serve it from the engine's scheduler process with ``metrics_port:
    0`` (any free port): it is found among the listening sockets of this process's
    children.
    """
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


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    logging_config = Path(spec["out"]).with_suffix(".logging.json")
    logging_config.write_text(json.dumps(LOGGING_CONFIG))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(logging_config)
    summary = run(spec)
    Path(spec["out"]).write_text(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
