"""Every benchmark's ``--smoke`` mode runs and prints its verdict or ceiling lines.

Each ``benchmarks/NAME.py`` runs in a subprocess (this interpreter, from the
repository's root) with ``--smoke``: tiny sizes, one run, a few seconds. The
test asserts the exit status and that the lines carrying the benchmark's
verdicts, ceilings or peers are printed - never a figure or whether a target
was met (these machines are noisy). The benchmarks run two at a time (most of
their time is fixed-length rounds and sleeps), the longest first.

Benchmarks that need what a plain machine lacks are run where possible and
skipped with the reason otherwise: ``gpu_copy`` runs on the simulated device;
``redis_tier`` needs redis-server installed (the smoke run installs nothing);
``vllm_engine`` and ``vllm_tiers`` need the vLLM environments
``scripts/vllm_cpu_env.sh`` and ``scripts/vllm_env.sh`` build, which this test
does not build: here their arguments are parsed without vLLM instead.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
MAX_MODULE_LINES = 450
#: Generous: a smoke run takes seconds; this only stops a hung one.
TIMEOUT_S = 240


def _missing_module(name: str, why: str) -> Callable[[], str]:
    return lambda: "" if importlib.util.find_spec(name) is not None else why


def _missing_distribution(name: str, why: str) -> Callable[[], str]:
    def check() -> str:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            return why
        return ""

    return check


def _cannot_stripe() -> str:
    from benchmarks.fs_striping import missing_requirement

    return missing_requirement() or ""


def _no_redis() -> str:
    if shutil.which("redis-server") and shutil.which("redis-cli"):
        return ""
    return "redis-server is not installed (a smoke run installs nothing)"


def _never() -> str:
    return ""


@dataclass(frozen=True)
class Smoke:
    """How a benchmark's smoke run is called and the lines (regular expressions) it prints."""

    lines: tuple[str, ...]
    args: tuple[str, ...] = ()
    #: Why it cannot run here ('' when it can).
    skip: Callable[[], str] = _never
    #: Relative run time, to start the longest first.
    weight: int = 1


VERDICT_OK = r"(ok|OVER)"
MET = r"(met|missed)"
SMOKES: dict[str, Smoke] = {
    "backpressure": Smoke(
        (
            # Accounting is exact: these must say ok. Timing verdicts may say either.
            r"^verdict: dropped blocks [\d,]+ in stats, \S+ in Prometheus \(same moment\): ok$",
            r"^verdict: offered = stored \+ dropped for the throttled tier \(.*\): ok$",
            r"^verdict: refused offloads counted: [\d,]+ ",
            r"^verdict: throttled step p99 [\d.]+x of steps alone \(target <= 1\.25x\): "
            r"(ok|ABOVE)$",
            r"^verdict: throttled step p99 [\d.]+x of the same steps with the tier working "
            r"only between them .*: (ok|ABOVE)$",
            r"^verdict: throttled step p99 [\d.]+x of the unthrottled tier's .*: (ok|ABOVE)$",
            r"^\s+throttled\s+[\d,]+\s+[\d,]+\s+[\d,]+\s+[\d,]+\s+[\d.]+%",
            r"^\s*throttled, tier between steps\s+[\d,]+\s+[\d,]+\s+[\d,]+\s+[\d,]+\s+[\d.]+%",
        ),
        weight=7,
    ),
    "copy_engine": Smoke(
        (
            r"^\s+engine\s+block\s+direction\s+GB/s\s+memcpy GB/s\s+ratio$",
            r"^\s+host\s+2048 KiB\s+store\s+[\d.]+\s+[\d.]+\s+\d+%$",
            r"^\s+host/\w+\s+2048 KiB \(8 x 256 KiB\)\s+load\s",
            r"^CUDA engine: benchmarks/gpu_copy\.py",
        ),
        weight=4,
    ),
    "engine_step": Smoke(
        (
            r"\| p50 <= 1\.10x \| p99 <= 1\.25x \|$",
            r"^\| steps alone \(control: a spin process rounds\) ",
            rf"^\| control: a spin process +\|.*\| {MET} +\| {MET} +\|$",
            r"^\| steps alone \(memory rounds\) ",
            rf"^\| memory +\|.*\| {MET} +\| {MET} +\|$",
            rf"^\| memory \(child process\) +\|.*\| {MET} +\| {MET} +\|$",
            r"^- alone A/A: .* over 3 rows\.",
        ),
        weight=4,
    ),
    "facade": Smoke(
        (
            r"^## 1\. Hand-off scheduler -> loop",
            r"^\| Mailbox: deque \+ coalesced wake-up \(used\) ",
            r"^## 2\. Hand-back loop -> scheduler",
            rf"^\| submit_store \(loop busy\) +\|.*\| {VERDICT_OK}/{VERDICT_OK} +\|$",
            rf"^\| get_finished, nothing ready +\|.*\| {VERDICT_OK} +\|$",
            r"^## 3b\. End to end with MemoryTier",
            # Section 4: the alone row is an A/A of the same run, its verdict a real one.
            rf"^\| scheduler loop alone: A/A, later run vs earlier \|.*\| {VERDICT_OK} +\|$",
            rf"^\| engine step: \+1 store \+1 load job per batch +\|.*\| {VERDICT_OK} +\|$",
            rf"^\| tier flat out: 64 jobs kept in flight +\|.*\| {VERDICT_OK} +\|$",
            r"^\| scheduler batches alone +\| ",
            rf"^\| checksum xxh3_128 per block +\|.*\| {VERDICT_OK} +\|$",
            r"^## 6\. anyio replacements",
            r"^\| asyncio\.to_thread \+ shield \(before\) +\| ",
        ),
        weight=6,
    ),
    "fs_tier": Smoke(
        (
            r"^CPU: ",
            r"^case\s+backend\s+phase\s+GB/s\s+raw\s+fio\s+of raw\s+target\s",
            r"^2MiB\s+threads\s+store O_DIRECT\s+[\d.]+\s+[\d.]+\s+\S+\s+\d+%\s+85%\s",
            r"^64KiB\s+threads\s+load O_DIRECT\s+[\d.]+\s+[\d.]+\s+\S+\s+\d+%\s+70%\s",
            r"^64KiB\s+threads\s+load buffered cold\s",
            r"^GIL 64KiB threads: pure-Python loop .* slowdown [\d.]+x \(target <= 1\.25x\)$",
            r"^MAC 2MiB store ghash-aes *: [\d.]+ GB/s without auth_key_\*, [\d.]+ with ",
            r"^MAC 2MiB store blake3 +: [\d.]+ GB/s without auth_key_\*, [\d.]+ with ",
            r"^MAC 64KiB load  hmac-sha256 *: [\d.]+ GB/s without auth_key_\*, [\d.]+ with ",
        ),
        weight=4,
    ),
    "fs_reopen": Smoke(
        (
            r"^fs tier of [\d,]+ blocks of 4 KiB \(\d+ CPUs\): stored in [\d.]+ s, journal ",
            r"^\s*reopen, to the end of the first load\s+[\d.]+\s+[\d.]+$",
            r"^\s+replay of the journal\s+[\d.]+\s+[\d.]+$",
            r"^index memory: \d+ bytes per block ",
            r"^\s*encode in a worker, GIL breaks \(now\)\s+\d+\s+\d+\s+[\d.na]+\s",
        ),
    ),
    "fs_striping": Smoke(
        (
            r"^CPU: ",
            r"^roots +phase +GB/s +N x 1 root +scaling +fio GB/s +of fio +target$",
            r"^ +2 +store +[\d.]+ +[\d.]+ +[\d.]+x ",
            r"^verdict: --roots 2 load [\d.]+x of one root \(target >= 1\.8x\): (ok|BELOW)$",
        ),
        skip=_cannot_stripe,
        weight=2,
    ),
    "gc_pause": Smoke(
        (
            r"^\s+structure\s+blocks\s+tracked objects\s+full gc ms\s+ns/block$",
            r"^\s+fs index\s+20,000\s+[\d,]+\s+[\d.]+\s+[\d.]+$",
            r"^\s+CPU tier, adaptive\s+20,000\s",
            # Deterministic (the collector's own bookkeeping): must say ok.
            r"^verdict: the fs index leaves [\d.]+ tracked objects per block "
            r"\(target < 0\.01\): ok$",
        ),
    ),
    "gil_handoff": Smoke(
        (
            r"^workload: yield$",
            r"^workload: socket$",
            r"^\| \(scheduler alone\) +\| \d+ +\| ",
            r"^\| off +\|.*\((1\.00x|-)\) +\|$",
            r"^\| 0\.5 ms +\|.*\) +\|$",
        ),
        weight=4,
    ),
    "gpu_copy": Smoke(
        (
            r"^device: simulated ",
            r"^\s+ours/auto\s+2 MiB\s+store\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+%",
            r"^verdict: ours/auto 2 MiB store at \d+% of pinned cudaMemcpyAsync, "
            r"on-GPU \d+%, 4 jobs in flight \d+% \(target >= 80%\): (ok|BELOW)$",
            r"^verdict: ours/auto 2 MiB load at \d+% of pinned cudaMemcpyAsync, on-GPU ",
            r"^verdict: ours/auto vs vLLM's worker at 32 x 16 KiB load: n/a \(",
        ),
        args=("--device", "simulated"),
        skip=_missing_module("torch", "torch is not installed (the CUDA engine's benchmark)"),
        weight=6,
    ),
    "isolation": Smoke(
        (
            r"^\| where the tier runs +\| schedule p50 us ",
            r"^\| alone +\| \d+ +\| 1\.00x ",
            rf"^\| in-process +\|.*\| {MET} / {MET} +\|$",
            rf"^\| child process +\|.*\| {MET} / {MET} +\|$",
        ),
        weight=3,
    ),
    "loop_cost": Smoke(
        (
            r"\| loop thread us/block \| loop x floor \|",
            r"^\| floor: null tier \(16 KiB\) \| store +\| \d+/\d+ +\| \S+ +\| (1\.00x|-) ",
            r"^\| memory \(16 KiB\) +\| load +\| \d+/\d+ +\| \S+ +\| ([\d.]+x|-) ",
            r"^\| fs-threads \(16 KiB\) +\| store +\| \d+/\d+ +\| \S+ +\| ([\d.]+x|-) ",
            r"^floor \(16 KiB\): a null tier .* 'loop x floor' is each tier's loop-thread",
        ),
        weight=3,
    ),
    "manager": Smoke(
        (
            r"\| bare primary \| overhead \| cpu / target$",
            r"^\s+1,000 \| store-cascade +\|",
            r"^\s+10,000 \| lookup-promote-load +\|",
            r"^10,000 vs 1,000 blocks \(cpu\): .* Target: < 10 us and flat$",
        ),
    ),
    "policy_replay": Smoke(
        (
            r"^workload\s+policy\s+admission\s+hit rate\s+Belady\s+of Belady\s",
            # The Mooncake trace shipped in tests/data/, then the synthetic workload.
            r"^mooncake_synthetic_trace\.jsonl\.gz\s+lru\s+all\s+[\d.]+%\s+[\d.]+%\s+[\d.]+%\s",
            r"^synthetic seed 0\s+lru\s+all\s+[\d.]+%\s+[\d.]+%\s+[\d.]+%\s",
            r"^ceiling: Belady's MIN on one cache of the whole stack's blocks",
        ),
        weight=2,
    ),
    "primary": Smoke(
        (
            r"^dict\s+10000\s",
            r"^dict\s+10k/1k\s",
            r"^kvaware\s+10000 x LRU: fill sum [\d.]+x, evict sum [\d.]+x$",
            r"^worst per-block cost against LRU: [\d.]+x \(target <= 2\.0x\): (OK|MISSED)$",
            r"^largest per-block figure: [\d.]+ us \(target < 5\.0 us\): (OK|MISSED)$",
            r"^worst 10k/1k ratio of the sums: [\d.]+x \(target <= 1\.5x\): (OK|MISSED)$",
        ),
    ),
    "redis_tier": Smoke(
        (
            r"^redis-server on redis://",
            r"^\| block .* \| auth GB/s \| auth/tier \| auth CPU s/GB \| blake3 GB/s \| "
            r"blake3/tier \|",
            r"^\|\s+64 KiB \| store \|\s+[\d.]+ \|",
            r"^\|\s+1024 KiB \| load  \|\s+[\d.]+ \|",
            r"^\|\s+4096 KiB \| GIL released\s+\|\s+\d+ \|",
            r"^verdict: auth/tier 64 KiB load: median [\d.]+ of 1 run\(s\) \([\d.]+\) "
            r"\(target >= 0\.9\): (ok|BELOW)$",
        ),
        skip=_no_redis,
        weight=4,
    ),
    "vllm_engine": Smoke(
        (r"^A2 TTFT: ours/vLLM fs = [\d.]+x \(target <= 1\.0\), .* step time ours/off = ",),
        skip=_missing_distribution(
            "vllm-cpu",
            "needs the vllm-cpu 0.32 engine environment scripts/vllm_cpu_env.sh builds (not "
            "built by this test) and starts an engine per configuration: minutes",
        ),
    ),
    "vllm_tiers": Smoke(
        (
            r"^64KiB\s+vllm-fs\s+[\d.]+\s+[\d.]+\s",
            r"^64KiB\s+ours-threads\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+/\s+[\d.]+\s+>= 3\.0x GB/s",
            r"^# CORRECTNESS: PASS ",
        ),
        skip=_missing_module(
            "vllm",
            "needs vLLM 0.33, the environment scripts/vllm_env.sh builds (not built by this "
            "test): PY=$(scripts/vllm_env.sh) && PYTHONPATH=. $PY benchmarks/vllm_tiers.py --smoke",
        ),
    ),
}


def benchmark_names() -> list[str]:
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "__init__")


def run_smoke(name: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, f"benchmarks/{name}.py", "--smoke", *SMOKES[name].args]
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


@pytest.fixture(scope="module")
def smoke_runs(
    request: pytest.FixtureRequest,
) -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """The smoke runs this session's selected tests need, two at a time, the longest first."""
    wanted = {
        item.callspec.params["name"]
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.originalname == "test_the_smoke_run_prints_its_verdict_lines"
    }
    runnable = [name for name in wanted if name in SMOKES and not SMOKES[name].skip()]
    runnable.sort(key=lambda name: -SMOKES[name].weight)
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {name: pool.submit(run_smoke, name) for name in runnable}


def test_every_benchmark_has_a_smoke_run() -> None:
    assert benchmark_names() == sorted(SMOKES)


@pytest.mark.parametrize("name", sorted(SMOKES))
def test_the_smoke_run_prints_its_verdict_lines(
    name: str, smoke_runs: dict[str, Future[subprocess.CompletedProcess[str]]]
) -> None:
    smoke = SMOKES[name]
    why = smoke.skip()
    if why:
        pytest.skip(f"benchmarks/{name}.py: {why}")
    done = smoke_runs[name].result()
    report = f"stdout:\n{done.stdout[-6000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, report
    lines = done.stdout.splitlines()
    missing = [p for p in smoke.lines if not any(re.search(p, line) for line in lines)]
    assert not missing, f"no line matches {missing}\n{report}"


@pytest.mark.parametrize("name", ["vllm_engine", "vllm_tiers"])
def test_the_vllm_benchmarks_parse_their_arguments_without_vllm(name: str) -> None:
    """Where their environments are not built, at least their arguments and imports hold."""
    done = subprocess.run(
        [sys.executable, f"benchmarks/{name}.py", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "--smoke" in done.stdout


@pytest.mark.parametrize(
    "path", sorted(BENCHMARKS.rglob("*.py")), ids=lambda p: str(p.relative_to(REPO))
)
def test_every_benchmark_module_is_short_and_says_what_it_owns(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES
    assert ast.get_docstring(ast.parse(text)), f"{path.name} opens with no docstring"
