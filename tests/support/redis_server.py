"""Real redis-server processes for tests: one standalone server or a 3-node cluster.

The fixtures install ``redis-server`` from Debian when it is missing (CI runs
as root with the package registries reachable) and start servers on free
loopback ports in temporary directories, without persistence. They never skip:
a machine that cannot run Redis fails these tests with the reason.

Import the fixtures explicitly in a test module::

    from tests.support.redis_server import redis_server  # noqa: F401
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

_INSTALL_LOCK = threading.Lock()
#: Hang guard for a server or cluster to come up (generous: machines are shared).
_START_TIMEOUT_S = 30.0
#: Fresh ports tried when another process took the chosen one before the server bound it.
_PORT_ATTEMPTS = 5
CLUSTER_NODES = 3


class _Stoppable(Protocol):
    def stop(self) -> None: ...


S = TypeVar("S", bound=_Stoppable)


def _install_hint() -> str:
    return "install it with: apt-get update && apt-get install -y redis-server"


def redis_binaries() -> tuple[str, str]:
    """Paths of ``redis-server`` and ``redis-cli``, installing them from Debian if missing."""
    with _INSTALL_LOCK:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server and cli:
            return server, cli
        apt = shutil.which("apt-get")
        if apt is None or os.geteuid() != 0:
            pytest.fail(
                f"redis-server is not installed and cannot be installed here; {_install_hint()}"
            )
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", "redis-server"]):
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                pytest.fail(
                    f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}"
                )
        # The Debian package starts a system service on 6379; tests use their own servers.
        subprocess.run(["service", "redis-server", "stop"], capture_output=True, check=False)
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if not (server and cli):
            pytest.fail(f"redis-server still missing after apt-get install; {_install_hint()}")
        return server, cli


def _die_with_parent() -> None:
    """In the child: get SIGKILL when the test process dies, so no server outlives a run."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, with_cluster_bus: bool = False) -> int:
    """A loopback port nobody listens on (and, for cluster nodes, port + 10000 too)."""
    for _ in range(200):
        port = random.randint(20000, 30000)
        if _port_free(port) and (not with_cluster_bus or _port_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found")


@dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA and the server and client certificates it signed (PEM files)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl() -> str:
    found = shutil.which("openssl")
    if found:
        return found
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        pytest.fail("openssl is not installed; install it with: apt-get install -y openssl")
    subprocess.run([apt, "install", "-y", "-qq", "openssl"], capture_output=True, check=False)
    found = shutil.which("openssl")
    if not found:
        pytest.fail("openssl still missing after apt-get install openssl")
    return found


def make_tls_files(directory: Path) -> TlsFiles:
    """Generate a CA, a server certificate for 127.0.0.1 and a client certificate."""
    openssl = _openssl()
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        done = subprocess.run([openssl, *args], cwd=directory, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(args)} failed: {done.stderr}")

    # EC keys: generated in milliseconds, where RSA takes most of a second each.
    new_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *new_key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=kv-tiering test CA")  # fmt: skip
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who in ("server", "client"):
        run("req", *new_key, "-keyout", f"{who}.key", "-out", f"{who}.csr",
            "-subj", f"/CN={who}")  # fmt: skip
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{who}.crt", "-days", "2",
            "-extfile", "san.cnf")  # fmt: skip
    return TlsFiles(
        ca_cert=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1 that a test can stop, kill and restart.

    ``extra_args`` are passed to ``redis-server`` (e.g. ``["--maxmemory", "2mb"]``).
    Restarts reuse the port, so clients reconnect to the same url. With ``tls``
    the server listens only for TLS (``rediss://``) and requires client certificates.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        cluster_node: bool = False,
        tls: TlsFiles | None = None,
    ) -> None:
        self.server_bin, self.cli_bin = redis_binaries()
        self.tls = tls
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._port_chosen_here = port is None
        self.port = port if port is not None else free_port(with_cluster_bus=cluster_node)
        self.extra_args = list(extra_args)
        self.cluster_node = cluster_node
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    def client(self) -> redis.Redis:
        """A synchronous raw client (for tests that poke the server directly)."""
        tls: dict[str, object] = {}
        if self.tls is not None:
            tls = {
                "ssl": True,
                "ssl_ca_certs": str(self.tls.ca_cert),
                "ssl_certfile": str(self.tls.client_cert),
                "ssl_keyfile": str(self.tls.client_key),
            }
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            socket_timeout=5,
            retry=Retry(NoBackoff(), 0),
            **tls,  # type: ignore[arg-type]
        )

    def start(self) -> RedisServer:
        """Start the server and wait until it answers.

        A port picked by :func:`free_port` can be taken by another process
        before the server binds it; the first start then retries on fresh
        ports (a restart keeps its port: clients hold the url).
        """
        for attempt in range(_PORT_ATTEMPTS):
            try:
                return self._start_once()
            except _PortTaken:
                if not self._port_chosen_here or attempt == _PORT_ATTEMPTS - 1:
                    raise
                self.port = free_port(with_cluster_bus=self.cluster_node)
        raise AssertionError("unreachable")

    def _start_once(self) -> RedisServer:
        if self.tls is None:
            listen = ["--port", str(self.port)]
        else:
            listen = [
                "--port", "0",
                "--tls-port", str(self.port),
                "--tls-cert-file", str(self.tls.server_cert),
                "--tls-key-file", str(self.tls.server_key),
                "--tls-ca-cert-file", str(self.tls.ca_cert),
                "--tls-auth-clients", "yes",
            ]  # fmt: skip
        args = [
            self.server_bin,
            *listen,
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            "--daemonize", "no",
            "--logfile", str(self.log_path),
        ]  # fmt: skip
        if self.cluster_node:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{self.port}.conf",
                "--cluster-node-timeout", "2000",
            ]  # fmt: skip
        args += self.extra_args
        self.process = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        self._wait_until_answering()
        return self

    def _wait_until_answering(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                log = self._log_tail()
                error = _PortTaken if "Address already in use" in log else RuntimeError
                raise error(
                    f"redis-server on port {self.port} exited with {self.process.returncode}: {log}"
                )
            try:
                with self.client() as probe:
                    if probe.ping():
                        return
            except redis.exceptions.AuthenticationError:
                return  # it answers: it wants a password (``--requirepass``)
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"redis-server on port {self.port} did not answer: {self._log_tail()}"
                )
            time.sleep(0.02)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text()[-2000:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait for it. Idempotent."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def kill(self) -> None:
        """Kill the server abruptly (SIGKILL), as a crash would."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)

    def restart(self) -> None:
        """Kill and start again on the same port (contents are lost: no persistence)."""
        self.kill()
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _PortTaken(RuntimeError):
    """The server could not bind its port: another process took it first."""


class RedisClusterServers:
    """Three ``redis-server --cluster-enabled yes`` nodes joined into one cluster (no replicas)."""

    def __init__(self, workdir: Path, nodes: int = CLUSTER_NODES) -> None:
        self.nodes = [RedisServer(workdir / f"node{i}", cluster_node=True) for i in range(nodes)]

    @property
    def url(self) -> str:
        """The url of one node: clients discover the others from it."""
        return self.nodes[0].url

    def start(self) -> RedisClusterServers:
        """Start the nodes, give each a third of the slots, and join them.

        This is what ``redis-cli --cluster create --cluster-replicas 0`` does,
        without its fixed one-second waits: ``CLUSTER ADDSLOTSRANGE`` on each
        node, ``CLUSTER MEET`` from the first, then wait for ``cluster_state:ok``.
        """
        for node in self.nodes:
            node.start()
        try:
            bounds = [round(i * 16384 / len(self.nodes)) for i in range(len(self.nodes) + 1)]
            for node, lo, hi in zip(self.nodes, bounds, bounds[1:], strict=False):
                with node.client() as raw:
                    raw.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi - 1)
            with self.nodes[0].client() as first:
                for node in self.nodes[1:]:
                    first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            self._wait_until_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_ok(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            states = []
            for node in self.nodes:
                with node.client() as probe:
                    info = probe.execute_command("CLUSTER", "INFO")
                if isinstance(info, dict):
                    text = "\n".join(f"{k}:{v}" for k, v in info.items())
                else:
                    text = info.decode() if isinstance(info, bytes) else str(info)
                known = f"cluster_known_nodes:{len(self.nodes)}" in text
                states.append("cluster_state:ok" in text and known)
            if all(states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the redis cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    def client(self) -> redis.RedisCluster:
        """A synchronous raw cluster client."""
        return redis.RedisCluster(
            host="127.0.0.1", port=self.nodes[0].port, socket_timeout=5, retry=Retry(NoBackoff(), 0)
        )

    def flush(self) -> None:
        for node in self.nodes:
            with node.client() as raw:
                raw.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh standalone redis-server for this test (empty, no persistence)."""
    with (
        tempfile.TemporaryDirectory(prefix="kvt-redis-") as workdir,
        RedisServer(Path(workdir)) as server,
    ):
        yield server


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Start servers with custom arguments, ``factory(extra_args=[...])``; all stopped after."""
    started: list[RedisServer] = []
    with tempfile.TemporaryDirectory(prefix="kvt-redis-") as workdir:

        def start(
            *, extra_args: Sequence[str] = (), port: int | None = None, tls: TlsFiles | None = None
        ) -> RedisServer:
            server = RedisServer(
                Path(workdir) / str(len(started)), port=port, extra_args=extra_args, tls=tls
            )
            started.append(server)
            return server.start()

        try:
            yield start
        finally:
            for server in started:
                server.stop()


class _Shared(Generic[S]):
    """One server (or cluster) for the whole session, however many modules import its fixture.

    pytest registers an imported fixture once per module, so a plain session
    fixture would start one per module; this counts the users instead.
    """

    def __init__(self, prefix: str, start: Callable[[Path], S]) -> None:
        self.prefix = prefix
        self.start = start
        self.server: S | None = None
        self.workdir: tempfile.TemporaryDirectory[str] | None = None
        self.users = 0

    def acquire(self) -> S:
        if self.server is None:
            self.workdir = tempfile.TemporaryDirectory(prefix=self.prefix)
            try:
                self.server = self.start(Path(self.workdir.name))
            except BaseException:
                self.workdir.cleanup()
                self.workdir = None
                raise
        self.users += 1
        return self.server

    def release(self) -> None:
        self.users -= 1
        if self.users == 0 and self.server is not None:
            self.server.stop()
            self.server = None
            if self.workdir is not None:
                self.workdir.cleanup()
                self.workdir = None


_shared_cluster = _Shared("kvt-redis-cluster-", lambda d: RedisClusterServers(d).start())
_shared_server = _Shared("kvt-redis-shared-", lambda d: RedisServer(d).start())


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """A 3-node Redis Cluster shared by the session (tests use their own namespaces)."""
    cluster = _shared_cluster.acquire()
    try:
        yield cluster
    finally:
        _shared_cluster.release()


@pytest.fixture(scope="session")
def shared_redis_server() -> Iterator[RedisServer]:
    """A standalone redis-server shared by the session, for tests that keep to a namespace of
    their own and need nothing of the server itself (a fault, TLS or restart test takes
    :func:`redis_server` instead: a fresh one)."""
    server = _shared_server.acquire()
    try:
        yield server
    finally:
        _shared_server.release()


@pytest.fixture(scope="session")
def tls_files() -> Iterator[TlsFiles]:
    """A CA with server and client certificates, made once per session."""
    with tempfile.TemporaryDirectory(prefix="kvt-redis-tls-") as workdir:
        yield make_tls_files(Path(workdir))


@pytest.fixture
def tls_redis_server(tls_files: TlsFiles) -> Iterator[RedisServer]:
    """A fresh redis-server that speaks only TLS and requires client certificates."""
    with (
        tempfile.TemporaryDirectory(prefix="kvt-redis-") as workdir,
        RedisServer(Path(workdir), tls=tls_files) as server,
    ):
        yield server
