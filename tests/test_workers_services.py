"""The workers app's writes: sessions, lost workers' jobs going back to the pool, and the liveness pass."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from gradient.clusters.models import ClusterAttempt
from gradient.core.protocol import InitCapabilities
from gradient.recovery.models import PassState
from gradient.schedule import PASSES
from gradient.scheduling.models import (
    BuildAttempt,
    BuildAttemptOutcome,
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    DispatchOutcome,
    EvaluationStatus,
    JobKind,
    SentCandidate,
)
from gradient.scheduling.services.lifecycle import dispatch_return_to_pool, worker_jobs_return_lost
from gradient.workers.models import IdleSlot, Worker, WorkerSession
from gradient.workers.services import (
    HandshakeAccepted,
    HandshakeRejected,
    worker_liveness_step,
    worker_register,
    worker_session_close,
    worker_session_open,
    workers_drop_silent,
)
from gradient.workers.tasks import worker_liveness_pass
from tests.factories import (
    ClusterAttemptFactory,
    DerivationBuildFactory,
    DispatchedJobFactory,
    EvaluationFactory,
    WorkerFactory,
)

pytestmark = pytest.mark.django_db

CAPS = InitCapabilities(fetch=True, eval=True, build=True)


def _open(worker: Worker, token: str) -> HandshakeAccepted | HandshakeRejected:
    return worker_session_open(
        worker_id=str(worker.id),
        token=token,
        capabilities=CAPS,
        channel_name="test",
        server_boot=uuid.uuid4(),
        now=timezone.now(),
    )


def _session(worker: Worker, seconds_ago: float = 0) -> WorkerSession:
    seen = timezone.now() - timedelta(seconds=seconds_ago)
    return WorkerSession.objects.create(
        worker=worker, channel_name="c", server_boot=uuid.uuid4(), opened_at=seen, last_seen=seen
    )


def _building(worker: Worker) -> DispatchedJob:
    build = DerivationBuildFactory(status=BuildStatus.BUILDING)
    dispatch = DispatchedJobFactory(worker=worker, derivation_build=build)
    BuildAttempt.objects.create(
        build=build, dispatched_job=dispatch, worker=worker, number=1, started_at=timezone.now()
    )
    return dispatch


def _evaluating(worker: Worker, status: str = EvaluationStatus.EVALUATING_FLAKE) -> DispatchedJob:
    evaluation = EvaluationFactory(status=status)
    return DispatchedJobFactory(
        worker=worker, kind=JobKind.EVAL, evaluation=evaluation, derivation_build=None
    )


def test_a_new_session_starts_with_no_metrics() -> None:
    """Issue 34, item 9: metrics belong to the session that sent them; a reconnecting worker's old ones
    (its last session's load) do not carry over into the new session."""
    worker, token = worker_register(name="w", projects=[])
    Worker.objects.filter(id=worker.id).update(
        cpu_usage_pct=97.0, ram_free_mb=100, build_peak_ram_mb=9000, metrics_at=timezone.now()
    )
    assert isinstance(_open(worker, token), HandshakeAccepted)
    worker.refresh_from_db()
    assert (worker.cpu_usage_pct, worker.ram_free_mb, worker.build_peak_ram_mb, worker.metrics_at) == (
        None,
        None,
        None,
        None,
    )


def test_a_worker_token_is_stored_only_as_a_hash() -> None:
    worker, token = worker_register(name="w", projects=[])
    assert token not in worker.token_hash and len(token) >= 40
    assert isinstance(_open(worker, token), HandshakeAccepted)
    assert _open(worker, token + "x") == HandshakeRejected(401, "bad token")


def test_one_open_session_per_worker_whoever_opens_the_second() -> None:
    worker, token = worker_register(name="w", projects=[])
    first = _open(worker, token)
    assert isinstance(first, HandshakeAccepted)
    assert _open(worker, token) == HandshakeRejected(496, "this worker already has an open session")
    assert worker_session_close(session_id=first.session.session_id, reason="bye", now=timezone.now())
    assert isinstance(_open(worker, token), HandshakeAccepted)


def test_a_lost_build_goes_back_to_queued_and_its_attempt_is_aborted() -> None:
    worker = WorkerFactory()
    dispatch = _building(worker)
    SentCandidate.objects.create(worker=WorkerFactory(), job_id=dispatch.job_id)

    returned = worker_jobs_return_lost(worker_id=worker.id, reason="worker lost: test", now=timezone.now())

    assert returned == 1
    dispatch.refresh_from_db()
    assert dispatch.outcome == DispatchOutcome.ABANDONED and dispatch.reason == "worker lost: test"
    assert dispatch.derivation_build is not None
    dispatch.derivation_build.refresh_from_db()
    assert dispatch.derivation_build.status == BuildStatus.QUEUED
    assert BuildAttempt.objects.get(dispatched_job=dispatch).outcome == BuildAttemptOutcome.ABORTED
    assert not SentCandidate.objects.filter(job_id=dispatch.job_id).exists()


@pytest.mark.parametrize(
    "status", [EvaluationStatus.QUEUED, EvaluationStatus.FETCHING, EvaluationStatus.EVALUATING_DERIVATION]
)
def test_a_lost_evaluation_goes_back_to_queued_counting_a_lost_dispatch(status: str) -> None:
    worker = WorkerFactory()
    dispatch = _evaluating(worker, status)

    worker_jobs_return_lost(worker_id=worker.id, reason="lost", now=timezone.now())

    assert dispatch.evaluation is not None
    dispatch.evaluation.refresh_from_db()
    assert (dispatch.evaluation.status, dispatch.evaluation.lost_dispatches) == (EvaluationStatus.QUEUED, 1)


def test_a_declined_job_returns_without_counting_a_lost_dispatch() -> None:
    dispatch = _evaluating(WorkerFactory())
    assert dispatch_return_to_pool(dispatch_id=dispatch.id, reason="declined", lost=False, now=timezone.now())
    assert dispatch.evaluation is not None
    dispatch.evaluation.refresh_from_db()
    assert (dispatch.evaluation.status, dispatch.evaluation.lost_dispatches) == (EvaluationStatus.QUEUED, 0)


def test_returning_a_closed_assignment_changes_nothing() -> None:
    worker = WorkerFactory()
    dispatch = _building(worker)
    now = timezone.now()
    assert dispatch_return_to_pool(dispatch_id=dispatch.id, reason="first", lost=True, now=now)
    assert dispatch.derivation_build is not None
    # Meanwhile a newer claim put the build back to Building.
    DerivationBuild.objects.filter(id=dispatch.derivation_build.id).update(status=BuildStatus.BUILDING)

    assert not dispatch_return_to_pool(dispatch_id=dispatch.id, reason="second", lost=True, now=now)

    dispatch.refresh_from_db()
    dispatch.derivation_build.refresh_from_db()
    assert dispatch.reason == "first" and dispatch.derivation_build.status == BuildStatus.BUILDING


def test_a_cluster_member_is_not_requeued_as_a_single_job() -> None:
    worker = WorkerFactory()
    attempt: ClusterAttempt = ClusterAttemptFactory()
    build = DerivationBuildFactory(status=BuildStatus.BUILDING)
    member = DispatchedJobFactory(worker=worker, derivation_build=build, cluster_attempt=attempt)

    assert worker_jobs_return_lost(worker_id=worker.id, reason="lost", now=timezone.now()) == 0

    member.refresh_from_db()
    build.refresh_from_db()
    assert member.finished_at is None and build.status == BuildStatus.BUILDING


def test_the_liveness_step_drops_a_silent_session_and_returns_its_jobs() -> None:
    silent, fresh = WorkerFactory(), WorkerFactory()
    silent_session = _session(silent, seconds_ago=130)
    fresh_session = _session(fresh, seconds_ago=5)
    IdleSlot.objects.create(worker=silent, kind=JobKind.BUILD, recorded_at=timezone.now())
    lost = _building(silent)
    kept = _building(fresh)

    assert workers_drop_silent(now=timezone.now(), timeout_secs=120) == 1

    silent_session.refresh_from_db()
    fresh_session.refresh_from_db()
    lost.refresh_from_db()
    kept.refresh_from_db()
    assert silent_session.closed_at is not None and fresh_session.closed_at is None
    assert lost.outcome == DispatchOutcome.ABANDONED and kept.finished_at is None
    assert not IdleSlot.objects.filter(worker=silent).exists()
    assert not worker_liveness_step(now=timezone.now(), timeout_secs=120)


def test_the_liveness_step_returns_the_jobs_of_a_worker_without_a_session() -> None:
    worker = WorkerFactory(last_seen=timezone.now() - timedelta(hours=1))
    dispatch = _evaluating(worker)
    DispatchedJob.objects.filter(id=dispatch.id).update(dispatched_at=timezone.now() - timedelta(hours=1))

    assert workers_drop_silent(now=timezone.now(), timeout_secs=120) == 1

    dispatch.refresh_from_db()
    assert dispatch.outcome == DispatchOutcome.ABANDONED


def test_a_heartbeat_timeout_of_zero_disables_the_liveness_pass(settings: object) -> None:
    silent = WorkerFactory()
    session = _session(silent, seconds_ago=10_000)

    assert workers_drop_silent(now=timezone.now(), timeout_secs=0) == 0
    settings.GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS = 0  # type: ignore[attr-defined]
    assert worker_liveness_pass() == 0
    liveness = next(p for p in PASSES if p.name == "worker-liveness")
    assert liveness.seconds() == 0

    session.refresh_from_db()
    assert session.closed_at is None


def test_the_liveness_pass_runs_under_its_lease_every_third_of_the_timeout(settings: object) -> None:
    settings.GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS = 120  # type: ignore[attr-defined]
    liveness = next(p for p in PASSES if p.name == "worker-liveness")
    assert liveness.seconds() == 40
    settings.GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS = 3  # type: ignore[attr-defined]
    assert liveness.seconds() == 5
    _session(WorkerFactory(), seconds_ago=60)

    assert worker_liveness_pass() == 1
    assert PassState.objects.get(name="worker-liveness").last_result == 1
    assert settings.GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS == 3  # type: ignore[attr-defined]
