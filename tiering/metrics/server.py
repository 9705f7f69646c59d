"""The live Prometheus endpoint: one HTTP server thread per process and port.

:func:`serve_metrics` starts ``prometheus_client``'s HTTP server on a daemon
thread, serving the process-wide registry, where every
:class:`~tiering.manager.TieringOffloadingManager` exports its ``kv_tiering_*``
series by default (see :mod:`tiering.metrics`). It is what the
``metrics_port`` option and ``tiering replay --metrics-port`` call, and it
works inside a vLLM engine process: the server is started once per process
and port, so a second spec, manager or call with the same port gets the
running server back. A port another process (or another exporter in this
one) holds raises :class:`~tiering.core.errors.ConfigError` naming the port. The
servers live until the process exits; :func:`stop_metrics_server` stops one
early (tests).
"""

from __future__ import annotations

import errno
import threading
from dataclasses import dataclass
from typing import Any

from tiering.core.errors import ConfigError
from tiering.metrics import metrics_available, prometheus_client

#: Address the endpoint listens on unless told otherwise: every interface, as
#: Prometheus scrapes from another host (``metrics_host`` narrows it).
DEFAULT_METRICS_HOST = "0.0.0.0"


@dataclass(frozen=True)
class MetricsServer:
    """A running endpoint: scrape ``http://{host}:{port}/metrics``.

    ``port`` is the bound port (the one the OS chose when 0 was asked).
    """

    host: str
    port: int
    requested_port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/metrics"


_lock = threading.Lock()  # guards _servers: specs may be built on several threads
_servers: dict[int, MetricsServer] = {}  # by requested port (0: the ephemeral one)


def check_metrics_port(port: object, key: str = "metrics_port") -> int:
    """``port`` as an int in [0, 65535] (0: any free port), or ConfigError naming ``key``."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(
            f"{key} must be a port number in 0..65535 (0: any free port), got {port!r}"
        )
    if not metrics_available():
        raise ConfigError(
            f"{key} needs prometheus_client, which is not installed: install the "
            "'metrics' extra (pip install prometheus_client)"
        )
    return port


def serve_metrics(port: int, host: str = DEFAULT_METRICS_HOST) -> MetricsServer:
    """Serve this process's ``kv_tiering_*`` series on ``host:port``; idempotent per port.

    Returns the running server (the same one for the same port). Raises
    :class:`~tiering.core.errors.ConfigError` when the port is taken, naming it,
    or when the same port was already served on another host.
    """
    port = check_metrics_port(port)
    with _lock:
        running = _servers.get(port)
        if running is not None:
            if running.host != host:
                raise ConfigError(
                    f"metrics_port {port} is already served on {running.host!r} in this "
                    f"process; cannot serve it on {host!r} too"
                )
            return running
        try:
            server, thread = prometheus_client.start_http_server(port, addr=host)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"metrics_port {port}: the port is already in use on {host!r} (another "
                    "process or exporter holds it); choose another port, or 0 for any free one"
                ) from None
            raise ConfigError(f"metrics_port {port}: cannot listen on {host!r}: {exc}") from exc
        started = MetricsServer(host, server.server_address[1], port, server, thread)
        _servers[port] = started
        return started


def running_metrics_server(port: int) -> MetricsServer | None:
    """The server :func:`serve_metrics` started for ``port`` in this process, if any."""
    with _lock:
        return _servers.get(port)


def stop_metrics_server(server: MetricsServer) -> None:
    """Stop ``server`` and forget it (idempotent); a later :func:`serve_metrics` starts anew."""
    with _lock:
        if _servers.get(server.requested_port) is server:
            del _servers[server.requested_port]
    server._server.shutdown()
    server._server.server_close()
    server._thread.join(timeout=5.0)
