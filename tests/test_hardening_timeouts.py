"""Idle and slow connections are timed out (issue 17, finding 6): a real `serve` closes a TCP connection
that has sent nothing, or only part of a request's headers, within GRADIENT_HTTP_REQUEST_TIMEOUT_SECS,
and keeps answering /healthz meanwhile. (The /proto handshake time-out and the cap on unauthenticated
sockets are in test_hardening_handshakes.py.)"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from tests.support.processes import database_env, http_get, serve

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT_SECS = 2


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_connections_that_do_not_complete_a_request_are_closed_in_seconds(tmp_path: Path) -> None:
    env = database_env(redis=False, GRADIENT_HTTP_REQUEST_TIMEOUT_SECS=str(TIMEOUT_SECS))
    with serve(env, tmp_path, ["--no-passes"]) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(40)]
        slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(10)]
        for sock in slow:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
        try:
            assert http_get(f"{server.base_url}/healthz")[0] == 200
            started = time.monotonic()
            closed = [
                _closed_by_server(sock, max(0.1, TIMEOUT_SECS + 5 - (time.monotonic() - started)))
                for sock in idle + slow
            ]
            assert all(closed), f"{closed.count(False)} of {len(closed)} connections still open"
            # A connection that completes its request in time is served as before.
            with socket.create_connection(("127.0.0.1", server.port)) as ok:
                ok.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                assert ok.recv(64).startswith(b"HTTP/1.1 200")
        finally:
            for sock in idle + slow:
                sock.close()
