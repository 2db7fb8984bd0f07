"""A claim holds only while the session its AssignJob goes to is open: a claim that commits while that
session closes (its socket or the channel layer failing mid-request) must not stay open on a worker
that never heard of it (the Redis-restart fault test found one such claim left open for good)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from django.db import connection
from django.utils import timezone

from gradient.core.vocab import BuildStatus, EvaluationStatus, JobKind
from gradient.scheduling.models import DerivationBuild, DispatchedJob, build_key, eval_key
from gradient.scheduling.services import assignment, graph, lifecycle
from gradient.scheduling.services.assignment import request_builds
from gradient.scheduling.services.claims import ClaimRequest, claim_assignment
from gradient.workers.models import Worker, WorkerSession
from gradient.workers.services import worker_session_close
from tests.factories import EvaluationFactory, ProjectFactory, WorkerSessionFactory, connected_worker
from tests.scheduling_helpers import build_claim_for, drv


def _queued_build_and_worker() -> tuple[DerivationBuild, Worker, WorkerSession]:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("a")], now=timezone.now())
    worker = connected_worker([project])
    return (
        DerivationBuild.objects.get(status=BuildStatus.QUEUED),
        worker,
        WorkerSession.objects.get(worker=worker, closed_at__isnull=True),
    )


@pytest.mark.django_db
def test_a_build_claim_for_a_closed_session_loses_and_one_for_the_open_session_wins() -> None:
    build, worker, session = _queued_build_and_worker()
    closed = WorkerSessionFactory(worker=worker, closed_at=timezone.now(), close_reason="gone")
    stale = build_claim_for(build, worker, closed.id)
    assert lifecycle.claim_builds(claims=[stale], now=timezone.now()) == set()
    assert not DispatchedJob.objects.exists()
    assert DerivationBuild.objects.get(id=build.id).status == BuildStatus.QUEUED
    claim = build_claim_for(build, worker, session.id)
    assert lifecycle.claim_builds(claims=[claim], now=timezone.now()) == {claim.assignment_id}
    assert DispatchedJob.objects.get(job_id=build_key(build.id)).id == claim.assignment_id


@pytest.mark.django_db
def test_an_evaluation_claim_for_a_closed_session_loses() -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project)
    worker = connected_worker([project])
    session = WorkerSession.objects.get(worker=worker, closed_at__isnull=True)

    def request(session_id: uuid.UUID) -> ClaimRequest:
        return ClaimRequest(
            kind=JobKind.EVAL,
            job_key=eval_key(evaluation.id),
            worker_id=worker.id,
            evaluation_id=evaluation.id,
            session_id=session_id,
        )

    WorkerSession.objects.filter(id=session.id).update(closed_at=timezone.now(), close_reason="gone")
    assert claim_assignment(request=request(session.id), now=timezone.now()) is None
    assert not DispatchedJob.objects.exists()
    reopened = WorkerSessionFactory(worker=worker)
    assert claim_assignment(request=request(reopened.id), now=timezone.now()) is not None


@pytest.mark.django_db
def test_a_request_of_a_session_the_worker_has_replaced_is_not_answered() -> None:
    build, worker, old = _queued_build_and_worker()
    WorkerSession.objects.filter(id=old.id).update(closed_at=timezone.now(), close_reason="reconnected")
    new = WorkerSessionFactory(worker=worker)
    tried: list[uuid.UUID] = []
    assert request_builds(worker_ids=[worker.id], session_ids=[old.id], now=timezone.now(), tried=tried) == [
        None
    ]
    assert tried == [] and not DispatchedJob.objects.exists()
    answer = request_builds(worker_ids=[worker.id], session_ids=[new.id], now=timezone.now(), tried=tried)[0]
    assert answer is not None and answer.job_key == build_key(build.id)


@pytest.mark.django_db(transaction=True)
def test_a_session_closed_while_its_claim_is_uncommitted_waits_for_it_and_hands_the_job_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("row locks across connections are PostgreSQL's (SQLite runs one writer at a time)")
    build, worker, session = _queued_build_and_worker()
    claimed, release = threading.Event(), threading.Event()
    real_clear = assignment._clear_idle_slots

    def hold_the_transaction(worker_ids: list[uuid.UUID], kind: str) -> None:
        real_clear(worker_ids, kind)
        claimed.set()  # the claim is made, not committed
        assert release.wait(20)

    monkeypatch.setattr(assignment, "_clear_idle_slots", hold_the_transaction)
    answers: list[object] = []
    closes: list[bool] = []

    def claim() -> None:
        try:
            answers.extend(
                request_builds(worker_ids=[worker.id], session_ids=[session.id], now=timezone.now(), tried=[])
            )
        finally:
            connection.close()

    def close() -> None:
        try:
            closes.append(
                worker_session_close(session_id=session.id, reason="socket gone", now=timezone.now())
            )
        finally:
            connection.close()

    claimer = threading.Thread(target=claim)
    claimer.start()
    assert claimed.wait(20)
    closer = threading.Thread(target=close)
    closer.start()
    time.sleep(0.5)
    assert closer.is_alive(), "the close waits for the claim holding its session"
    release.set()
    claimer.join(20)
    closer.join(20)

    assert answers and answers[0] is not None and closes == [True]
    row = DispatchedJob.objects.get(job_id=build_key(build.id))
    assert row.finished_at is not None, "the close handed back the job claimed for its session"
    assert DerivationBuild.objects.get(id=build.id).status == BuildStatus.QUEUED


@pytest.mark.django_db(transaction=True)
def test_an_idle_slot_is_recorded_when_unanswered_and_cleared_once_answered() -> None:
    from gradient.workers.models import IdleSlot

    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    worker = connected_worker([project])
    assert request_builds(worker_ids=[worker.id], now=timezone.now(), tried=[]) == [None]
    assert IdleSlot.objects.filter(worker=worker, kind=JobKind.BUILD).exists()
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("late")], now=timezone.now())
    [answer] = request_builds(worker_ids=[worker.id], now=timezone.now(), tried=[])
    assert answer is not None
    assert not IdleSlot.objects.filter(worker=worker).exists()
