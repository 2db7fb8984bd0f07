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


def _post_headers(length: int) -> bytes:
    return (
        b"POST /api/v1/auth/token HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(length).encode() + b"\r\n\r\n"
    )


def test_a_body_that_trickles_is_cut_off_at_the_whole_request_time_out(tmp_path: Path) -> None:
    """Issue 25, finding 2: one body byte every second kept a connection open for ever."""
    env = database_env(
        redis=False,
        GRADIENT_HTTP_REQUEST_TIMEOUT_SECS="10",
        GRADIENT_HTTP_BODY_TIMEOUT_SECS=str(TIMEOUT_SECS + 1),
        GRADIENT_API_THROTTLE_ANON="",
    )
    with serve(env, tmp_path, ["--no-passes"]) as server:
        slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
        try:
            for sock in slow:
                sock.sendall(_post_headers(1000) + b"{")
            started = time.monotonic()
            open_after: list[socket.socket] = list(slow)
            while open_after and time.monotonic() - started < TIMEOUT_SECS + 8:
                for sock in list(open_after):
                    try:
                        sock.sendall(b" ")
                        if _closed_by_server(sock, 0.05):
                            open_after.remove(sock)
                    except (BrokenPipeError, ConnectionResetError):
                        open_after.remove(sock)
                time.sleep(0.5)
            assert not open_after, f"{len(open_after)} of {len(slow)} trickling connections still open"
            # A body that is sent in time is read as before (401: bad credentials, not a time-out).
            with socket.create_connection(("127.0.0.1", server.port)) as ok:
                body = b'{"username": "x", "password": "y"}'
                ok.sendall(_post_headers(len(body)) + body)
                assert ok.recv(64).startswith(b"HTTP/1.1 401")
            assert http_get(f"{server.base_url}/healthz")[0] == 200
        finally:
            for sock in slow:
                sock.close()
        log = server.log()
    assert "Traceback" not in log, log[log.find("Traceback") - 300 :][:3000]
    lines = log.count("its request was not complete within")
    assert 1 <= lines <= 3, log[-3000:]  # one line per address per 10 s, not one per connection


def test_open_connections_are_capped_per_address_and_another_address_is_served(tmp_path: Path) -> None:
    """Issue 25, finding 2: 1 100 connections from one address made every other client fail."""
    cap = 20
    env = database_env(redis=False, GRADIENT_HTTP_MAX_CONNECTIONS_PER_ADDRESS=str(cap))
    with serve(env, tmp_path, ["--no-passes"]) as server:
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(cap)]
        try:
            time.sleep(0.5)  # every one accepted by the server
            with socket.create_connection(("127.0.0.1", server.port)) as refused:
                refused.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                refused.settimeout(5)
                assert refused.recv(64).startswith(b"HTTP/1.1 503")
            # Another client address is not held back (Linux answers on all of 127.0.0.0/8).
            with socket.create_connection(
                ("127.0.0.1", server.port), source_address=("127.0.0.2", 0)
            ) as other:
                other.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                other.settimeout(5)
                assert other.recv(64).startswith(b"HTTP/1.1 200")
            held.pop().close()
            time.sleep(0.5)
            assert http_get(f"{server.base_url}/healthz")[0] == 200
        finally:
            for sock in held:
                sock.close()
        log = server.log()
    assert log.count("refused a connection from 127.0.0.1") == 1, log[-3000:]
