"""Helpers for tests that speak the worker protocol to the full ASGI application."""

from __future__ import annotations

import json
from typing import Any

from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connection

from gradient.asgi import application

# Every table a protocol frame could write to: a refused frame must leave all of them as they were.
SNAPSHOT_TABLES = (
    "worker",
    "worker_project",
    "worker_session",
    "idle_slot",
    "sent_candidate",
    "candidate_score",
    "project",
    "evaluation",
    "derivation_build",
    "build_attempt",
    "dispatched_job",
    "cluster_job",
    "cluster_attempt",
)

TIMEOUT = 5.0


# A build worker's capabilities after its handshake (two x86_64-linux slots), as the tests send them.
CAPABILITIES: dict[str, Any] = {
    "type": "WorkerCapabilities",
    "architectures": ["x86_64-linux"],
    "system_features": [],
    "max_concurrent_builds": 2,
    "cpu_count": 4,
    "ram_total_mb": 8192,
    "cpu_core_score": 800,
    "zone": None,
    "endpoint": None,
}


def snapshot_sync(exclude_session_close: bool = False) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the protocol's tables. With exclude_session_close, worker_session's closed_at and
    close_reason are left out (a socket that is closed ends its session; that is not the frame's write)."""
    result: dict[str, list[tuple[Any, ...]]] = {}
    with connection.cursor() as cursor:
        for table in SNAPSHOT_TABLES:
            if table == "worker_session" and exclude_session_close:
                cursor.execute(
                    "SELECT id, worker_id, channel_name, server_boot, draining, opened_at, last_seen "
                    "FROM worker_session ORDER BY id"
                )
            else:
                cursor.execute(f"SELECT * FROM {table} ORDER BY 1")  # noqa: S608 (fixed names)
            result[table] = [tuple(row) for row in cursor.fetchall()]
    return result


snapshot = database_sync_to_async(snapshot_sync)


def communicator() -> WebsocketCommunicator:
    return WebsocketCommunicator(application, "/proto")


def init_connection(
    worker_id: str,
    token: str,
    *,
    protocol: int = 1,
    fetch: bool = True,
    eval: bool = True,
    build: bool = True,
) -> dict[str, Any]:
    return {
        "type": "InitConnection",
        "worker_id": worker_id,
        "token": token,
        "capabilities": {"fetch": fetch, "eval": eval, "build": build},
        "protocol": protocol,
    }


async def open_socket() -> WebsocketCommunicator:
    comm = communicator()
    connected, _ = await comm.connect(timeout=TIMEOUT)
    assert connected
    return comm


async def handshake(
    worker_id: str, token: str, **kwargs: Any
) -> tuple[WebsocketCommunicator, dict[str, Any]]:
    """A connected socket past InitAck."""
    comm = await open_socket()
    await comm.send_json_to(init_connection(worker_id, token, **kwargs))
    ack = await comm.receive_json_from(timeout=TIMEOUT)
    assert ack["type"] == "InitAck", ack
    return comm, ack


async def assigned(comm: WebsocketCommunicator, kind: str) -> dict[str, Any]:
    """Send RequestJob of `kind` and return the AssignJob that answers it (offers on the way are
    passed over; any other frame fails the test)."""
    await comm.send_json_to({"type": "RequestJob", "kind": kind})
    while True:
        frame = await comm.receive_json_from(timeout=TIMEOUT)
        if frame["type"] == "AssignJob":
            return frame
        assert frame["type"] in ("JobOffer", "JobListChunk"), frame


async def expect_close(comm: WebsocketCommunicator) -> int:
    """The next output must be the close; returns its code."""
    output = await comm.receive_output(timeout=TIMEOUT)
    assert output["type"] == "websocket.close", output
    return int(output.get("code", 1000))


async def expect_refusal(comm: WebsocketCommunicator, frame_type: str) -> tuple[dict[str, Any], int]:
    """A frame of `frame_type` (Error or Reject), then the close; returns both."""
    frame = json.loads(await comm.receive_from(timeout=TIMEOUT))
    assert frame["type"] == frame_type, frame
    code = await expect_close(comm)
    return frame, code


async def finish(comm: WebsocketCommunicator) -> None:
    """Deliver the disconnect to the consumer and wait until it has run."""
    await comm.disconnect(timeout=TIMEOUT)
