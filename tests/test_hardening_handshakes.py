"""Refused handshakes are cheap (issue 17, findings 9 and 6): a flood of bad tokens, half of whose
sockets leave before their Reject, logs INFO lines and no traceback in a real `serve`; sockets that
never say who they are are capped per process (more are refused before the upgrade) and timed out."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import websockets
from channels.db import database_sync_to_async
from django.test import override_settings

from tests.support.processes import database_env, http_get, serve
from tests.support.proto import TIMEOUT, communicator, expect_refusal, finish, init_connection

pytestmark = pytest.mark.django_db(transaction=True)


async def _bad_handshake(url: str, worker_id: str, leave_early: bool) -> str:
    try:
        async with websockets.connect(url, open_timeout=30, close_timeout=1) as ws:
            await ws.send(json.dumps(init_connection(worker_id, "not-the-token")))
            if leave_early:
                return "left"
            return str(json.loads(await asyncio.wait_for(ws.recv(), 30)).get("code"))
    except Exception as exc:  # noqa: BLE001 (counted, not raised)
        return type(exc).__name__


async def _flood(url: str, worker_id: str, n: int) -> Counter[str]:
    results = await asyncio.gather(*(_bad_handshake(url, worker_id, i % 2 == 0) for i in range(n)))
    return Counter(results)


def test_a_flood_of_bad_tokens_logs_no_traceback_and_serve_stays_healthy(
    tmp_path: Path, make_worker: Any
) -> None:
    worker, _token = make_worker()
    # Every one reaches its Reject: 400 sockets of one address stand for as many clients here.
    env = database_env(
        GRADIENT_PROTO_MAX_UNAUTHENTICATED="1000",
        GRADIENT_PROTO_MAX_UNAUTHENTICATED_PER_ADDRESS="0",
        GRADIENT_HTTP_MAX_CONNECTIONS_PER_ADDRESS="0",
    )
    with serve(env, tmp_path, ["--no-passes"]) as server:
        results = asyncio.run(_flood(server.ws_url, str(worker.id), 400))
        assert results["401"] == 200 and results["left"] == 200, results
        assert http_get(f"{server.base_url}/healthz")[0] == 200
        log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[log.find("Traceback") - 200 :][:3000]
    assert log.count("rejected (401): bad token") >= 200


async def test_sockets_that_have_not_completed_the_handshake_are_capped_per_process_the_oldest_go_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with override_settings(GRADIENT_PROTO_MAX_UNAUTHENTICATED=3):
        idle = [communicator() for _ in range(3)]
        for comm in idle:
            assert (await comm.connect(timeout=TIMEOUT))[0]
        newer = communicator()
        assert (await newer.connect(timeout=TIMEOUT))[0]  # taken: the oldest makes room
        reject, code = await expect_refusal(idle[0], "Reject")
        # 503: "busy or making room, try again" (protocol.md); a 400 would be final for a worker.
        assert (reject["code"], code) == (503, 4503) and "room" in reject["reason"]
        for comm in [*idle[1:], newer]:
            assert await comm.receive_nothing(timeout=0.2)
            await comm.disconnect(timeout=TIMEOUT)
        await idle[0].disconnect(timeout=TIMEOUT)
    assert any("without a handshake to make room" in r.getMessage() for r in caplog.records)


async def test_a_socket_that_sends_nothing_is_refused_after_the_handshake_time_out_seconds() -> None:
    from django.conf import settings

    from gradient.workers.proto import consumer

    assert consumer.HANDSHAKE_TIMEOUT_SECS == settings.GRADIENT_PROTO_HANDSHAKE_TIMEOUT_SECS <= 10


async def test_a_refused_handshake_is_one_info_line(
    make_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    worker, token = await database_sync_to_async(make_worker)()
    comm = communicator()
    await comm.connect(timeout=TIMEOUT)
    await comm.send_json_to(init_connection(str(worker.id), token + "x"))
    reject, code = await expect_refusal(comm, "Reject")
    await finish(comm)
    assert (reject["code"], code) == (401, 4401)
    gradient = [r for r in caplog.records if r.name.startswith("gradient")]
    assert [(r.levelno, r.exc_info) for r in gradient if "rejected" in r.getMessage()] == [
        (logging.INFO, None)
    ]
    assert not [r for r in gradient if r.levelno >= logging.WARNING]
