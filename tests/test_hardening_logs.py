"""A worker cannot fill the disk with logs (issue 25, finding 3): the logs of all tries of one build are
capped together, and one worker's log bytes per hour, each cut with a line that names its setting.
Over /proto on the full ASGI application, as the prober did it: take a build, log, fail it `canceled`
(which spends no attempt and requeues it at once), take it again, and so on.

(That a repeated `canceled` counts as an attempt after the first few is not done here: it is the job
lifecycle's, which another change is rewriting.)"""

from __future__ import annotations

from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.db.models import Sum
from django.test import override_settings
from django.utils import timezone

from gradient.scheduling.decisions.logs import (
    LogState,
    append_piece,
    build_cut_line,
    cut_line,
    worker_cut_line,
)
from gradient.scheduling.models import BuildLog, BuildLogChunk, EvaluationStatus
from gradient.scheduling.services import graph
from tests.factories import EvaluationFactory, ProjectFactory
from tests.scheduling_helpers import drv
from tests.support.proto import CAPABILITIES, assigned, finish, handshake

PIECE = ("x" * 99 + "\n") * 80  # 8 000 bytes


def test_a_cap_other_than_the_logs_own_names_itself_in_the_cut_line() -> None:
    step = append_piece(LogState(), offset=0, data="abcdef\n", max_bytes=3, cut_text=build_cut_line(9))
    assert step.text == "abc\n" + build_cut_line(9) and step.state.cut
    assert append_piece(LogState(), offset=0, data="abcdef\n", max_bytes=3).text == "abc\n" + cut_line(3)
    assert "GRADIENT_BUILD_LOG_MAX_BYTES_PER_WORKER_HOUR" in worker_cut_line(5)


@database_sync_to_async
def _setup(make_worker: Any, names: tuple[str, ...]) -> tuple[str, str]:
    project = ProjectFactory(name="p")
    worker, token = make_worker(projects=("p",))
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv(n) for n in names], now=timezone.now())
    return str(worker.id), token


def _ids(frame: dict[str, Any]) -> dict[str, Any]:
    return {"job_id": frame["job_id"], "assignment_id": frame["assignment_id"]}


async def _take(comm: WebsocketCommunicator) -> dict[str, Any]:
    frame = await assigned(comm, "build")
    await comm.send_json_to({"type": "AssignJobResponse", **_ids(frame), "accepted": True, "reason": None})
    return frame


async def _log(comm: WebsocketCommunicator, frame: dict[str, Any], pieces: int) -> None:
    build_id = frame["job"]["builds"][0]["build_id"]
    for n in range(pieces):
        await comm.send_json_to(
            {"type": "BuildLog", **_ids(frame), "build_id": build_id, "offset": n * len(PIECE), "data": PIECE}
        )


async def _cancel(comm: WebsocketCommunicator, frame: dict[str, Any]) -> None:
    await comm.send_json_to(
        {"type": "JobFailed", **_ids(frame), "error": "stopping", "kind": "canceled", "elapsed_ms": 1}
    )


@database_sync_to_async
def _logs() -> list[tuple[str, int, bool, str]]:
    rows = []
    for log in BuildLog.objects.order_by("created_at"):
        text = "".join(
            BuildLogChunk.objects.filter(log_id=log.id).order_by("start").values_list("data", flat=True)
        )
        rows.append((str(log.build_id), log.size_bytes, log.cut, text))
    return rows


@pytest.mark.django_db(transaction=True)
@override_settings(
    GRADIENT_BUILD_LOG_MAX_BYTES=20_000,
    GRADIENT_BUILD_LOG_MAX_BYTES_PER_BUILD=50_000,
    GRADIENT_BUILD_LOG_MAX_BYTES_PER_WORKER_HOUR=0,
    # Eight tries of one build by one worker, each cancelled: past the free cancels they would count as
    # failed attempts (test_scheduling_repeated_cancels); here only the log cap is asked about.
    GRADIENT_BUILD_FREE_CANCELS=100,
)
async def test_take_log_cancel_in_a_loop_stores_at_most_the_builds_cap_of_all_its_tries(
    make_worker: Any,
) -> None:
    worker_id, token = await _setup(make_worker, ("solo",))
    comm, _ = await handshake(worker_id, token)
    await comm.send_json_to(CAPABILITIES)
    for _try in range(8):
        frame = await _take(comm)
        await _log(comm, frame, 4)  # 32 000 bytes a try: each log cut at its own 20 000
        await _cancel(comm, frame)
    await _take(comm)  # every report before was handled
    await finish(comm)
    logs = await _logs()
    assert len(logs) == 8
    assert sum(size for _b, size, _c, _t in logs) == 50_000, [(b[-6:], s) for b, s, _c, _t in logs]
    assert [size for _b, size, _c, _t in logs] == [20_000, 20_000, 10_000, 0, 0, 0, 0, 0]
    assert logs[0][3].endswith(cut_line(20_000)) and logs[2][3].endswith(build_cut_line(50_000))
    assert all(cut for _b, _s, cut, _t in logs)


@pytest.mark.django_db(transaction=True)
@override_settings(
    GRADIENT_BUILD_LOG_MAX_BYTES=1_000_000,
    GRADIENT_BUILD_LOG_MAX_BYTES_PER_BUILD=0,
    GRADIENT_BUILD_LOG_MAX_BYTES_PER_WORKER_HOUR=40 * 1024,
)
async def test_one_workers_log_bytes_per_hour_are_capped_across_its_builds(make_worker: Any) -> None:
    worker_id, token = await _setup(make_worker, ("a", "b", "c"))
    comm, _ = await handshake(worker_id, token)
    await comm.send_json_to(CAPABILITIES)
    for _build in range(3):
        frame = await _take(comm)
        await _log(comm, frame, 3)  # 24 000 bytes a build
        await _cancel(comm, frame)
    await _take(comm)
    await finish(comm)
    logs = await _logs()
    stored = sum(size for _b, size, _c, _t in logs)
    assert 40 * 1024 - 8_000 <= stored <= 40 * 1024, [size for _b, size, _c, _t in logs]
    assert logs[1][3].endswith(worker_cut_line(40 * 1024)) and logs[2][1] == 0

    # Another worker has an hour of its own.
    other_id, other_token = await database_sync_to_async(make_worker)(projects=("p",))
    other, _ = await handshake(str(other_id.id), other_token)
    await other.send_json_to(CAPABILITIES)
    frame = await _take(other)
    await _log(other, frame, 1)
    await _cancel(other, frame)
    await _take(other)
    await finish(other)

    @database_sync_to_async
    def others() -> int:
        return int(
            BuildLog.objects.filter(assignment__worker_id=other_id.id).aggregate(n=Sum("size_bytes"))["n"]
        )

    assert await others() == len(PIECE)
