"""Runs wherever users run: a CPU without AVX-512, a binding that dies with SIGILL.

* Under ``qemu-x86_64 -cpu max`` (a CPU without AVX-512; io_uring answers ENOSYS
  there): ``tiering replay`` verifies every byte, the fs tier's tests pass, and
  every extra's native code imports and runs.
* With the SIGILL stand-in first on the path (ring construction kills the
  process, as the ``liburing`` 2026.3.x wheels do on such CPUs): the fs tier's
  tests pass on the thread backend.
* Native code in the environment that contains AVX-512 instructions belongs to
  a library known to choose its code at run time (and exercised under the
  emulator above); anything else would crash such a CPU.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.debian import debian_binary
from tiering.copy import bulk

ROOT = Path(__file__).resolve().parent.parent
STANDIN = ROOT / "tests" / "support" / "sigill_standin"
#: What differs on a CPU without AVX-512: the native code a block passes through (checksums,
#: copies: test_fs_format, test_fs_tier) and the I/O backend chosen when io_uring answers
#: ENOSYS (test_fs_io). The fs tier's pure-Python parts (its index, the conformance kit's
#: generic checks) run the same bytecode there and are run natively by the suite.
EMULATED_FS_TESTS = ["tests/test_fs_tier.py", "tests/test_fs_io.py", "tests/test_fs_format.py"]
#: A ring binding that dies: the probes that must survive it (test_fs_kernel_ring) and the
#: tier on the thread backend they fall back to.
SIGILL_FS_TESTS = ["tests/test_fs_tier.py", "tests/test_fs_io.py", "tests/test_fs_kernel_ring.py"]
PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]
#: Distributions whose AVX-512 code sits behind run-time CPU dispatch (each one is
#: imported and exercised under the emulated CPU by test_extras_run_without_avx512).
#: torch is too large to disassemble in a test; it dispatches the same way.
RUNTIME_DISPATCH = {"numpy", "pillow", "xxhash", "torch", "blake3", "cryptography"}

pytestmark = pytest.mark.timeout(1200)


def run(command: list[str], *, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    done = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT), **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{output[-4000:]}"
    return output


@pytest.fixture(scope="module")
def emulated() -> list[str]:
    """The command prefix that runs this interpreter on a CPU without AVX-512."""
    return [debian_binary("qemu-x86_64", "qemu-user"), "-cpu", "max", sys.executable]


@pytest.fixture
def cache_dir(tmp_path: Path) -> dict[str, str]:
    return {"KV_TIERING_CACHE_DIR": str(tmp_path / "cache")}


def test_replay_without_avx512(emulated: list[str], cache_dir: dict[str, str]) -> None:
    output = run([*emulated, "-m", "tiering", "replay", "--requests", "300"], env=cache_dir)
    assert "loaded blocks verified byte for byte" in output
    assert output.count("io_uring is not usable here") == 1  # ENOSYS under the emulator


def test_extras_run_without_avx512(emulated: list[str]) -> None:
    code = """
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt, numpy, prometheus_client, redis, torch, xxhash, yaml
assert float((torch.arange(4096, dtype=torch.float32) * 2).sum()) == 4096 * 4095
assert numpy.frombuffer(bytes(range(256)) * 64, dtype=numpy.uint8).sum() == 64 * 32640
assert xxhash.xxh3_128_intdigest(bytes(1 << 20)) == xxhash.xxh3_128(bytes(1 << 20)).intdigest()
from tiering.copy.host import HostCopyEngine
from tiering.copy import bulk
# Our own extension (where built): a table of 4 MiB or more takes its streaming stores.
src = numpy.random.default_rng(0).integers(0, 256, 5 << 20, dtype=numpy.uint8)
dst = numpy.zeros_like(src)
starts = numpy.arange(640, dtype=numpy.uint64) * numpy.uint64(8192)
bulk.copy_regions(src.ctypes.data + starts[::-1], dst.ctypes.data + starts, 8192)
assert (dst.reshape(640, 8192) == src.reshape(640, 8192)[::-1]).all()
# ...and a region of 64 KiB or more in a small call: streamed, its source lines flushed.
dst[:] = 0
bulk.copy_regions([src.ctypes.data + 1], [dst.ctypes.data + 3], 200_003)
assert (dst[3:200_006] == src[1:200_004]).all() and not dst[200_006:].any()
# ...and a block's lines evicted once read (CLFLUSHOPT or CLFLUSH): its bytes unchanged.
from tiering.copy.caches import evict_block
evict_block(memoryview(dst)[5:(1 << 20) + 5])
assert (dst[3:200_006] == src[1:200_004]).all() and not dst[200_006:].any()
print("bulk copies:", bulk.active_mode())
# Block tags: OpenSSL's AES-GCM (the default ghash-aes) and keyed BLAKE3 pick their
# code at run time (AES-NI/PCLMUL without VAES here; AVX2/SSE4.1/SSE2 for BLAKE3).
import blake3
from tiering.tier.auth import BlockAuthenticator
auth = BlockAuthenticator(b"k" * 32, "test")
print("tag:", auth.tag(b"key", b"fingerprint", src[: 3 << 20]).hex())
print("blake3 tag:", auth.tag(b"key", b"fingerprint", src[: 3 << 20], "blake3").hex())
print("blake3:", blake3.blake3(bytes(src[: 1 << 20]), key=b"k" * 32).hexdigest())
figure = plt.figure(); figure.gca().plot([1, 2]); figure.savefig(__import__("io").BytesIO())
print("extras ok")
"""
    output = run([*emulated, "-c", code])
    assert "extras ok" in output
    # The same tags as this (AVX-512) process computes.
    import blake3
    import numpy

    from tiering.tier.auth import BlockAuthenticator

    src = numpy.random.default_rng(0).integers(0, 256, 5 << 20, dtype=numpy.uint8)
    authenticator = BlockAuthenticator(b"k" * 32, "test")
    tag = authenticator.tag(b"key", b"fingerprint", src[: 3 << 20])
    assert authenticator.mac == "ghash-aes" and f"tag: {tag.hex()}" in output
    tag = authenticator.tag(b"key", b"fingerprint", src[: 3 << 20], "blake3")
    assert f"blake3 tag: {tag.hex()}" in output
    assert f"blake3: {blake3.blake3(bytes(src[: 1 << 20]), key=b'k' * 32).hexdigest()}" in output
    assert f"bulk copies: {'native' if bulk.native_available() else 'memmove'}" in output


def test_fs_tier_tests_without_avx512(emulated: list[str], cache_dir: dict[str, str]) -> None:
    output = run(
        [*emulated, "-m", "pytest", "-q", "-p", "no:cacheprovider", *EMULATED_FS_TESTS],
        env=cache_dir,
    )
    assert " passed" in output and " failed" not in output


def test_fs_tier_tests_with_a_binding_that_dies_with_sigill(cache_dir: dict[str, str]) -> None:
    env = {**cache_dir, "PYTHONPATH": os.pathsep.join([str(STANDIN), str(ROOT)])}
    output = run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SIGILL_FS_TESTS], env=env
    )
    assert " passed" in output and " failed" not in output


def _distribution_files() -> dict[Path, str]:
    """Every extension module installed, and ours built in place (an editable install)."""
    owners: dict[Path, str] = {
        path.resolve(): "kv-tiering" for path in ROOT.glob("tiering/**/*.so")
    }
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"].lower()
        for file in dist.files or ():
            if ".so" in file.name:
                owners[Path(str(dist.locate_file(file))).resolve()] = name
    return owners


def test_avx512_code_only_where_it_is_dispatched_at_run_time() -> None:
    objdump = debian_binary("objdump", "binutils")
    offenders: dict[str, int] = {}
    checked = 0
    for path, owner in sorted(_distribution_files().items()):
        if owner in RUNTIME_DISPATCH or not path.is_file():
            continue
        checked += 1
        listing = subprocess.run(
            [objdump, "-d", "--no-show-raw-insn", str(path)],
            capture_output=True,
            text=True,
            errors="replace",
            check=False,
        ).stdout
        count = listing.count("%zmm")
        if count:
            offenders[f"{owner}: {path.name}"] = count
    assert checked > 0
    assert not offenders, (
        "native code with AVX-512 instructions (SIGILL on CPUs without them), not known to "
        f"dispatch at run time: {offenders}"
    )
