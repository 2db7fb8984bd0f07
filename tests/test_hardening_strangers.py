"""Strangers cannot crowd out workers on /proto (issue 25, finding 1): sockets that never say who they
are are capped per client address and per process, and over a cap the oldest of them makes room for
the newcomer; refusals are logged once per address per interval.

The decision is a pure function (admission.plan_admission); the whole of it on a real `serve`: 200
strangers from ten loopback addresses reopening as soon as they are closed, and a real worker that
still gets its InitAck every time, from an address of its own and from one the strangers use."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import websockets

from gradient.workers.proto.admission import Admission, Stranger, plan_admission
from tests.support.processes import database_env, http_get, serve
from tests.support.proto import init_connection


def _s(key: str, address: str = "a", handshaking: bool = False) -> Stranger:
    return Stranger(key, address, handshaking)


def test_below_the_caps_a_socket_is_taken_and_nothing_closed() -> None:
    assert plan_admission([_s("1")], "a", total_cap=3, per_address_cap=2) == Admission(True, ())


def test_over_the_address_cap_the_addresses_oldest_makes_room() -> None:
    strangers = [_s("1", "a"), _s("2", "b"), _s("3", "a")]
    assert plan_admission(strangers, "a", total_cap=10, per_address_cap=2) == Admission(True, ("1",))
    assert plan_admission(strangers, "b", total_cap=10, per_address_cap=2) == Admission(True, ())


def test_over_the_total_cap_the_oldest_of_the_most_crowded_address_makes_room() -> None:
    strangers = [_s("1", "a"), _s("2", "b"), _s("3", "c")]
    assert plan_admission(strangers, "d", total_cap=3, per_address_cap=2) == Admission(True, ("1",))
    # A worker alone at its address ("w") is the last to go, however old.
    strangers = [_s("w", "w"), _s("2", "b"), _s("3", "b"), _s("4", "c")]
    assert plan_admission(strangers, "d", total_cap=4, per_address_cap=None) == Admission(True, ("2",))
    assert plan_admission(strangers, "d", total_cap=2, per_address_cap=None) == Admission(
        True, ("2", "w", "3")
    )
    # Both caps at once: the address's oldest goes for both.
    strangers = [_s("1", "a"), _s("2", "b"), _s("3", "b")]
    assert plan_admission(strangers, "b", total_cap=3, per_address_cap=2) == Admission(True, ("2",))


def test_a_pending_socket_is_never_closed_nor_counted_per_address_and_a_full_total_refuses() -> None:
    # "1" has sent its InitConnection (pending): the address has one silent socket, below its cap of 2.
    strangers = [_s("1", "a", handshaking=True), _s("2", "a")]
    assert plan_admission(strangers, "a", total_cap=10, per_address_cap=2) == Admission(True, ())
    strangers = [_s("1", "a", handshaking=True), _s("2", "a"), _s("3", "a")]
    assert plan_admission(strangers, "a", total_cap=10, per_address_cap=2) == Admission(True, ("2",))
    # Sixteen pending sockets of one address (a fleet behind one NAT) do not keep the seventeenth out.
    fleet = [_s(str(n), "a", handshaking=True) for n in range(16)]
    assert plan_admission(fleet, "a", total_cap=100, per_address_cap=16) == Admission(True, ())
    # The total counts pending sockets too: full of them, the newcomer is refused, nothing is closed.
    busy = [_s("1", "a", handshaking=True), _s("2", "a", handshaking=True)]
    assert plan_admission(busy, "b", total_cap=2, per_address_cap=2) == Admission(False, ())


def test_a_silent_socket_within_its_grace_is_closed_for_the_total_only_and_after_every_older_one() -> None:
    def at(key: str, address: str, since: float) -> Stranger:
        return Stranger(key, address, False, since)

    young = [at(str(n), "a", 8.0) for n in range(3)]
    # Over the address's cap, but every one may be a worker whose InitConnection is on its way: the
    # newcomer is taken and none is closed.
    assert plan_admission(young, "a", total_cap=10, per_address_cap=2, now=10.0, grace_secs=5.0) == (
        Admission(True, ())
    )
    # Those silent past the grace make room, oldest first, only as many as the cap needs.
    mixed = [at("old1", "a", 1.0), at("old2", "a", 2.0), *young]
    assert plan_admission(mixed, "a", total_cap=10, per_address_cap=2, now=10.0, grace_secs=5.0) == (
        Admission(True, ("old1", "old2"))
    )
    # Over the total the stale go first, even from a less crowded address; then the young.
    crowd = [*young, at("stale", "b", 1.0)]
    assert plan_admission(crowd, "c", total_cap=4, per_address_cap=None, now=10.0, grace_secs=5.0) == (
        Admission(True, ("stale",))
    )
    assert plan_admission(crowd, "c", total_cap=3, per_address_cap=None, now=10.0, grace_secs=5.0) == (
        Admission(True, ("stale", "0"))
    )


def test_an_address_without_its_own_cap_is_capped_in_total_only() -> None:
    strangers = [_s("1", "p"), _s("2", "p"), _s("3", "p")]
    assert plan_admission(strangers, "p", total_cap=10, per_address_cap=None) == Admission(True, ())


# --- On a real serve -------------------------------------------------------------------------------

STRANGER_ADDRESSES = [f"127.0.0.{n}" for n in range(10, 20)]
PER_ADDRESS = 20
FLOOD_SECS = 12.0


async def _stranger(url: str, address: str, stop: asyncio.Event, opened: list[int]) -> None:
    """Open a socket, say nothing, and open another as soon as it is closed (or refused)."""
    while not stop.is_set():
        try:
            async with websockets.connect(
                url, open_timeout=10, close_timeout=1, ping_interval=None, local_addr=(address, 0)
            ) as ws:
                opened[0] += 1
                with contextlib.suppress(Exception):
                    while not stop.is_set():
                        await asyncio.wait_for(ws.recv(), 0.5)
        except Exception:  # noqa: BLE001 (refused or closed: open the next one)
            await asyncio.sleep(0.02)


async def _worker_in(url: str, worker_id: str, token: str, address: str) -> int:
    """Open sockets from `address` until one gets its InitAck; returns how many it took (a worker
    retries a refusal; gives up after 20)."""
    for attempt in range(1, 21):
        try:
            async with websockets.connect(
                url, open_timeout=5, close_timeout=1, local_addr=(address, 0)
            ) as ws:
                await ws.send(json.dumps(init_connection(worker_id, token)))
                frame = json.loads(await asyncio.wait_for(ws.recv(), 5))
                if frame["type"] == "InitAck":
                    return attempt
        except Exception:  # noqa: BLE001 (refused or closed: a worker retries)
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"the worker did not get in from {address} in 20 attempts")


async def _flood_and_workers(url: str, worker_id: str, token: str) -> tuple[dict[str, list[int]], int]:
    stop = asyncio.Event()
    opened = [0]
    strangers = [
        asyncio.create_task(_stranger(url, address, stop, opened))
        for address in STRANGER_ADDRESSES
        for _ in range(PER_ADDRESS)
    ]
    await asyncio.sleep(3)  # the strangers have filled every slot
    attempts: dict[str, list[int]] = {"127.0.0.1": [], STRANGER_ADDRESSES[0]: []}
    started = time.monotonic()
    while time.monotonic() - started < FLOOD_SECS - 3:
        for address, tries in attempts.items():
            tries.append(await _worker_in(url, worker_id, token, address))
            await asyncio.sleep(0.5)  # its session is closed before the next try
    stop.set()
    await asyncio.gather(*strangers, return_exceptions=True)
    return attempts, opened[0]


@pytest.mark.django_db(transaction=True)
def test_a_worker_gets_in_at_once_however_many_strangers_keep_reopening(
    tmp_path: Path, make_worker: Any
) -> None:
    worker, token = make_worker()
    env = database_env(
        redis=False,
        GRADIENT_PROTO_MAX_UNAUTHENTICATED="64",
        GRADIENT_PROTO_MAX_UNAUTHENTICATED_PER_ADDRESS="8",
    )
    with serve(env, tmp_path, ["--no-passes"]) as server:
        attempts, opened = asyncio.run(_flood_and_workers(server.ws_url, str(worker.id), token))
        assert http_get(f"{server.base_url}/healthz")[0] == 200
        log = server.log()
    assert opened > len(STRANGER_ADDRESSES) * PER_ADDRESS, opened  # they did keep reopening
    # From an address of its own, the worker is in at its first try every time; from one it shares with
    # strangers, it gets in too (its socket goes only once eight newer ones of that address came first).
    assert len(attempts["127.0.0.1"]) >= 2 and set(attempts["127.0.0.1"]) == {1}, attempts
    assert "Traceback" not in log, log[log.find("Traceback") - 300 :][:3000]
    # One line per address per 10 s for the refusals and the sockets closed to make room.
    lines = log.count("without a handshake to make room") + log.count("have not completed the handshake")
    assert 1 <= lines <= (len(STRANGER_ADDRESSES) + 1) * (FLOOD_SECS // 10 + 2), lines


# --- A fleet behind one address, and silent sockets from it (issue 35, item 6) ------------------------

FLEET = 300
FLEET_ADDRESS = "127.0.0.1"
SILENT_ADDRESS = "127.0.0.7"


class _Refused(Exception):
    """What a worker retries: HTTP 503 before the upgrade (too many open connections of the address), a
    refused upgrade, or Reject{503}."""


async def _fleet_worker(
    url: str, worker_id: str, token: str, all_in: asyncio.Event, seen: Counter[str]
) -> None:
    """Connect as a worker behind FLEET_ADDRESS does, retrying what it retries; once in, hold the session
    until the whole fleet is in. A final refusal (any other Reject) raises, and lets the others go."""
    try:
        for _ in range(50):
            try:
                async with websockets.connect(
                    url, open_timeout=60, close_timeout=1, ping_interval=None, local_addr=(FLEET_ADDRESS, 0)
                ) as ws:
                    await ws.send(json.dumps(init_connection(worker_id, token)))
                    frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
                    seen[f"{frame['type']} {frame.get('code', '')}".strip()] += 1
                    if frame["type"] == "InitAck":
                        if seen["InitAck"] == FLEET:
                            all_in.set()
                        await all_in.wait()
                        return
                    if frame.get("code") != 503:
                        raise AssertionError(f"a final refusal: {frame}")
            except websockets.InvalidStatus as exc:
                seen[f"HTTP {exc.response.status_code}"] += 1
            await asyncio.sleep(random.uniform(0.1, 0.5))  # noqa: S311 (a worker's jitter, not security)
        raise AssertionError(f"worker {worker_id} did not get in: {seen}")
    except BaseException:
        all_in.set()
        raise


async def _fleet(url: str, credentials: list[tuple[str, str]]) -> Counter[str]:
    all_in = asyncio.Event()
    seen: Counter[str] = Counter()
    await asyncio.gather(*(_fleet_worker(url, w, t, all_in, seen) for w, t in credentials))
    return seen


@pytest.mark.django_db(transaction=True)
def test_a_fleet_of_300_workers_behind_one_address_all_get_in_with_the_default_caps(
    tmp_path: Path, make_worker: Any
) -> None:
    credentials = [make_worker() for _ in range(FLEET)]
    with serve(database_env(redis=False), tmp_path, ["--no-passes"]) as server:
        seen = asyncio.run(_fleet(server.ws_url, [(str(w.id), t) for w, t in credentials]))
        log = server.log()
    assert seen["InitAck"] == FLEET, seen
    # No worker's socket was closed to make room: each had sent its InitConnection, however long the
    # busy server took to read it (before: the 17th socket of the address closed the oldest, with 400).
    assert not [k for k in seen if k.startswith("Reject")], seen
    assert "without a handshake to make room" not in log
    assert "Traceback" not in log, log[log.find("Traceback") - 300 :][:3000]


async def _silent_and_a_worker(url: str, worker_id: str, token: str, grace: float) -> tuple[int, int, int]:
    """300 silent sockets from SILENT_ADDRESS (each retried until the server took it), then, once they
    are past the grace, a worker from the same address. Returns (opened, still open when the worker got
    in, the worker's attempts)."""
    sockets: list[Any] = []

    async def open_one() -> None:
        for _ in range(50):
            try:
                sockets.append(
                    await websockets.connect(
                        url,
                        open_timeout=30,
                        close_timeout=1,
                        ping_interval=None,
                        local_addr=(SILENT_ADDRESS, 0),
                    )
                )
                return
            except websockets.InvalidStatus:
                await asyncio.sleep(0.2)

    await asyncio.gather(*(open_one() for _ in range(FLEET)))
    await asyncio.sleep(grace + 1)
    try:
        attempts = await _worker_in(url, worker_id, token, SILENT_ADDRESS)
        await asyncio.sleep(0.5)  # the closes the worker's socket caused have reached the silent ones
        still_open = 0
        for ws in sockets:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ws.recv(), 0.01)
            still_open += ws.close_code is None
        return len(sockets), still_open, attempts
    finally:
        await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)


@pytest.mark.django_db(transaction=True)
def test_300_silent_sockets_of_one_address_cannot_keep_a_worker_of_that_address_out(
    tmp_path: Path, make_worker: Any
) -> None:
    from django.conf import settings

    worker, token = make_worker()
    with serve(database_env(redis=False), tmp_path, ["--no-passes"]) as server:
        opened, still_open, attempts = asyncio.run(
            _silent_and_a_worker(
                server.ws_url, str(worker.id), token, settings.GRADIENT_PROTO_SILENT_GRACE_SECS
            )
        )
        log = server.log()
    assert opened == FLEET
    assert attempts == 1
    # The address's silent sockets past the grace made room: no more than its cap are left.
    assert still_open <= settings.GRADIENT_PROTO_MAX_UNAUTHENTICATED_PER_ADDRESS, still_open
    assert "without a handshake to make room" in log


# --- Their log lines are sampled (issue 36, finding 10) ---------------------------------------------------

SAMPLED_ADDRESS = "127.0.0.9"


async def _silent_sockets(url: str, n: int, wait: float) -> int:
    """n sockets from SAMPLED_ADDRESS that say nothing for `wait` seconds (the handshake time-out closes
    them); returns how many were taken."""

    async def one() -> bool:
        try:
            async with websockets.connect(
                url, open_timeout=30, close_timeout=1, ping_interval=None, local_addr=(SAMPLED_ADDRESS, 0)
            ) as ws:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(ws.recv(), wait)
                return True
        except websockets.InvalidStatus:
            return False

    return sum(await asyncio.gather(*(one() for _ in range(n))))


@pytest.mark.django_db(transaction=True)
def test_a_hundred_silent_sockets_of_one_address_write_a_few_lines_not_hundreds(tmp_path: Path) -> None:
    env = database_env(redis=False, GRADIENT_PROTO_HANDSHAKE_TIMEOUT_SECS="1")
    with serve(env, tmp_path, ["--no-passes"]) as server:
        taken = asyncio.run(_silent_sockets(server.ws_url, 100, 3.0))
        log = server.log()
    assert taken >= 50, taken
    access = [line for line in log.splitlines() if SAMPLED_ADDRESS in line and '"WebSocket /proto"' in line]
    timeouts = [
        line for line in log.splitlines() if SAMPLED_ADDRESS in line and "no InitConnection within" in line
    ]
    # One line per address per 10 s each (the run lasts a few seconds): 2 at most, not one per socket.
    assert 1 <= len(access) <= 2 and 1 <= len(timeouts) <= 2, (access, timeouts)


@pytest.mark.django_db(transaction=True)
async def test_a_socket_refused_for_load_is_an_http_503_to_retry_never_a_final_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every unauthenticated socket of the process pending (admission refuses the newcomer): the answer
    before the upgrade is HTTP 503 with Retry-After ("busy: try again", protocol.md), where it was the
    close's HTTP 403, which a worker other than the reference one may take as final (issue 36)."""
    from channels.testing import ApplicationCommunicator

    from gradient.asgi import application
    from gradient.workers.proto import admission

    async def refuse(consumer: Any, address: str) -> bool:
        return False

    monkeypatch.setattr(admission, "admit", refuse)
    scope = {
        "type": "websocket",
        "path": "/proto",
        "raw_path": b"/proto",
        "query_string": b"",
        "headers": [(b"host", b"testserver")],
        "subprotocols": [],
        "client": ("10.0.0.9", 40000),
        "server": ("testserver", 80),
        "extensions": {"websocket.http.response": {}},
    }
    socket = ApplicationCommunicator(application, scope)
    await socket.send_input({"type": "websocket.connect"})
    start = await socket.receive_output(5)
    body = await socket.receive_output(5)
    assert start["type"] == "websocket.http.response.start" and start["status"] == 503
    assert (b"retry-after", b"1") in start["headers"]
    assert body["type"] == "websocket.http.response.body" and b"try again" in body["body"]
    await socket.send_input({"type": "websocket.disconnect", "code": 1006})
    await socket.wait(5)


def _line(logger: str, message: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(logger, logging.INFO, __file__, 0, message, args, None)


def test_a_refused_strangers_access_line_is_one_per_address_per_interval_and_a_bad_token_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The filter itself, on the lines of the run that wrote 25 600 of them: uvicorn's access line of a
    socket refused before the upgrade (403) or taken, and the time-out of one that never said who it is,
    are one per address per 10 s, the next saying how many were left out; a refused token, a worker's
    session and any other line are each written."""
    from types import SimpleNamespace

    from gradient import http_protocol

    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(http_protocol, "time", SimpleNamespace(monotonic=lambda: clock.now))
    sampled = http_protocol.SocketLinesSampled()

    def written(records: list[logging.LogRecord]) -> list[str]:
        return [r.getMessage() for r in records if sampled.filter(r)]

    refused = [
        _line("uvicorn.error", '%s - "WebSocket %s" 403', f"10.0.0.1:{p}", "/proto") for p in range(50)
    ]
    taken = [
        _line("uvicorn.error", '%s - "WebSocket %s" [accepted]', f"10.0.0.1:{p}", "/proto") for p in range(9)
    ]
    elsewhere = _line("uvicorn.error", '%s - "WebSocket %s" 403', "10.0.0.2:7", "/proto")
    silent = "handshake from %s rejected (%s): %s"
    timed_out = [
        _line("gradient.workers", silent, f"10.0.0.1:{p}", 400, "no InitConnection within 10 s")
        for p in range(30)
    ]
    bad_token = [_line("gradient.workers", silent, f"10.0.0.1:{p}", 401, "bad token") for p in range(3)]
    worker = _line("gradient.workers", "worker %s connected", "w1")

    lines = written([*refused, *taken, elsewhere, *timed_out, *bad_token, worker])
    assert lines == [
        '10.0.0.1:0 - "WebSocket /proto" 403',
        '10.0.0.2:7 - "WebSocket /proto" 403',
        "handshake from 10.0.0.1:0 rejected (400): no InitConnection within 10 s",
        *(f"handshake from 10.0.0.1:{p} rejected (401): bad token" for p in range(3)),
        "worker w1 connected",
    ]
    clock.now += 10.0
    again = [_line("uvicorn.error", '%s - "WebSocket %s" 403', "10.0.0.1:99", "/proto")]
    assert written(again) == [
        '10.0.0.1:99 - "WebSocket /proto" 403 (58 more like it from this address since the last line)'
    ]


GARBAGE_ADDRESS = "127.0.0.11"


async def _garbage_requests(port: int, n: int) -> None:
    """n connections from GARBAGE_ADDRESS, half of them sending bytes that are no HTTP, half an upgrade to
    something other than a WebSocket; each read until the server closes or answers."""

    async def one(i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(GARBAGE_ADDRESS, 0))
        if i % 2:
            writer.write(b"\x16\x03\x01 not HTTP at all\r\n\r\n")
        else:
            writer.write(
                b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: upgrade, close\r\nUpgrade: h2c\r\n\r\n"
            )
        await writer.drain()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(reader.read(), 5)
        writer.close()

    for start in range(0, n, 20):  # under the address's cap of open connections
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + 20))))


@pytest.mark.django_db(transaction=True)
def test_a_hundred_requests_that_are_no_http_write_a_few_warnings_not_hundreds(tmp_path: Path) -> None:
    """uvicorn's WARNING for bytes that are no HTTP, and for an upgrade to anything but a WebSocket, has
    no address to key on: one line per 10 s for all of them, with the count left out (issue 36, finding
    10: a stranger's every connection wrote a line)."""
    with serve(database_env(redis=False), tmp_path, ["--no-passes"]) as server:
        asyncio.run(_garbage_requests(server.port, 100))
        status, _ = http_get(f"{server.base_url}/healthz")
        log = server.log()
    assert status == 200
    invalid = [line for line in log.splitlines() if "Invalid HTTP request received" in line]
    unsupported = [line for line in log.splitlines() if "Unsupported upgrade request" in line]
    assert 1 <= len(invalid) <= 2 and 1 <= len(unsupported) <= 2, (len(invalid), len(unsupported))
    # Each of the 50 of a kind is a line or counted in a later one.
    for lines in (invalid, unsupported):
        left_out = sum(
            int(n) for n in re.findall(r"\((\d+) more like it since the last line\)", "".join(lines))
        )
        assert len(lines) + left_out <= 50, lines
