"""Filesystem tier throughput against the disk's ceiling and vLLM's own tier, in one run.

    .venv/bin/python benchmarks/fs_tier.py                 # full run (a few minutes)
    .venv/bin/python benchmarks/fs_tier.py --quick         # 256 MiB per case, no vLLM
    .venv/bin/python benchmarks/fs_tier.py --smoke         # seconds (checks the script)
    .venv/bin/python benchmarks/fs_tier.py --json out.json

For 2 MiB and 64 KiB blocks, on the same disk (a scratch directory, default
under $TMPDIR):

* **store** (primary rows -> tier) and **load** (tier -> primary rows) through
  the runtime facade (:class:`~tiering.runtime.AsyncTierManager`), as the
  scheduler drives it: jobs of ``--job-blocks`` blocks, ``--jobs-in-flight``
  at once, completions polled. O_DIRECT (cold by construction: no page cache),
  and the buffered fallback cold (after fdatasync + ``posix_fadvise(DONTNEED)``)
  and warm (page cache);
* per **I/O backend** (``--backend all``: io_uring where this machine can run it,
  and threads), every row printed with the backend the tier really used;
* the **raw ceiling** of each backend: plain O_DIRECT writes and reads of the
  same bytes, in block-sized ops at the tier's queue depth, on a preallocated
  file (uring: the tier's own kernel ring; threads: ``os.preadv``/``pwritev`` on
  queue-depth threads), and fio (io_uring engine; installed with apt-get when
  missing and possible) as the disk's ceiling beside it. "of raw" is against
  the backend's own ceiling. Raw and tier runs alternate ``--reps`` times (the virtual
  disk serves recently written data faster, so each reads data written moments
  before) and medians are compared;
* **CPU seconds per GB** (user+sys of this process, all threads; also without
  the scheduler thread's own polling);
* **GIL**: batches/s of a pure-Python loop (heap and dict work, like a
  scheduler) on another thread, alone and while the tier stores and loads flat
  out;
* **vLLM**: with ``--vllm-driver PATH`` (vLLM's harness script ``drive_fs_tier.py``),
  in the environment ``scripts/vllm_env.sh`` builds (or reuses), vLLM's own
  filesystem tier on the same workload through that harness (``--json``, in a
  subprocess), and the ratios ours/vLLM. Without it those columns stay empty;
  ``benchmarks/vllm_tiers.py`` compares both tiers inside vLLM's manager.

Targets: >= 85 % of the raw ceiling for 2 MiB blocks, >= 70 % for 64 KiB,
<= 0.2 CPU s/GB, <= 1.25x slowdown of the Python loop, >= 1.0x vLLM at 2 MiB
and >= 3x at 64 KiB. The machine is shared and the virtual disk bursts:
compare figures within one run only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.support.common import (
    KIB,
    MIB,
    REPO,
    add_auth_offload_options,
    apply_auth_offload_options,
)
from benchmarks.support.fio import ensure_fio
from benchmarks.support.fs_ceilings import (
    RAW_CEILINGS,
    Figure,
    available_backends,
    drop_cache,
    median_figure,
    preallocate,
    raw_fio,
)
from benchmarks.support.fs_drive import (
    Primary,
    Workload,
    bench_mac,
    make_manager,
    python_loop_rate,
    report_mac,
    run_jobs,
)
from tiering.core.jobs import JobMetadata
from tiering.support.native_probe import describe_cpu

VLLM_ENV_BUILDER = REPO / "scripts" / "vllm_env.sh"
CASES = {"2MiB": 2 * MIB, "64KiB": 64 * KIB}
TARGET_RAW = {"2MiB": 0.85, "64KiB": 0.70}
TARGET_VLLM = {"2MiB": 1.0, "64KiB": 3.0}


# -- one case --------------------------------------------------------------------------------


def bench_case(
    name: str, block: int, backend: str, args: argparse.Namespace, scratch: Path
) -> dict[str, Any]:
    total = args.total_mib * MIB
    job_blocks = args.job_blocks
    in_flight = args.jobs_in_flight
    primary = Primary(job_blocks * in_flight, block)
    out: dict[str, Any] = {"block": block, "total": total}
    raw = RAW_CEILINGS[backend]
    raw_file = scratch / f"raw-{name}.bin"
    preallocate(raw_file, total)
    print(
        f"# {name}, backend {backend}: {total / MIB:.0f} MiB per phase, {job_blocks} blocks/job, "
        f"{in_flight} jobs in flight, queue depth {args.queue_depth}",
        flush=True,
    )

    samples: dict[str, list[Figure]] = {}

    def keep(label: str, figure: Figure | None) -> None:
        if figure is not None:
            samples.setdefault(label, []).append(figure)

    # O_DIRECT: store, then load (no page cache involved). The raw ceiling and the tier
    # alternate, ``--reps`` times, each reading data written moments before (the virtual
    # disk serves recently written data faster), and the medians are compared.
    root = scratch / f"tier-{name}"
    with make_manager(root, primary, total, block, args, True, backend) as manager:
        for rep in range(args.reps):
            work = Workload(block, total, job_blocks, in_flight, f"{name}-direct-{rep}")
            keep("raw_write", raw(raw_file, block, total, args.queue_depth, write=True))
            keep("fio_write", raw_fio(raw_file, block, total, args.queue_depth, write=True))
            keep("store", run_jobs(manager, work, load=False, poll_s=args.poll_s))
            drop_cache([raw_file])
            keep("raw_read", raw(raw_file, block, total, args.queue_depth, write=False))
            keep("fio_read", raw_fio(raw_file, block, total, args.queue_depth, write=False))
            keep("load", run_jobs(manager, work, load=True, poll_s=args.poll_s))
        out["direct"] = manager.tier.stats.direct_io  # type: ignore[attr-defined]
        out["backend"] = manager.tier.stats.io_backend  # type: ignore[attr-defined]
        # GIL: the Python loop alone, then while the tier stores and loads flat out.
        alone = python_loop_rate(args.gil_s)
        waves = [0]

        def wave() -> None:
            # Store fresh blocks, then load them back. The scheduler thread waits in a
            # blocking drain (a queue: no GIL held), so only the tier competes for the GIL.
            waves[0] += 1
            work = Workload(
                block,
                2 * in_flight * job_blocks * block,
                job_blocks,
                in_flight,
                f"{name}-gil-{waves[0]}",
            )
            for load in (False, True):
                for keys, job_id in work.jobs:
                    slot = job_id % in_flight
                    rows = np.arange(slot * job_blocks, (slot + 1) * job_blocks, dtype=np.int64)
                    meta = JobMetadata(job_id + 10**6, tuple(keys), rows, is_promotion=load)
                    (manager.submit_load if load else manager.submit_store)(meta)
                manager.drain(120)
                list(manager.get_finished())

        busy = python_loop_rate(args.gil_s, during=wave)
        out["gil"] = {"alone": alone, "busy": busy, "slowdown": alone / busy if busy else 0}
    shutil.rmtree(root, ignore_errors=True)
    for label, figures in samples.items():
        out[label] = median_figure(figures)
    out.setdefault("fio_write", None)
    out.setdefault("fio_read", None)
    if backend != "threads":  # buffered files always use the thread backend under "auto"
        raw_file.unlink()
        return out

    # Buffered fallback: store, cold load (pages dropped), warm load.
    root = scratch / f"tier-{name}-buffered"
    work = Workload(block, total, job_blocks, in_flight, f"{name}-buffered")
    with make_manager(root, primary, total, block, args, False, backend) as manager:
        out["store_buffered"] = run_jobs(manager, work, load=False, poll_s=args.poll_s)
        drop_cache(sorted(root.glob("slab-*.bin")))
        out["load_cold"] = run_jobs(manager, work, load=True, poll_s=args.poll_s)
        out["load_warm"] = run_jobs(manager, work, load=True, poll_s=args.poll_s)
    shutil.rmtree(root, ignore_errors=True)
    raw_file.unlink()
    return out


# -- vLLM's tier -----------------------------------------------------------------------------


def run_vllm(args: argparse.Namespace, scratch: Path) -> dict[str, dict[str, float]] | None:
    """vLLM 0.33's FileSystemTierManager on the same workload (None where unavailable)."""
    if args.skip_vllm:
        return None
    if args.vllm_driver is None or not args.vllm_driver.is_file():
        where = "not given" if args.vllm_driver is None else f"not found at {args.vllm_driver}"
        print(
            f"# vLLM's tier not measured: its harness driver (drive_fs_tier.py) {where}; "
            "pass --vllm-driver PATH, or compare inside vLLM with benchmarks/vllm_tiers.py",
            flush=True,
        )
        return None
    built = subprocess.run(
        ["bash", str(VLLM_ENV_BUILDER)], stdout=subprocess.PIPE, text=True, check=False
    )
    if built.returncode != 0:
        print("# scripts/vllm_env.sh failed; vLLM's tier not measured", flush=True)
        return None
    out_json = scratch / "vllm.json"
    cmd = [
        built.stdout.strip().splitlines()[-1],
        str(args.vllm_driver),
        "--quiet",
        "--cases",
        ",".join(args.cases),
        "--tier",
        "fs",
        "--modes",
        "odirect",
        "--runs",
        str(args.vllm_runs),
        "--total-mib-2m",
        str(args.total_mib),
        "--total-mib-64k",
        str(args.total_mib),
        "--req-blocks",
        str(args.job_blocks),
        "--concurrency",
        str(args.jobs_in_flight),
        "--root-parent",
        str(scratch),
        "--json",
        str(out_json),
    ]
    print("# running vLLM's tier:", " ".join(cmd[1:3]), "...", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not out_json.exists():
        print(f"# vLLM run failed ({done.returncode}): {done.stderr[-2000:]}", flush=True)
        return None
    summary = json.loads(out_json.read_text())["summary"]
    figures: dict[str, dict[str, float]] = {}
    for row in summary:
        phase = "store" if row["phase"] == "store" else "load"
        figures.setdefault(row["case"], {})[phase] = float(row["GBps"] or 0.0)
    return figures


# -- report ----------------------------------------------------------------------------------


def report(
    results: dict[tuple[str, str], dict[str, Any]],
    vllm: dict[str, dict[str, float]] | None,
    args: argparse.Namespace,
    skipped: dict[str, str],
) -> None:
    print()
    print(f"CPU: {describe_cpu()}")
    header = (
        f"{'case':<6} {'backend':<7} {'phase':<19} {'GB/s':>6} {'raw':>6} {'fio':>6} "
        f"{'of raw':>7} {'target':>6} {'CPU s/GB':>9} {'excl.sched':>10} {'vLLM':>6} "
        f"{'ours/vLLM':>9} {'target':>6}"
    )
    print(header)
    print("-" * len(header))
    for (name, _backend), r in results.items():
        # (label, figure, its raw ceiling, fio's, vLLM's phase to compare with)
        rows: list[tuple[str, Figure, Figure | None, Figure | None, str | None]] = [
            ("store O_DIRECT", r["store"], r["raw_write"], r["fio_write"], "store"),
            ("load O_DIRECT", r["load"], r["raw_read"], r["fio_read"], "load"),
        ]
        if "store_buffered" in r:
            rows += [
                ("store buffered", r["store_buffered"], None, None, None),
                ("load buffered cold", r["load_cold"], r["raw_read"], r["fio_read"], None),
                ("load buffered warm", r["load_warm"], None, None, None),
            ]
        for label, fig, raw, fio, vllm_phase in rows:
            ratio = fig.gbps / raw.gbps if raw is not None and raw.gbps else None
            direct_row = label.endswith("O_DIRECT")
            peer = (vllm or {}).get(name, {}).get(vllm_phase or "", None)
            print(
                f"{name:<6} {r['backend']:<7} {label:<19} {fig.gbps:>6.2f} "
                f"{_fmt(raw.gbps if raw else None):>6} {_fmt(fio.gbps if fio else None):>6} "
                f"{_pct(ratio):>7} {_pct(TARGET_RAW[name] if direct_row else None):>6} "
                f"{fig.cpu_per_gb:>9.3f} {fig.tier_cpu_per_gb:>10.3f} "
                f"{_fmt(peer):>6} {_ratio(fig.gbps / peer if peer else None):>9} "
                f"{_ratio(TARGET_VLLM[name] if peer is not None else None):>6}"
            )
    print()
    for (name, _backend), r in results.items():
        gil = r["gil"]
        print(
            f"GIL {name} {r['backend']}: pure-Python loop {gil['alone']:.0f} batches/s alone, "
            f"{gil['busy']:.0f} while the tier stores+loads flat out: "
            f"slowdown {gil['slowdown']:.2f}x (target <= 1.25x)"
        )
    for backend, reason in skipped.items():
        print(f"backend {backend} not measured: {reason}")
    print(
        f"O_DIRECT rows and their ceilings: median of {args.reps} alternating runs; buffered "
        f"rows: one run; vLLM: median of {args.vllm_runs} runs of its harness "
        f"(drive_fs_tier.py, same sizes, {args.job_blocks}-block requests, "
        f"{args.jobs_in_flight} in flight)."
    )
    print(
        "backend = the backend the tier really ran (stats.io_backend). raw = that backend's "
        "own ceiling: O_DIRECT block-sized ops at the same queue depth (uring: the kernel ring "
        "the tier uses; threads: os.preadv/pwritev on queue-depth threads); 'of raw' is against "
        "it. fio (io_uring engine) is the disk's ceiling, shown beside it. CPU s/GB = user+sys "
        "of this process (all threads) per GB moved; 'excl.sched' leaves out the benchmark's "
        "own scheduler-thread polling. Shared, noisy machine: compare within a run."
    )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def to_json(results: dict[tuple[str, str], dict[str, Any]], vllm: Any) -> dict[str, Any]:
    def convert(value: Any) -> Any:
        if isinstance(value, Figure):
            return {
                "GBps": value.gbps,
                "cpu_s_per_GB": value.cpu_per_gb,
                "wall_s": value.wall_s,
                "bytes": value.nbytes,
                "tier_cpu_s_per_GB": value.tier_cpu_per_gb,
            }
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        return value

    return {"ours": convert({f"{c}/{b}": r for (c, b), r in results.items()}), "vllm": vllm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="2MiB,64KiB")
    parser.add_argument("--total-mib", type=int, default=1024, help="data per phase and case")
    parser.add_argument("--job-blocks", type=int, default=64)
    parser.add_argument("--jobs-in-flight", type=int, default=4)
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--max-io-kib", type=int, default=8192, help="tier's max_io_bytes")
    parser.add_argument(
        "--backend",
        default="all",
        choices=["all", "uring", "threads"],
        help="I/O backend(s) to measure; 'all' = every backend this machine can run",
    )
    parser.add_argument("--poll-s", type=float, default=0.0005, help="scheduler idle sleep")
    parser.add_argument("--gil-s", type=float, default=3.0, help="seconds per GIL measurement")
    parser.add_argument("--reps", type=int, default=3, help="O_DIRECT runs per case (median)")
    parser.add_argument("--vllm-runs", type=int, default=3, help="vLLM harness runs (median)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: $TMPDIR)")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-mac", action="store_true", help="no auth_key_* comparison")
    parser.add_argument(
        "--mac-only",
        action="store_true",
        help="only the auth_key_* comparison (plain and each auth_mac, alternating --reps times)",
    )
    parser.add_argument(
        "--vllm-driver",
        type=Path,
        default=None,
        help="vLLM's harness script drive_fs_tier.py, run in the environment "
        "scripts/vllm_env.sh builds for the vLLM columns (default: none, not measured)",
    )
    add_auth_offload_options(parser)
    parser.add_argument("--quick", action="store_true", help="256 MiB per case, no vLLM")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a few seconds: 8 MiB per case, 4-block jobs, one run, no vLLM, fio only if "
        "already installed",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--roots",
        default=None,
        help="N[,N...]: one tier striped over N throttled loop devices instead "
        "(benchmarks/fs_striping.py, which takes the other options of that run)",
    )
    args, rest = parser.parse_known_args()
    if args.roots is not None:
        from benchmarks import fs_striping

        sys.argv = [fs_striping.__file__, "--roots", args.roots, *rest]
        fs_striping.main()
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if args.quick:
        args.total_mib, args.skip_vllm, args.gil_s, args.reps = 256, True, 1.5, 1
    if args.smoke:
        args.total_mib, args.skip_vllm, args.gil_s, args.reps = 8, True, 0.2, 1
        args.job_blocks, args.jobs_in_flight, args.queue_depth = 4, 2, 4
    logging.basicConfig(level=logging.WARNING)
    apply_auth_offload_options(args)
    backends, skipped = available_backends(args.backend)
    for backend, reason in skipped.items():
        print(f"# backend {backend} is not usable here: {reason}", flush=True)
    if not args.smoke and not args.mac_only:  # smoke and MAC-only runs install nothing
        ensure_fio()
    scratch = Path(tempfile.mkdtemp(prefix="fs-tier-bench-", dir=args.dir))
    try:
        results = {
            (name, backend): bench_case(name, CASES[name], backend, args, scratch)
            for name in args.cases
            for backend in backends
            if not args.mac_only
        }
        vllm = None if args.mac_only else run_vllm(args, scratch)
        cases = [] if args.skip_mac else args.cases
        mac = {case: bench_mac(case, CASES[case], args, scratch) for case in cases}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not args.mac_only:
        report(results, vllm, args, skipped)
    report_mac(mac, args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps({**to_json(results, vllm), "mac": mac}, indent=1))


if __name__ == "__main__":
    main()
