"""The redis-server fixtures themselves: a port taken before the server binds it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.support import redis_server as support

pytestmark = pytest.mark.redis


def test_a_port_taken_by_another_process_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken, support.free_port()])
        monkeypatch.setattr(support, "free_port", lambda **_: next(ports))
        server = support.RedisServer(tmp_path)
        assert server.port == taken
        with server:
            assert server.port != taken
            with server.client() as raw:
                assert raw.ping()


def test_a_fixed_port_that_is_taken_fails_with_the_servers_reason(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        with pytest.raises(RuntimeError, match="Address already in use"):
            support.RedisServer(tmp_path, port=taken).start()
