"""Replaying KV-cache workloads through the real tiering stack (``tiering replay``/``sweep``).

* :mod:`~tiering.replay.trace`: Mooncake JSONL traces (read strictly, written back);
* :mod:`~tiering.replay.synthetic`: the seeded built-in workload;
* :mod:`~tiering.replay.offline`: hit rates without the stack (unlimited, policies, Belady);
* :mod:`~tiering.replay.replayer`: the GPU prefix cache driving the real manager, and
  :mod:`~tiering.replay.totals` what it counts;
* :mod:`~tiering.replay.stack`: building that stack from ``kv_connector_extra_config``;
* :mod:`~tiering.replay.report`: the report (JSON), its tables
  (:mod:`~tiering.replay.report_tables`) and verdicts (:mod:`~tiering.replay.report_verdicts`);
* :mod:`~tiering.replay.sweep`: hit rate against capacity, with plot;
* :mod:`~tiering.replay.warm`: a run that starts on a warm cache, compared fairly;
* :mod:`~tiering.replay.tempdirs`: the run's temporary directory, and leftovers of dead runs;
* :mod:`~tiering.replay.console`: consoles, logging, progress and stop signals.

Nothing here imports torch or vLLM.
"""

from tiering.replay.offline import HitRate, simulate_belady, simulate_policy, unlimited_hit_rate
from tiering.replay.synthetic import SyntheticWorkload
from tiering.replay.trace import Request, TraceError, iter_trace, read_trace, write_trace

__all__ = [
    "HitRate",
    "Request",
    "SyntheticWorkload",
    "TraceError",
    "iter_trace",
    "read_trace",
    "simulate_belady",
    "simulate_policy",
    "unlimited_hit_rate",
    "write_trace",
]
