"""A RequestJob{build} right after the JobCompleted that freed its slot is claimed beside that report's
batch, not after it: the hand-out waits for one commit (the claim's), and the slot the report frees
counts as free already, a bounded number of rounds ahead (consumer.REPORT_ROUNDS_AHEAD): the
reports of the rounds before wait for nothing more. A worker that asks while its slots are all taken
still gets nothing."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.utils import timezone

from gradient.core.protocol import JobCompleted, RequestJob
from gradient.scheduling.models import BuildStatus, DerivationBuild, DispatchedJob, EvaluationStatus
from gradient.scheduling.services import graph
from gradient.workers.models import WorkerSession
from gradient.workers.proto import consumer as consumer_module
from gradient.workers.proto import dispatcher
from gradient.workers.services import SessionRef
from tests.factories import EvaluationFactory, ProjectFactory
from tests.scheduling_helpers import drv
from tests.support.proto import CAPABILITIES, TIMEOUT, assigned, finish, handshake

pytestmark = pytest.mark.django_db(transaction=True)


@database_sync_to_async
def _setup(make_worker: Any, names: tuple[str, ...] = ("a", "b")) -> tuple[str, str]:
    project = ProjectFactory(name="p")
    worker, token = make_worker(projects=("p",))
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv(n) for n in names], now=timezone.now())
    assert DerivationBuild.objects.filter(status=BuildStatus.QUEUED).count() == len(names)
    return str(worker.id), token


def _finished(assign: dict[str, Any]) -> list[dict[str, Any]]:
    ids = {"job_id": assign["job_id"], "assignment_id": assign["assignment_id"]}
    spec = assign["job"]["builds"][0]
    outputs = [{"name": o["name"], "path": o["path"], "nar_size": 4096} for o in spec["outputs"]]
    return [
        {"type": "AssignJobResponse", **ids, "accepted": True, "reason": None},
        {"type": "JobUpdate", **ids, "update": {"kind": "building", "build_id": spec["build_id"]}},
        {
            "type": "JobUpdate",
            **ids,
            "update": {
                "kind": "build_output",
                "build_id": spec["build_id"],
                "outputs": outputs,
                "substituted": False,
            },
        },
        {"type": "JobCompleted", **ids, "elapsed_ms": 10},
    ]


def _hold_completions(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """A report batch with a JobCompleted waits until the test sets `release`; `held` is set once one
    does. Returns (release, held)."""
    release, held = threading.Event(), threading.Event()
    real = dispatcher.reports_batch

    def slow_reports(batch: Any) -> Any:
        if any(isinstance(message, JobCompleted) for _, message in batch):
            held.set()
            assert release.wait(TIMEOUT * 2)  # the JobCompleted's batch waits until the test lets it go
        return real(batch)

    monkeypatch.setattr(dispatcher, "reports_batch", slow_reports)
    return release, held


async def _first_finished(worker_id: str, token: str) -> tuple[WebsocketCommunicator, dict[str, Any]]:
    """A session of one build slot that was handed its first build and has sent that build's reports."""
    comm, _ = await handshake(worker_id, token)
    await comm.send_json_to({**CAPABILITIES, "max_concurrent_builds": 1})  # one build slot
    first = await assigned(comm, "build")
    for frame in _finished(first):
        await comm.send_json_to(frame)
    return comm, first


async def test_the_next_request_is_claimed_while_the_completion_before_it_is_still_being_applied(
    make_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker_id, token = await _setup(make_worker)
    release, held = _hold_completions(monkeypatch)
    comm, first = await _first_finished(worker_id, token)
    try:
        second = await assigned(comm, "build")  # answered while the JobCompleted is held
        assert held.is_set(), "the JobCompleted's batch was being applied"
        assert second["job_id"] != first["job_id"]
        rows = await database_sync_to_async(
            lambda: {d.job_id: d.finished_at for d in DispatchedJob.objects.all()}
        )()
        assert rows[first["job_id"]] is None and rows[second["job_id"]] is None, "claimed beside, not after"
    finally:
        release.set()
    await _completed(comm, first)
    await finish(comm)


async def test_a_request_sent_once_the_completion_is_being_applied_does_not_wait_for_it(
    make_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a worker on the network sends them: the RequestJob is a frame of its own that comes after the
    session's queue of reports has emptied and their batch has started. It is claimed while that batch
    is still held, not after it."""
    import asyncio

    worker_id, token = await _setup(make_worker)
    release, held = _hold_completions(monkeypatch)
    comm, first = await _first_finished(worker_id, token)
    try:
        for _ in range(int(TIMEOUT * 100)):
            if held.is_set():
                break
            await asyncio.sleep(0.01)
        assert held.is_set(), "the JobCompleted's batch started"
        await asyncio.sleep(0.05)  # the session's queue is empty: it waits for that batch or a message
        second = await assigned(comm, "build")
        assert second["job_id"] != first["job_id"]
        rows = await database_sync_to_async(
            lambda: {d.job_id: d.finished_at for d in DispatchedJob.objects.all()}
        )()
        assert rows[first["job_id"]] is None, "the completion was still held when the next build went out"
    finally:
        release.set()
    await _completed(comm, first)
    await finish(comm)


async def test_claims_run_a_bounded_number_of_rounds_ahead_of_the_reports(
    make_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the first build's JobCompleted is held, the next builds are handed out beside it, one round
    after another, up to REPORT_ROUNDS_AHEAD requests; the one after them waits for the first round's
    reports: a session's claims do not outrun its reports by more (300 workers on a deep queue queued
    58 000 reports so, each worker's next request waiting seconds behind them)."""
    ahead = consumer_module.REPORT_ROUNDS_AHEAD
    names = tuple(f"b{i}" for i in range(ahead + 2))
    worker_id, token = await _setup(make_worker, names)
    release, _ = _hold_completions(monkeypatch)
    comm, first = await _first_finished(worker_id, token)
    handed = [first]
    try:
        for _ in range(ahead):
            handed.append(await assigned(comm, "build"))  # beside the held completion, as above
            for frame in _finished(handed[-1]):
                await comm.send_json_to(frame)
        await comm.send_json_to({"type": "RequestJob", "kind": "build"})
        assert await _offers_only(comm, 0.5), "the next waits for the first round's reports"
        rows = await database_sync_to_async(lambda: DispatchedJob.objects.count())()
        assert rows == ahead + 1, "nothing more was claimed"
    finally:
        release.set()
    last = await _next_assignment(comm)
    assert last["job_id"] not in {h["job_id"] for h in handed}
    for assign in handed:
        await _completed(comm, assign)
    await finish(comm)


async def _offers_only(comm: WebsocketCommunicator, secs: float) -> bool:
    """Nothing but pushed offers comes for `secs` (the first offer after WorkerCapabilities is made in its
    own batch and may come late, beside any frame of the job loop); any other frame fails the test."""
    import asyncio

    loop = asyncio.get_running_loop()
    until = loop.time() + secs
    while (left := until - loop.time()) > 0:
        # receive_nothing waits without cancelling the application (a timed-out receive would)
        if not await comm.receive_nothing(timeout=min(0.1, left)):
            frame = await comm.receive_json_from(timeout=TIMEOUT)
            assert frame["type"] in ("JobOffer", "JobListChunk"), frame
    return True


async def _next_assignment(comm: WebsocketCommunicator) -> dict[str, Any]:
    """The next AssignJob, pushed offers passed over (any other frame fails the test)."""
    while True:
        frame = await comm.receive_json_from(timeout=TIMEOUT)
        if frame["type"] == "AssignJob":
            return frame
        assert frame["type"] in ("JobOffer", "JobListChunk"), frame


async def _completed(comm: WebsocketCommunicator, assign: dict[str, Any]) -> None:
    """Once the held batch went through, the first build is Completed (its report was applied)."""
    import asyncio

    build_id = uuid.UUID(assign["job_id"].removeprefix("build:"))
    for _ in range(int(TIMEOUT * 20)):
        status = await database_sync_to_async(lambda: DerivationBuild.objects.get(id=build_id).status)()
        if status == BuildStatus.COMPLETED:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"build {build_id} stayed {status}")


@database_sync_to_async
def _session_ref(worker_id: str) -> SessionRef:
    session = WorkerSession.objects.get(worker_id=worker_id, closed_at__isnull=True)
    return SessionRef(session_id=session.id, worker_id=session.worker_id)


async def test_a_worker_whose_slot_is_taken_and_not_finishing_gets_nothing_more(make_worker: Any) -> None:
    worker_id, token = await _setup(make_worker)
    comm, _ = await handshake(worker_id, token)
    await comm.send_json_to({**CAPABILITIES, "max_concurrent_builds": 1})  # one build slot
    await assigned(comm, "build")
    session = await _session_ref(worker_id)
    request = RequestJob(kind="build")
    batch = database_sync_to_async(dispatcher.request_builds_batch)
    assert await batch([(session, dispatcher.BuildRequest(request, finishing=0))]) == [None]
    [handed] = await batch([(session, dispatcher.BuildRequest(request, finishing=1))])
    assert handed is not None and handed.job_id.startswith("build:"), "its build's end on the way frees it"
    await finish(comm)
    assert consumer_module.CLAIM_WINDOW_SECS > 0


@database_sync_to_async
def _one_build(make_worker: Any) -> tuple[str, str]:
    project = ProjectFactory(name="q")
    worker, token = make_worker(projects=("q",))
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("only")], now=timezone.now())
    return str(worker.id), token


async def test_a_build_put_back_by_the_report_before_the_request_is_handed_out_again(
    make_worker: Any,
) -> None:
    worker_id, token = await _one_build(make_worker)
    comm, _ = await handshake(worker_id, token)
    await comm.send_json_to({**CAPABILITIES, "max_concurrent_builds": 1})
    first = await assigned(comm, "build")
    ids = {"job_id": first["job_id"], "assignment_id": first["assignment_id"]}
    await comm.send_json_to({"type": "AssignJobResponse", **ids, "accepted": True, "reason": None})
    # Cancelled on the worker (no attempt spent): the one build goes back to the queue, and the request
    # right behind the cancel, claimed before the cancel was applied and left unanswered, is asked again.
    await comm.send_json_to(
        {
            "type": "JobFailed",
            **ids,
            "error": "stopped",
            "kind": "canceled",
            "missing_paths": None,
            "elapsed_ms": 1,
        }
    )
    again = await assigned(comm, "build")
    assert again["job_id"] == first["job_id"] and again["assignment_id"] != first["assignment_id"]
    await finish(comm)
