"""The whole stack (simulated GPU cache, CPU primary tier, fs tier) under each eviction policy
and cascade admission policy: token hit rate and bytes moved, on the Mooncake-format trace and
the built-in synthetic workload (seeds 0, 1, 2).

Usage::

    .venv/bin/python benchmarks/policy_replay.py [--trace ../shared/traces/synthetic_trace.jsonl]
        [--policies lru,kvaware] [--admission all,reuse] [--requests N] [--json OUT]

Each configuration is one ``python -m tiering replay`` run (a fresh process, a fresh fs tier
in a temporary directory, every loaded byte verified), with the replay's default sizes: CPU
8% and fs 30% of the workload's distinct blocks, GPU cache 2%. Only the primary tier's
policy and the cascade admission change between rows; the fs tier keeps LRU. Columns:
token hit rate (all tiers), the part served by the fs tier, bytes written to the fs tier,
bytes read back from it (promotions), and bytes written per hit token.

Hit rates are deterministic for a given workload; throughput is not measured here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The project's shared trace sits next to the checkout (../shared/traces/).
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"


def replay(workload: list[str], policy: str, admission: str, requests: int | None) -> Any:
    command = [
        sys.executable,
        "-m",
        "tiering",
        "replay",
        *workload,
        "--no-progress",
        "--json",
        "--eviction-policy",
        policy,
        "--cascade-admission",
        admission,
    ]
    if requests is not None:
        command += ["--requests", str(requests)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout)


def summarize(report: Any) -> dict[str, Any]:
    fs = next(tier for tier in report["tiers"] if tier["name"] == "fs")
    hit_tokens = report["tokens"]["hit"]
    return {
        "token_hit_rate": report["hit_rate"]["total"],
        "fs_hit_rate": report["hit_rate"]["secondary"].get("fs", 0.0),
        "fs_bytes_written": fs["stored_bytes"],
        "fs_bytes_read": fs["promoted_bytes"],
        "fs_bytes_written_per_hit_token": fs["stored_bytes"] / hit_tokens if hit_tokens else 0.0,
        "verification_mismatches": report["verification"]["mismatches"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--policies", default="lru,kvaware")
    parser.add_argument("--admission", default="all,reuse")
    parser.add_argument("--requests", type=int, default=None, help="replay only the first N")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()

    workloads: list[tuple[str, list[str]]] = []
    if args.trace.is_file():
        workloads.append((args.trace.name, [str(args.trace)]))
    else:
        print(f"(no trace at {args.trace}; pass --trace: synthetic only)", file=sys.stderr)
    workloads += [(f"synthetic seed {s}", ["--seed", s]) for s in args.seeds.split(",") if s]
    rows: list[dict[str, Any]] = []
    header = (
        f"{'workload':<26} {'policy':<9} {'admission':<9} {'hit rate':>9} {'fs hits':>8} "
        f"{'fs written':>12} {'fs read':>12} {'written/hit tok':>16}"
    )
    print(header)
    print("-" * len(header))
    for name, workload in workloads:
        for policy in args.policies.split(","):
            for admission in args.admission.split(","):
                row = {
                    "workload": name,
                    "policy": policy,
                    "admission": admission,
                    **summarize(replay(workload, policy, admission, args.requests)),
                }
                rows.append(row)
                print(
                    f"{name:<26} {policy:<9} {admission:<9} {row['token_hit_rate']:>9.1%} "
                    f"{row['fs_hit_rate']:>8.1%} {row['fs_bytes_written'] / 2**20:>10.1f}Mi "
                    f"{row['fs_bytes_read'] / 2**20:>10.1f}Mi "
                    f"{row['fs_bytes_written_per_hit_token']:>16.1f}",
                    flush=True,
                )
    if any(row["verification_mismatches"] for row in rows):
        raise SystemExit("a replay loaded wrong bytes: see verification_mismatches")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
