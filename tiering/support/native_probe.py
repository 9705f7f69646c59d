"""Crash-proof probes of optional fast paths: run them in a child process first.

A fast path that relies on native code (an I/O binding, a CPU feature, a
kernel interface) can take the whole interpreter down - SIGILL on a CPU
without the instructions a wheel was built for, SIGSEGV on an ABI mismatch -
and no signal handler can recover from that. So before a process uses such a
path, :func:`probe_in_child` runs the path's own self-test function in a child
interpreter and reports what happened; only a clean exit lets the caller go on.

Verdicts are cached per machine in ``$KV_TIERING_CACHE_DIR`` (default
``$XDG_CACHE_HOME/kv-tiering`` or ``~/.cache/kv-tiering``), keyed by the
probe, the self-test module's source, the interpreter, the kernel release and
the CPU's flags, so start-up stays fast and a changed machine is probed again.
Timeouts are never cached. The cache is advisory: an unreadable or unwritable
cache only costs a child process per interpreter.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ProbeVerdict", "cache_dir", "describe_cpu", "probe_in_child"]

#: Seconds a self-test may take before it counts as failed (a hung path is unusable).
DEFAULT_TIMEOUT_S = 60.0
#: Set in the child's environment so code can tell it runs inside a probe.
CHILD_ENV = "KV_TIERING_PROBE_CHILD"
_CACHE_FILE = "native-probes.json"
_lock = threading.Lock()
_verdicts: dict[str, ProbeVerdict] = {}


@dataclass(frozen=True)
class ProbeVerdict:
    """What a probe found: ``ok``, or why the path must not be used here."""

    ok: bool
    reason: str | None = None
    cached: bool = False


def cache_dir() -> Path:
    """Where verdicts are cached (see the module docstring)."""
    explicit = os.environ.get("KV_TIERING_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "kv-tiering"


def _cpuinfo_field(name: str) -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.partition(":")[0].strip() == name:
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> str:
    return _cpuinfo_field("flags") or platform.processor()


def describe_cpu() -> str:
    """The CPU model, core count and AVX-512 support (for benchmark reports)."""
    model = _cpuinfo_field("model name") or platform.processor() or platform.machine()
    avx512 = "avx512f" in _cpu_flags().split()
    return f"{model}, {os.cpu_count()} cores, AVX-512 {'yes' if avx512 else 'no'}"


def _machine_key(name: str, target: str) -> str:
    module_name = target.partition(":")[0]
    spec = importlib.util.find_spec(module_name)
    source = b""
    if spec is not None and spec.origin and os.path.exists(spec.origin):
        source = Path(spec.origin).read_bytes()
    parts = [
        name,
        target,
        hashlib.sha256(source).hexdigest(),
        sys.executable,
        sys.version,
        json.dumps(sys.path),  # a different import path can load different code
        os.environ.get("LD_PRELOAD", ""),
        platform.release(),
        platform.machine(),
        hashlib.sha256(_cpu_flags().encode()).hexdigest(),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _read_cache() -> dict[str, dict[str, object]]:
    try:
        raw = json.loads((cache_dir() / _CACHE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _write_cache(key: str, verdict: ProbeVerdict) -> None:
    directory = cache_dir()
    with contextlib.suppress(OSError):
        directory.mkdir(parents=True, exist_ok=True)
        entries = _read_cache()
        entries[key] = {"ok": verdict.ok, "reason": verdict.reason}
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".probes-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(entries, out)
            os.replace(tmp, directory / _CACHE_FILE)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


_CHILD_CODE = """
import importlib, json, sys
sys.path[:0] = json.loads(sys.argv[1])
module, _, function = sys.argv[2].partition(":")
getattr(importlib.import_module(module), function)()
"""


def _describe_exit(returncode: int, stderr: str) -> str:
    if returncode < 0:
        signum = -returncode
        try:
            signame = signal.Signals(signum).name
        except ValueError:
            signame = f"signal {signum}"
        if signum == signal.SIGILL:
            return (
                f"its self-test crashed with {signame} (illegal instruction: built for CPU "
                "features this machine lacks)"
            )
        return f"its self-test crashed with {signame}"
    last = next((line for line in reversed(stderr.strip().splitlines()) if line.strip()), "")
    return f"its self-test failed: {last[:300] or f'exit status {returncode}'}"


def _run_child(target: str, timeout_s: float) -> ProbeVerdict | None:
    # The child's temporary files go in a directory this process removes: a child that
    # crashes or is killed at the timeout cannot clean up after itself.
    scratch = tempfile.mkdtemp(prefix="kv-tiering-probe-")
    env = dict(os.environ, **{CHILD_ENV: "1", "TMPDIR": scratch})
    try:
        return _child_verdict(target, timeout_s, env)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _child_verdict(target: str, timeout_s: float, env: dict[str, str]) -> ProbeVerdict | None:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD_CODE, json.dumps(sys.path), target],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None
    except OSError as exc:
        return ProbeVerdict(False, f"its self-test could not be started: {exc}")
    if done.returncode == 0:
        return ProbeVerdict(True)
    return ProbeVerdict(False, _describe_exit(done.returncode, done.stderr))


def probe_in_child(name: str, target: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> ProbeVerdict:
    """Run ``target`` (``"module:function"``, raising on failure) in a child interpreter.

    Returns the verdict (from this process's memory, the machine cache, or a
    fresh child); never raises for what the child does, and a crash of the
    child cannot reach the caller. ``name`` labels the path in the cache and
    in reasons. Blocks for the child's run (at most ``timeout_s``) the first
    time on a machine: call it where start-up may block (tier construction or
    ``open``), not on an event loop's hot path.
    """
    with _lock:
        known = _verdicts.get(target)
        if known is not None:
            return known
        key = _machine_key(name, target)
        cached = _read_cache().get(key)
        if isinstance(cached, dict) and isinstance(cached.get("ok"), bool):
            reason = cached.get("reason")
            verdict = ProbeVerdict(
                bool(cached["ok"]), reason if isinstance(reason, str) else None, cached=True
            )
        else:
            fresh = _run_child(target, timeout_s)
            if fresh is None:
                verdict = ProbeVerdict(False, f"its self-test did not finish in {timeout_s:g} s")
            else:
                verdict = fresh
                _write_cache(key, verdict)
        if not verdict.ok:
            verdict = ProbeVerdict(False, f"{name}: {verdict.reason}", verdict.cached)
        _verdicts[target] = verdict
        return verdict


def forget_verdicts() -> None:
    """Drop this process's memory of verdicts (tests; the machine cache stays)."""
    with _lock:
        _verdicts.clear()
