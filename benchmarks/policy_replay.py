"""The whole stack (simulated GPU cache, CPU primary tier, fs tier) under each eviction policy
and cascade admission policy: token hit rate and bytes moved, on a Mooncake-format trace and
the built-in synthetic workload (seeds 0, 1, 2), against Belady's optimum for the same run.

Usage::

    .venv/bin/python benchmarks/policy_replay.py [--trace PATH] [--policies lru,kvaware]
        [--admission all,reuse] [--requests N] [--json OUT] [--smoke]

Each configuration is one ``python -m tiering replay`` run (a fresh process, a fresh fs tier
in a temporary directory, every loaded byte verified), with the replay's default sizes: CPU
8% and fs 30% of the workload's distinct blocks, GPU cache 2%. Only the primary tier's
policy and the cascade admission change between rows; the fs tier keeps LRU. Columns:
token hit rate (all tiers), Belady's ceiling and the hit rate as a share of it, the part
served by the fs tier, bytes written to the fs tier, bytes read back from it (promotions),
and bytes written per hit token.

The trace is ``--trace`` (a Mooncake JSONL file, gzipped or not); by default the Mooncake
release's "synthetic" trace the repository ships (``tests/data/``, with its licence).

The ceiling, computed in the same run on the same requests: Belady's MIN
(:func:`tiering.replay.offline.simulate_belady`, the offline optimum with bypass) on one
cache as large as the whole stack of that row (GPU + CPU + fs blocks, read from the
replay's report). No policy of that total capacity hits more; "of Belady" is the row's
token hit rate over it.

Hit rates are deterministic for a given workload; throughput is not measured here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.support.common import REPO
from tiering.replay.offline import simulate_belady
from tiering.replay.synthetic import SyntheticWorkload
from tiering.replay.trace import Request, read_trace, trace_footprint

#: The Mooncake "synthetic" trace (3,993 requests, Apache-2.0), shipped with the tests.
DEFAULT_TRACE = REPO / "tests" / "data" / "mooncake_synthetic_trace.jsonl.gz"


def tiering(*words: str) -> str:
    """``python -m tiering WORDS...`` run from the repository; its stdout (exits if it fails)."""
    command = [sys.executable, "-m", "tiering", *words]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout


def replay(workload: list[str], policy: str, admission: str, requests: int | None) -> Any:
    options = ["--eviction-policy", policy, "--cascade-admission", admission]
    if requests is not None:
        options += ["--requests", str(requests)]
    return json.loads(tiering("replay", *workload, "--no-progress", "--json", *options))


def stack_blocks(report: Any) -> int:
    """Blocks the whole stack of a replay holds at most: GPU cache + CPU tier + fs tier."""
    setup = report["setup"]
    secondary = sum(t["capacity_bytes"] for t in setup["secondary_tiers"])
    return int(setup["gpu_blocks"] + setup["cpu_blocks"] + secondary // setup["block_bytes"])


def belady(requests: list[Request], report: Any) -> float:
    """Belady's token hit rate on one cache of the stack's size, for the replayed requests."""
    replayed = report["trace"]["footprint_blocks"]
    if trace_footprint(requests) != replayed:
        raise SystemExit(
            f"the ceiling's workload has {trace_footprint(requests)} distinct blocks, the "
            f"replayed one {replayed}: they are not the same requests"
        )
    return simulate_belady(requests, stack_blocks(report)).token_hit_rate


def summarize(report: Any, ceiling: float) -> dict[str, Any]:
    fs = next(tier for tier in report["tiers"] if tier["name"] == "fs")
    hit_tokens = report["tokens"]["hit"]
    hit_rate = report["hit_rate"]["total"]
    return {
        "token_hit_rate": hit_rate,
        "belady_token_hit_rate": ceiling,
        "of_belady": hit_rate / ceiling if ceiling else 0.0,
        "fs_hit_rate": report["hit_rate"]["secondary"].get("fs", 0.0),
        "fs_bytes_written": fs["stored_bytes"],
        "fs_bytes_read": fs["promoted_bytes"],
        "fs_bytes_written_per_hit_token": fs["stored_bytes"] / hit_tokens if hit_tokens else 0.0,
        "verification_mismatches": report["verification"]["mismatches"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help="a Mooncake JSONL trace, .gz or not (default: the Mooncake trace in tests/data/)",
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--policies", default="lru,kvaware")
    parser.add_argument("--admission", default="all,reuse")
    parser.add_argument("--requests", type=int, default=None, help="replay only the first N")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a few seconds: 100 requests (unless --requests says), synthetic seed 0, LRU and "
        "admission 'all' only",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests = args.requests or 100
        args.seeds, args.policies, args.admission = "0", "lru", "all"

    # (row name, the replay's workload arguments, the trace file or the synthetic seed)
    workloads: list[tuple[str, list[str], Path | int]] = []
    if args.trace.is_file():
        workloads.append((args.trace.name, [str(args.trace)], args.trace))
    else:
        print(f"(no trace at {args.trace}; pass --trace: synthetic only)", file=sys.stderr)
    workloads += [
        (f"synthetic seed {s}", ["--seed", s], int(s)) for s in args.seeds.split(",") if s
    ]
    rows = run_rows(args, workloads)
    if any(row["verification_mismatches"] for row in rows):
        raise SystemExit("a replay loaded wrong bytes: see verification_mismatches")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")


def run_rows(
    args: argparse.Namespace, workloads: list[tuple[str, list[str], Path | int]]
) -> list[dict[str, Any]]:
    """Every (workload, policy, admission) row, printed as it lands."""
    width = max([26, *(len(name) for name, _, _ in workloads)])
    rows: list[dict[str, Any]] = []
    header = (
        f"{'workload':<{width}} {'policy':<9} {'admission':<9} {'hit rate':>9} {'Belady':>7} "
        f"{'of Belady':>9} {'fs hits':>8} {'fs written':>12} {'fs read':>12} "
        f"{'written/hit tok':>16}"
    )
    print(header)
    print("-" * len(header))
    for name, workload, source in workloads:
        if isinstance(source, Path):
            requests = read_trace(source)[: args.requests]
        else:
            count = {"num_requests": args.requests} if args.requests else {}
            requests = SyntheticWorkload(seed=source, **count).generate()
        ceilings: dict[int, float] = {}  # by the stack's size (the same for every policy)
        for policy in args.policies.split(","):
            for admission in args.admission.split(","):
                report = replay(workload, policy, admission, args.requests)
                size = stack_blocks(report)
                if size not in ceilings:
                    ceilings[size] = belady(requests, report)
                row = {
                    "workload": name,
                    "policy": policy,
                    "admission": admission,
                    **summarize(report, ceilings[size]),
                }
                rows.append(row)
                print(
                    f"{name:<{width}} {policy:<9} {admission:<9} {row['token_hit_rate']:>9.1%} "
                    f"{row['belady_token_hit_rate']:>7.1%} {row['of_belady']:>9.1%} "
                    f"{row['fs_hit_rate']:>8.1%} {row['fs_bytes_written'] / 2**20:>10.1f}Mi "
                    f"{row['fs_bytes_read'] / 2**20:>10.1f}Mi "
                    f"{row['fs_bytes_written_per_hit_token']:>16.1f}",
                    flush=True,
                )
    print(
        "ceiling: Belady's MIN on one cache of the whole stack's blocks (GPU + CPU + fs), "
        "computed in this run on the same requests; 'of Belady' = hit rate / that ceiling"
    )
    return rows


if __name__ == "__main__":
    main()
