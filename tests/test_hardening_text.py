"""Text is text (issue 17, finding 1): a NUL or a lone surrogate in any string a worker sends becomes
U+FFFD at decoding (gradient.core.protocol), so no report fails on it in PostgreSQL; and a report the
database refuses all the same (a value too long for its column) costs neither the session nor its jobs.

Over the full ASGI application (channels' WebsocketCommunicator): the real consumer, job loop and
scheduler on the real PostgreSQL."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.utils import timezone

from gradient.core.protocol import (
    REPLACEMENT_CHARACTER,
    JobFailed,
    ProtocolError,
    WorkerCapabilities,
    clean_text,
    decode_worker_message,
)
from gradient.scheduling.models import (
    BuildAttempt,
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    Evaluation,
    EvaluationStatus,
)
from gradient.scheduling.services import graph
from gradient.workers.models import Worker, WorkerSession
from tests.factories import EvaluationFactory, ProjectFactory
from tests.scheduling_helpers import drv
from tests.support.proto import CAPABILITIES, TIMEOUT, assigned, finish, handshake

R = REPLACEMENT_CHARACTER


# --- Decoding -----------------------------------------------------------------------------------------


def _failed(error_json: str) -> str:
    return (
        '{"type": "JobFailed", "job_id": "j", "assignment_id": "a", "kind": "transient", "elapsed_ms": 1, '
        f'"error": {error_json}}}'
    )


@pytest.mark.parametrize(
    ("escaped", "decoded"),
    [
        (r'"a\u0000b"', f"a{R}b"),
        (r'"\ud800"', R),
        (r'"x\uDC00y"', f"x{R}y"),
        (r'"\ud800\u0000\udfff"', R * 3),
        (r'"\ud83d\ude00"', "\U0001f600"),  # a pair is the character it spells
        (r'"\\u0000"', "\\u0000"),  # an escaped backslash and the text u0000: nothing to replace
        (r'"plain"', "plain"),
    ],
)
def test_nul_and_lone_surrogates_decode_as_the_replacement_character(escaped: str, decoded: str) -> None:
    for frame in (_failed(escaped), _failed(escaped).encode()):
        message = decode_worker_message(frame)
        assert isinstance(message, JobFailed)
        assert message.error == decoded


def test_raw_surrogates_in_a_text_frame_decode_too_and_every_string_is_cleaned() -> None:
    frame = json.dumps(
        {**CAPABILITIES, "architectures": ["x\x00", "\ud800"], "zone": "z\udfff", "endpoint": "\ud83d\ude00"},
        ensure_ascii=False,
    )
    message = decode_worker_message(frame)
    assert isinstance(message, WorkerCapabilities)
    assert message.architectures == [f"x{R}", R]
    assert (message.zone, message.endpoint) == (f"z{R}", "\U0001f600")


@pytest.mark.parametrize(
    "frame",
    [
        '{"type": "JobFailed", "job_id": "\\u0000"}',  # missing fields stay missing
        '{"type": "Nope\\u0000"}',
        '["\\u0000"]',
        '{"type": "RequestJob", "kind": "build", "x\\u0000": 1}',
        '{"type": "RequestJob", "kind": "b\\u0000uild"}',
        '{"type": "RequestJob", "kind": "build", "k": NaN, "z": "\\u0000"}',
        '{"type": "RequestJob", "kind": "build" "\\u0000"}',
    ],
)
def test_what_was_a_violation_stays_one(frame: str) -> None:
    with pytest.raises(ProtocolError):
        decode_worker_message(frame)


def test_clean_text_leaves_other_control_characters() -> None:
    assert clean_text("a\x01\tb\x00") == f"a\x01\tb{R}"


# --- Over the consumer --------------------------------------------------------------------------------


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def gradient_errors() -> Any:
    handler = Errors()
    logger = logging.getLogger("gradient")
    logger.addHandler(handler)
    yield handler.records
    logger.removeHandler(handler)


@database_sync_to_async
def _setup(make_worker: Any) -> tuple[Worker, str, str, str]:
    """A worker of project p, a Queued evaluation, and a Queued shared build of a Building evaluation."""
    project = ProjectFactory(name="p")
    worker, token = make_worker(projects=("p",))
    queued = EvaluationFactory(project=project, repository="sim:chain?n=1", commit="c0ffee")
    building = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=building, derivations=[drv("solo")], now=timezone.now())
    build = DerivationBuild.objects.get()
    assert build.status == BuildStatus.QUEUED
    return worker, token, str(queued.id), str(build.id)


def _ids(assign: dict[str, Any]) -> dict[str, str]:
    return {"job_id": assign["job_id"], "assignment_id": assign["assignment_id"]}


async def _still_open(comm: WebsocketCommunicator) -> None:
    """Every frame sent so far was handled and none closed the socket: a RequestJobList is answered."""
    await comm.send_json_to({"type": "RequestJobList"})
    while True:
        frame = json.loads(await comm.receive_from(timeout=TIMEOUT))
        assert frame["type"] in ("JobListChunk", "JobOffer"), frame
        if frame["type"] == "JobListChunk" and frame["is_final"]:
            return


pytestmark_db = pytest.mark.django_db(transaction=True)


@pytestmark_db
async def test_nul_in_every_report_of_a_worker_is_stored_as_the_replacement_character(
    make_worker: Any, gradient_errors: list[logging.LogRecord]
) -> None:
    worker, token, evaluation_id, build_id = await _setup(make_worker)
    comm, _ = await handshake(str(worker.id), token)
    await comm.send_json_to({**CAPABILITIES, "architectures": ["x86_64-linux", "arm\x00"], "zone": "z\x00"})
    flake = await assigned(comm, "flake")
    build = await assigned(comm, "build")
    for assign in (flake, build):
        await comm.send_json_to(
            {"type": "AssignJobResponse", **_ids(assign), "accepted": True, "reason": None}
        )

    # The evaluation: a fetch result, warnings, an attribute and a build failure's text, all with NUL.
    source = "/nix/store/" + "s" * 32 + "-source\x00"
    for update in (
        {"kind": "fetching"},
        {"kind": "fetch_result", "flake_source": source},
        {"kind": "evaluating_flake"},
        {
            "kind": "eval_result",
            "derivations": [drv("top", attr="packages.x86_64-linux.top\x00")],
            "warnings": ["warn\x00ing", "\ud800"],
            "errors": [],
        },
    ):
        await comm.send_json_to({"type": "JobUpdate", **_ids(flake), "update": update})
    await comm.send_json_to({"type": "JobCompleted", **_ids(flake), "elapsed_ms": 5})
    spec = build["job"]["builds"][0]
    await comm.send_json_to(
        {"type": "JobUpdate", **_ids(build), "update": {"kind": "building", "build_id": spec["build_id"]}}
    )
    await comm.send_json_to(
        {
            "type": "JobFailed",
            **_ids(build),
            "error": "builder said \x00\x00 and died",
            "kind": "permanent",
            "missing_paths": ["/nix/store/x\x00"],
            "elapsed_ms": 3,
        }
    )
    await _still_open(comm)

    @database_sync_to_async
    def stored() -> tuple[Evaluation, DerivationBuild, BuildAttempt, Worker, list[DispatchedJob]]:
        return (
            Evaluation.objects.get(id=evaluation_id),
            DerivationBuild.objects.get(id=build_id),
            BuildAttempt.objects.filter(build_id=build_id).get(),
            Worker.objects.get(id=worker.id),
            list(DispatchedJob.objects.filter(worker_id=worker.id).order_by("dispatched_at")),
        )

    evaluation, shared, attempt, row, assignments = await stored()
    assert evaluation.flake_source == source.replace("\x00", R)
    assert evaluation.warnings == [f"warn{R}ing", R]
    assert evaluation.status != EvaluationStatus.FAILED and evaluation.lost_dispatches == 0
    assert shared.last_error == f"builder said {R}{R} and died"
    assert attempt.error == shared.last_error
    assert (row.architectures, row.zone) == (["x86_64-linux", f"arm{R}"], f"z{R}")
    assert [a.outcome for a in assignments] == ["Completed", "Failed"]
    await finish(comm)
    assert gradient_errors == []


@pytestmark_db
async def test_a_declined_assignment_with_nul_in_its_reason_keeps_the_session(make_worker: Any) -> None:
    worker, token, evaluation_id, _ = await _setup(make_worker)
    comm, _ = await handshake(str(worker.id), token)
    flake = await assigned(comm, "flake")
    await comm.send_json_to(
        {"type": "AssignJobResponse", **_ids(flake), "accepted": False, "reason": "no\x00"}
    )
    await _still_open(comm)
    [row] = await database_sync_to_async(lambda: list(DispatchedJob.objects.filter(worker_id=worker.id)))()
    assert row.outcome == "Abandoned" and "\x00" not in row.reason
    await finish(comm)


@pytestmark_db
async def test_a_report_the_database_refuses_fails_its_assignment_as_transient_and_keeps_the_session(
    make_worker: Any,
) -> None:
    worker, token, evaluation_id, _ = await _setup(make_worker)
    comm, _ = await handshake(str(worker.id), token)
    flake = await assigned(comm, "flake")
    await comm.send_json_to({"type": "AssignJobResponse", **_ids(flake), "accepted": True, "reason": None})
    # A system of 100 characters: its column holds 64.
    too_long = drv("top", system="x" * 100)
    await comm.send_json_to(
        {
            "type": "JobUpdate",
            **_ids(flake),
            "update": {"kind": "eval_result", "derivations": [too_long], "warnings": [], "errors": []},
        }
    )
    await _still_open(comm)

    @database_sync_to_async
    def stored() -> tuple[Evaluation, DispatchedJob, WorkerSession]:
        return (
            Evaluation.objects.get(id=evaluation_id),
            DispatchedJob.objects.get(worker_id=worker.id),
            WorkerSession.objects.get(worker_id=worker.id),
        )

    evaluation, row, session = await stored()
    assert session.closed_at is None
    assert row.outcome == "Failed" and "could not store" in row.reason, (row.outcome, row.reason)
    assert evaluation.lost_dispatches == 0
    assert not await DerivationBuild.objects.filter(drv_path=too_long["drv_path"]).aexists()
    await finish(comm)
