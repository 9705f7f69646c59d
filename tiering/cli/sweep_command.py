"""``tiering sweep``: hit rate against capacity for each eviction policy (and, with
``--admission``, each cascade admission policy), printed and written as PNG, CSV and JSON.

In place of a trace, ``family:all`` or ``family:NAME[@SEED],...`` sweeps workload families
(:mod:`tiering.replay.families`): every family's table, the gap each policy closes, and
each policy's worst distance to max(LRU, ARC) over them all."""

from __future__ import annotations

import argparse
import json
import math
import threading
from pathlib import Path
from typing import Any

from tiering.cli.arguments import check_writable, policy_setting
from tiering.cli.exits import EXIT_OK, UsageError
from tiering.cli.workload import load_workload
from tiering.core.errors import ConfigError
from tiering.replay.console import SignalStop, consoles, logging_to, progress_bar
from tiering.support.units import parse_size


def _parse_capacities(text: str, block_bytes: int) -> list[int]:
    capacities = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            blocks = int(item) if item.isdigit() else parse_size(item) // block_bytes
        except ValueError as exc:
            raise UsageError(f"--capacities: {exc}") from None
        if blocks <= 0:
            raise UsageError(f"--capacities: {item!r} is less than one block ({block_bytes} bytes)")
        capacities.append(blocks)
    if not capacities:
        raise UsageError("--capacities: give at least one capacity")
    return capacities


def _admission_choices(args: argparse.Namespace) -> list[Any]:
    """``--admission``, resolved before any simulation runs (empty without the option)."""
    from tiering.policies import resolve_admission, split_policy_list

    if not args.admission:
        return []
    try:
        return [
            resolve_admission(policy_setting(text, "--admission"), key="--admission")
            for text in split_policy_list(args.admission)
        ]
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def _admission_sweep(
    args: argparse.Namespace,
    requests: Any,
    result: Any,
    policies: Any,
    admissions: list[Any],
    stop: threading.Event,
) -> list[Any]:
    from tiering.replay import sweep as sweeping

    return sweeping.run_admission_sweep(
        requests,
        [point.capacity_blocks for point in result.points],
        policies=policies,
        admissions=admissions,
        secondary_factor=args.secondary_factor,
        block_tokens=args.block_tokens,
        store_chunk_blocks=args.chunk_blocks,
        should_stop=stop.is_set,
    )


def run_sweep_command(args: argparse.Namespace, signals: SignalStop) -> int:
    from tiering.policies import POLICY_NAMES, PolicyChoice, resolve_policy, split_policy_list
    from tiering.replay import family_sweep
    from tiering.replay import sweep as sweeping
    from tiering.replay.trace import trace_footprint

    texts = split_policy_list(args.policies) if args.policies else list(POLICY_NAMES)
    if not texts:
        raise UsageError("--policies: give at least one eviction policy")
    policies: list[PolicyChoice] = []
    for text in texts:
        try:
            policies.append(resolve_policy(policy_setting(text, "--policies"), key="--policies"))
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
    labels = [choice.label for choice in policies]
    if len(set(labels)) != len(labels):
        raise UsageError(f"--policies: a policy is listed twice: {', '.join(labels)}")
    families = _family_text(args)
    if families is not None:
        return _run_families(args, signals, families, policies)
    admissions = _admission_choices(args)
    outputs = {ext: Path(f"{args.out}.{ext}") for ext in ("png", "csv", "json")}
    for path in outputs.values():
        check_writable(path, "--out")
    try:  # the plot is written last: find out now, not after the whole sweep
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            "tiering sweep writes a PNG plot with matplotlib, which is not installed: "
            "pip install 'kv-tiering[plot]'"
        ) from None
    out, err = consoles()
    with logging_to(err, args.verbose):
        workload = load_workload(args)
    footprint = trace_footprint(workload.requests)
    capacities = (
        _parse_capacities(args.capacities, args.block_bytes)
        if args.capacities
        else sweeping.default_capacities(footprint)
    )
    stop = threading.Event()
    steps = len(set(capacities)) * (len(policies) + 1)
    with progress_bar(err, args.no_progress) as progress, signals.clean_stop(stop):
        task = progress.add_task("sweep", total=steps, status="")

        def on_step(name: str, capacity: int) -> None:
            progress.update(task, advance=1, status=f"{name} @ {capacity:,} blocks")

        result = sweeping.run_sweep(
            workload.requests,
            capacities,
            policies=policies,
            block_tokens=args.block_tokens,
            block_bytes=args.block_bytes,
            store_chunk_blocks=args.chunk_blocks,
            trace_name=workload.name,
            on_step=on_step,
            should_stop=stop.is_set,
        )
    admission: list[Any] = []
    if admissions and result.points and not stop.is_set():
        with signals.clean_stop(stop):  # a signal stops it; what the policies found is written
            admission = _admission_sweep(
                args, workload.requests, result, policies, admissions, stop
            )
    if result.points:
        sweeping.write_csv(result, outputs["csv"])
        sweeping.write_json(result, outputs["json"], admission)
        sweeping.plot_png(result, outputs["png"])
    if args.json:
        print(json.dumps(sweeping.sweep_json(result, admission), indent=2))
    else:
        sweeping.render_table(result, out)
        family_sweep.render_gaps(result, out)
        if admission:
            sweeping.render_admission_table(admission, footprint, args.block_bytes, out)
        if result.points:
            out.print("Wrote " + ", ".join(str(p) for p in outputs.values()))
        else:
            out.print("Interrupted before the first capacity finished: nothing written.")
    return signals.exit_status if signals.signum is not None else EXIT_OK


FAMILY_PREFIX = "family:"


def _family_text(args: argparse.Namespace) -> str | None:
    """What follows ``family:`` in the trace argument (None for a trace or no argument)."""
    text = None if args.trace is None else str(args.trace)
    if text is None or not text.startswith(FAMILY_PREFIX):
        return None
    return text[len(FAMILY_PREFIX) :]


def _family_workloads(args: argparse.Namespace, text: str) -> list[tuple[str, Any]]:
    """(label, requests) per family named; the shared trace is read whole from the checkout."""
    from tiering.replay import families as fam
    from tiering.replay.trace import read_trace

    try:
        named = fam.parse_families(text)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    count = args.requests if args.requests is not None else 2000
    workloads: list[tuple[str, Any]] = []
    for name, seed in named:
        if name == "trace":
            if not fam.SHARED_TRACE.is_file():
                raise UsageError(
                    f"family trace: {fam.SHARED_TRACE} is not here (a checkout has it)"
                )
            workloads.append(
                (fam.SHARED_TRACE.name, read_trace(fam.SHARED_TRACE, args.block_tokens))
            )
            continue
        seed = args.seed if seed is None else seed
        label = f"{name}(seed={seed}, requests={count})"
        workloads.append((label, fam.family_requests(name, count, seed, args.block_tokens)))
    return workloads


def _run_families(
    args: argparse.Namespace, signals: SignalStop, text: str, policies: list[Any]
) -> int:
    from tiering.policies import resolve_policy
    from tiering.replay import family_sweep
    from tiering.replay import sweep as sweeping
    from tiering.replay.families import FAMILY_FRACTIONS
    from tiering.replay.trace import trace_footprint

    if args.admission:
        raise UsageError("--admission compares one workload: name a trace, not family:")
    labels = [choice.label for choice in policies]
    for place, name in enumerate(("lru", "arc")):  # the gap and the default rule need both
        if name not in labels:
            policies.insert(place, resolve_policy(name))
    workloads = _family_workloads(args, text)
    for index in range(len(workloads)):  # before the sweep, not after it
        for ext in ("png", "csv", "json"):
            check_writable(Path(f"{args.out}-{index}.{ext}"), "--out")
    out, err = consoles()
    stop = threading.Event()
    results: list[Any] = []
    with progress_bar(err, args.no_progress) as progress, signals.clean_stop(stop):
        for index, (label, requests) in enumerate(workloads):
            if stop.is_set():
                break
            footprint = trace_footprint(requests)
            capacities = (
                _parse_capacities(args.capacities, args.block_bytes)
                if args.capacities
                else sorted({max(1, math.ceil(footprint * f)) for f in FAMILY_FRACTIONS})
            )
            task = progress.add_task(label, total=len(capacities) * (len(policies) + 1), status="")

            def on_step(name: str, capacity: int, task: Any = task) -> None:
                progress.update(task, advance=1, status=f"{name} @ {capacity:,} blocks")

            result = sweeping.run_sweep(
                requests,
                capacities,
                policies=policies,
                block_tokens=args.block_tokens,
                block_bytes=args.block_bytes,
                store_chunk_blocks=args.chunk_blocks,
                trace_name=label,
                on_step=on_step,
                should_stop=stop.is_set,
            )
            if result.points:
                results.append(result)
                prefix = f"{args.out}-{index}"
                sweeping.write_csv(result, Path(f"{prefix}.csv"))
                sweeping.write_json(result, Path(f"{prefix}.json"))
                sweeping.plot_png(result, Path(f"{prefix}.png"))
    if args.json:
        print(json.dumps([sweeping.sweep_json(result) for result in results], indent=2))
    else:
        for result in results:
            sweeping.render_table(result, out)
            family_sweep.render_gaps(result, out)
        family_sweep.render_verdict(results, out)
        out.print(f"Wrote {args.out}-N.png, .csv and .json for families 0..{len(results) - 1}")
    return signals.exit_status if signals.signum is not None else EXIT_OK
