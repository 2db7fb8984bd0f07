"""Replayed reports (issue 9): a worker is dropped by the liveness pass while it holds an evaluation and a
build, reconnects with the same worker id as a new session and is given both jobs again under new
assignment ids; then it replays everything its old session said, and everything it might have said
late, under the old assignment ids. Nothing in the database changes, and it gets exactly the protocol's
answers: nothing at all for a fenced report (no Error, no close), Reject{496} for the old InitConnection
on another socket while the new session is open, and Error{400} with close 4400 for the old
InitConnection inside the new session.

Over the full ASGI application (channels' WebsocketCommunicator): the consumer, the job loop and the
scheduler are the real ones, on the real PostgreSQL.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.utils import timezone

from gradient.scheduling.models import (
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    Evaluation,
    EvaluationStatus,
)
from gradient.scheduling.services import graph
from gradient.workers.models import WorkerSession
from gradient.workers.services import workers_drop_silent
from tests.factories import EvaluationFactory, ProjectFactory
from tests.scheduling_helpers import drv
from tests.support.faults import database_snapshot
from tests.support.proto import (
    CAPABILITIES,
    assigned,
    expect_close,
    expect_refusal,
    finish,
    handshake,
    init_connection,
    open_socket,
)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]


snapshot = database_sync_to_async(database_snapshot)


@database_sync_to_async
def _setup(make_worker: Any) -> tuple[str, str, str, str]:
    """A worker of project p, a Queued evaluation, and a Queued shared build of a Building evaluation."""
    project = ProjectFactory(name="p")
    worker, token = make_worker(projects=("p",))
    queued = EvaluationFactory(project=project, repository="sim:diamond", commit="c0ffee")
    building = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=building, derivations=[drv("solo")], now=timezone.now())
    build = DerivationBuild.objects.get()
    assert build.status == BuildStatus.QUEUED
    return str(worker.id), token, f"eval:{queued.id}", f"build:{build.id}"


async def _session(
    worker_id: str, token: str
) -> tuple[WebsocketCommunicator, dict[str, Any], dict[str, Any]]:
    """A session that was given the evaluation and the build, and accepted both."""
    comm, _ = await handshake(worker_id, token)
    await comm.send_json_to(CAPABILITIES)
    flake = await assigned(comm, "flake")
    build = await assigned(comm, "build")
    for assign in (flake, build):
        await comm.send_json_to(
            {
                "type": "AssignJobResponse",
                "job_id": assign["job_id"],
                "assignment_id": assign["assignment_id"],
                "accepted": True,
                "reason": None,
            }
        )
    return comm, flake, build


def _replays(flake: dict[str, Any], build: dict[str, Any]) -> list[dict[str, Any]]:
    """Everything the dropped session said or could still say, under its own assignment ids."""
    e, b = (
        {"job_id": flake["job_id"], "assignment_id": flake["assignment_id"]},
        {
            "job_id": build["job_id"],
            "assignment_id": build["assignment_id"],
        },
    )
    spec = build["job"]["builds"][0]
    outputs = [{"name": o["name"], "path": o["path"], "nar_size": 4096} for o in spec["outputs"]]
    return [
        {"type": "AssignJobResponse", **e, "accepted": True, "reason": None},
        {"type": "AssignJobResponse", **b, "accepted": False, "reason": "full"},
        {"type": "JobUpdate", **e, "update": {"kind": "fetching"}},
        {"type": "JobUpdate", **e, "update": {"kind": "fetch_result", "flake_source": "/nix/store/x-source"}},
        {"type": "JobUpdate", **e, "update": {"kind": "evaluating_flake"}},
        {
            "type": "JobUpdate",
            **e,
            "update": {"kind": "eval_result", "derivations": [drv("replayed")], "warnings": [], "errors": []},
        },
        {"type": "EvalProgress", **e, "phase": "evaluating", "done": 1, "total": 2},
        {"type": "JobCompleted", **e, "elapsed_ms": 10},
        {
            "type": "JobFailed",
            **e,
            "error": "boom",
            "kind": "permanent",
            "missing_paths": None,
            "elapsed_ms": 1,
        },
        {"type": "JobUpdate", **b, "update": {"kind": "building", "build_id": spec["build_id"]}},
        {
            "type": "JobUpdate",
            **b,
            "update": {
                "kind": "build_output",
                "build_id": spec["build_id"],
                "outputs": outputs,
                "substituted": False,
            },
        },
        {
            "type": "BuildProgress",
            **b,
            "build_id": spec["build_id"],
            "phase": "upload",
            "bytes_done": 1,
            "bytes_total": 2,
        },
        {"type": "JobCompleted", **b, "elapsed_ms": 10},
        {
            "type": "JobFailed",
            **b,
            "error": "boom",
            "kind": "transient",
            "missing_paths": None,
            "elapsed_ms": 1,
        },
        # The same ids crossed over to the other job, and an attempt that never existed.
        {
            "type": "JobCompleted",
            "job_id": build["job_id"],
            "assignment_id": flake["assignment_id"],
            "elapsed_ms": 1,
        },
        {"type": "ClusterSignal", "attempt": str(uuid.uuid4()), "to": None, "payload": "hello"},
    ]


async def test_a_replaced_worker_replaying_old_reports_changes_nothing_and_gets_the_protocol_answers(
    make_worker: Any,
) -> None:
    worker_id, token, eval_key, build_key = await _setup(make_worker)

    # The first session gets both jobs, and starts on them.
    old, flake, build = await _session(worker_id, token)
    assert (flake["job_id"], build["job_id"]) == (eval_key, build_key)
    await old.send_json_to({"type": "JobUpdate", **_ids(flake), "update": {"kind": "fetching"}})
    await old.send_json_to(
        {
            "type": "JobUpdate",
            **_ids(build),
            "update": {"kind": "building", "build_id": build["job"]["builds"][0]["build_id"]},
        }
    )
    assert await old.receive_nothing(timeout=0.3)

    # Silent too long: the liveness pass drops it; both jobs go back to the pool.
    await database_sync_to_async(
        lambda: WorkerSession.objects.filter(worker_id=worker_id).update(
            last_seen=timezone.now() - timedelta(seconds=300)
        )
    )()
    assert await database_sync_to_async(workers_drop_silent)(now=timezone.now(), timeout_secs=120) == 1
    assert await expect_close(old) == 4408
    await finish(old)

    # The same worker, a new session: both jobs again, under new assignment ids.
    new, flake2, build2 = await _session(worker_id, token)
    assert (flake2["job_id"], build2["job_id"]) == (eval_key, build_key)
    assert {flake2["assignment_id"], build2["assignment_id"]}.isdisjoint(
        {flake["assignment_id"], build["assignment_id"]}
    )
    assert await new.receive_nothing(timeout=0.3)
    before = await snapshot()

    # The old InitConnection on another socket while the new session is open: Reject{496}.
    other = await open_socket()
    await other.send_json_to(init_connection(worker_id, token))
    reject, code = await expect_refusal(other, "Reject")
    assert (reject["code"], code) == (496, 4496)
    await finish(other)
    # Every old report, replayed on the new session: dropped, silently, the session left open.
    for frame in _replays(flake, build):
        await new.send_json_to(frame)
    assert await new.receive_nothing(timeout=0.3)
    # Last, the old InitConnection inside the new session: a message not allowed now, Error{400} and close
    # 4400. The consumer takes a session's frames in order, so this answer means every replay was handled.
    await new.send_json_to(init_connection(worker_id, token))
    error, code = await expect_refusal(new, "Error")
    assert (error["code"], code) == (400, 4400)

    # Nothing changed (the close that follows the violation has not run yet: the socket's disconnect is
    # delivered by finish() below).
    assert await snapshot() == before
    rows = await database_sync_to_async(
        lambda: {str(r.id): (r.finished_at is None, r.outcome) for r in DispatchedJob.objects.all()}
    )()
    assert rows[flake["assignment_id"]] == rows[build["assignment_id"]] == (False, "Abandoned")
    assert rows[flake2["assignment_id"]] == rows[build2["assignment_id"]] == (True, None)
    await finish(new)
    evaluation = await database_sync_to_async(lambda: Evaluation.objects.get(id=eval_key.split(":")[1]))()
    assert evaluation.status == EvaluationStatus.QUEUED  # handed back when the new session closed


def _ids(assign: dict[str, Any]) -> dict[str, Any]:
    return {"job_id": assign["job_id"], "assignment_id": assign["assignment_id"]}


def test_replay_frames_are_valid_protocol_messages() -> None:
    """The replays are well-formed, so what the test shows is fencing, not a decode error."""
    from gradient.core.protocol import decode_worker_message

    flake = {"job_id": "eval:x", "assignment_id": str(uuid.uuid4()), "job": {}}
    build = {
        "job_id": "build:y",
        "assignment_id": str(uuid.uuid4()),
        "job": {"builds": [{"build_id": "y", "outputs": [{"name": "out", "path": "/nix/store/y"}]}]},
    }
    for frame in _replays(flake, build):
        decode_worker_message(json.dumps(frame))
