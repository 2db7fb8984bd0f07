"""BuildLog over /proto on the full ASGI application: a log sent in pieces is readable over REST while the
build runs and complete afterwards; a repeat is stored once, a gap marked; a stale or foreign piece
changes nothing and is answered with nothing; an oversized piece is Error{400}, close 4400, and writes
nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from rest_framework.authtoken.models import Token

from gradient.core.protocol import MAX_LOG_PIECE_BYTES
from gradient.scheduling.decisions.logs import missing_line
from gradient.scheduling.models import BuildLog, BuildLogChunk, BuildStatus, DerivationBuild, EvaluationStatus
from gradient.scheduling.services import graph
from tests.factories import EvaluationFactory, ProjectFactory
from tests.scheduling_helpers import drv
from tests.support.proto import CAPABILITIES, TIMEOUT, assigned, expect_refusal, finish, handshake, snapshot

pytestmark = pytest.mark.django_db(transaction=True)


@database_sync_to_async
def _setup(make_worker: Any) -> tuple[str, str, str]:
    project = ProjectFactory(name="p")
    worker, token = make_worker(projects=("p",))
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("solo")], now=timezone.now())
    build = DerivationBuild.objects.get()
    assert build.status == BuildStatus.QUEUED
    staff = User.objects.create_user("reader", password="pw-reader-1", is_staff=True)
    return str(worker.id), token, Token.objects.create(user=staff).key


async def _assigned_build(comm: WebsocketCommunicator) -> dict[str, Any]:
    await comm.send_json_to(CAPABILITIES)
    frame = await assigned(comm, "build")
    ids = {"job_id": frame["job_id"], "assignment_id": frame["assignment_id"]}
    await comm.send_json_to({"type": "AssignJobResponse", **ids, "accepted": True, "reason": None})
    return frame


def _piece(assign: dict[str, Any], offset: int, data: str, **fields: Any) -> dict[str, Any]:
    return {
        "type": "BuildLog",
        "job_id": assign["job_id"],
        "assignment_id": assign["assignment_id"],
        "build_id": assign["job"]["builds"][0]["build_id"],
        "offset": offset,
        "data": data,
        **fields,
    }


async def _settle(comm: WebsocketCommunicator) -> None:
    """Every frame sent before has been handled: RequestJobList is answered in order."""
    await comm.send_json_to({"type": "RequestJobList"})
    while True:
        frame = await comm.receive_json_from(timeout=TIMEOUT)
        assert frame["type"] in ("JobListChunk", "JobOffer"), frame  # never an answer to a BuildLog
        if frame["type"] == "JobListChunk" and frame["is_final"]:
            return


@database_sync_to_async
def _get_log(token: str, build_id: str, query: str = "") -> tuple[int, str, dict[str, str]]:
    response = Client().get(f"/api/v1/builds/{build_id}/log{query}", HTTP_AUTHORIZATION=f"Token {token}")
    headers = {k: v for k, v in response.items() if k in ("X-Log-Offset", "X-Log-Complete")}
    return response.status_code, response.content.decode(), headers


@database_sync_to_async
def _log_rows() -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    return (
        list(BuildLog.objects.order_by("id").values_list("id", "received", "length", "size_bytes", "cut")),
        list(BuildLogChunk.objects.order_by("id").values_list("id", "start", "data")),
    )


async def test_a_log_sent_in_pieces_is_readable_while_the_build_runs_and_complete_afterwards(
    make_worker: Any,
) -> None:
    worker_id, token, rest_token = await _setup(make_worker)
    comm, _ = await handshake(worker_id, token)
    assign = await _assigned_build(comm)
    build_id = assign["job"]["builds"][0]["build_id"]

    await comm.send_json_to(_piece(assign, 0, "unpacking sources\n"))
    await comm.send_json_to(_piece(assign, 18, "compiling\n"))
    await comm.send_json_to(_piece(assign, 0, "unpacking sources\n"))  # a repeat
    await comm.send_json_to(_piece(assign, 40, "linking\n"))  # 12 characters never arrived
    await _settle(comm)
    live = "unpacking sources\ncompiling\n" + missing_line(12) + "linking\n"
    assert await _get_log(rest_token, build_id) == (
        200,
        live,
        {"X-Log-Offset": "0", "X-Log-Complete": "false"},
    )
    status, tail, headers = await _get_log(rest_token, build_id, "?offset=18")
    assert (status, tail, headers["X-Log-Offset"]) == (200, live[18:], "18")

    spec = assign["job"]["builds"][0]
    await comm.send_json_to(
        {
            "type": "JobUpdate",
            "job_id": assign["job_id"],
            "assignment_id": assign["assignment_id"],
            "update": {
                "kind": "build_output",
                "build_id": build_id,
                "outputs": [{"name": o["name"], "path": o["path"], "nar_size": 1} for o in spec["outputs"]],
                "substituted": False,
            },
        }
    )
    await comm.send_json_to(
        {
            "type": "JobCompleted",
            "job_id": assign["job_id"],
            "assignment_id": assign["assignment_id"],
            "elapsed_ms": 5,
        }
    )
    await _settle(comm)
    assert await _get_log(rest_token, build_id) == (
        200,
        live,
        {"X-Log-Offset": "0", "X-Log-Complete": "true"},
    )
    await finish(comm)


async def test_a_stale_or_foreign_piece_changes_nothing_and_is_answered_with_nothing(
    make_worker: Any,
) -> None:
    worker_id, token, _ = await _setup(make_worker)
    other_id, other_token = await _other(make_worker)
    comm, _ = await handshake(worker_id, token)
    assign = await _assigned_build(comm)
    await comm.send_json_to(_piece(assign, 0, "mine\n"))
    await _settle(comm)
    before = await _log_rows()

    stranger, _ = await handshake(other_id, other_token)
    await stranger.send_json_to(_piece(assign, 5, "theirs\n"))  # another worker's assignment
    await _settle(stranger)
    await comm.send_json_to(_piece(assign, 5, "x\n", assignment_id="00000000-0000-0000-0000-000000000000"))
    await comm.send_json_to(_piece(assign, 5, "x\n", assignment_id="garbage"))
    await _settle(comm)
    assert await _log_rows() == before
    assert await comm.receive_nothing(timeout=0.2)
    await finish(stranger)
    await finish(comm)


@database_sync_to_async
def _other(make_worker: Any) -> tuple[str, str]:
    worker, token = make_worker(projects=("p",))
    return str(worker.id), token


async def test_an_oversized_piece_is_a_protocol_error_that_writes_nothing(make_worker: Any) -> None:
    worker_id, token, _ = await _setup(make_worker)
    comm, _ = await handshake(worker_id, token)
    assign = await _assigned_build(comm)
    await comm.send_json_to(_piece(assign, 0, "first\n"))
    await _settle(comm)
    before = await snapshot(exclude_session_close=True), await _log_rows()

    await comm.send_to(text_data=json.dumps(_piece(assign, 6, "é" * (MAX_LOG_PIECE_BYTES // 2 + 1))))
    error, close_code = await expect_refusal(comm, "Error")
    after = await snapshot(exclude_session_close=True), await _log_rows()
    await finish(comm)  # the closed session hands its build back: that is the close's write, not the frame's

    assert error["code"] == 400 and "larger than" in error["message"]
    assert close_code == 4400
    assert after == before
    assert await _log_rows() == before[1]


async def test_a_piece_of_exactly_64_kib_is_accepted(make_worker: Any) -> None:
    worker_id, token, rest_token = await _setup(make_worker)
    comm, _ = await handshake(worker_id, token)
    assign = await _assigned_build(comm)
    data = "ab\n" * (MAX_LOG_PIECE_BYTES // 3) + "x" * (MAX_LOG_PIECE_BYTES % 3)
    assert len(data.encode()) == MAX_LOG_PIECE_BYTES
    await comm.send_json_to(_piece(assign, 0, data))
    await _settle(comm)
    status, text, _ = await _get_log(rest_token, assign["job"]["builds"][0]["build_id"])
    assert (status, text) == (200, data)
    await finish(comm)
