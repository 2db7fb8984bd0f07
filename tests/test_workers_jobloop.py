"""The job-loop seam: candidate pages, idle slots, scores, and reports fenced by their assignment."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from gradient.clusters.models import (
    AttemptOutcome,
    ClusterAttempt,
    ClusterJob,
    ClusterSeat,
    ClusterStatus,
    SeatResult,
)
from gradient.clusters.services.attempts import ClaimedAttempt
from gradient.core.protocol import (
    AssignJobResponse,
    BuildFailureKind,
    BuildProgress,
    EvalProgress,
    Fetching,
    JobCompleted,
    JobFailed,
    JobListChunk,
    JobUpdate,
    RequestJob,
    RequestJobChunk,
    RequestJobList,
)
from gradient.core.protocol import (
    CandidateScore as Score,
)
from gradient.recovery.models import PassState
from gradient.scheduling.models import (
    BuildStatus,
    CachedPath,
    CandidateScore,
    DerivationBuild,
    DerivationBuildDependency,
    DispatchedJob,
    DispatchOutcome,
    Evaluation,
    EvaluationBuild,
    EvaluationStatus,
    JobKind,
    Project,
    SentCandidate,
    build_key,
    eval_key,
)
from gradient.workers.models import IdleSlot, Worker, WorkerSession
from gradient.workers.proto import jobloop
from gradient.workers.services import SessionRef
from tests.clusters_helpers import claim, make_cluster, queued_build, seat_worker, started
from tests.factories import (
    DerivationBuildFactory,
    DispatchedJobFactory,
    EvaluationFactory,
    ProjectFactory,
    WorkerFactory,
)

pytestmark = pytest.mark.django_db


def _connected(worker: Worker, draining: bool = False) -> SessionRef:
    now = timezone.now()
    session = WorkerSession.objects.create(
        worker=worker,
        channel_name="c",
        server_boot=uuid.uuid4(),
        opened_at=now,
        last_seen=now,
        draining=draining,
    )
    return SessionRef(session.id, worker.id)


def _pages(session: SessionRef) -> list[JobListChunk]:
    pages = jobloop.request_job_list(session=session, message=RequestJobList())
    assert all(isinstance(p, JobListChunk) for p in pages)
    return pages  # type: ignore[return-value]


def _needed_by(project: Project, **build_fields: object) -> DerivationBuild:
    build = DerivationBuildFactory(status=BuildStatus.QUEUED, queued_at=timezone.now(), **build_fields)
    EvaluationBuild.objects.create(
        evaluation=EvaluationFactory(project=project, status="Building"), build=build
    )
    return build


def test_an_empty_job_list_is_one_final_page() -> None:
    pages = _pages(_connected(WorkerFactory()))
    assert [(p.candidates, p.is_final) for p in pages] == [([], True)]


def test_the_job_list_comes_in_pages_of_1000_the_last_one_final() -> None:
    project = Project.objects.create(name="p")
    worker = WorkerFactory(can_build=False)
    worker.projects.add(project)
    Evaluation.objects.bulk_create(
        [Evaluation(project=project, repository="sim:chain", commit=f"{i:040x}") for i in range(2300)]
    )

    pages = _pages(_connected(worker))

    assert [len(p.candidates) for p in pages] == [1000, 1000, 300]
    assert [p.is_final for p in pages] == [False, False, True]
    job_ids = [c.job_id for p in pages for c in p.candidates]
    assert len(set(job_ids)) == 2300
    assert SentCandidate.objects.filter(worker=worker).count() == 2300


def test_candidates_are_the_queued_jobs_of_the_workers_projects_that_it_can_run() -> None:
    mine, theirs = Project.objects.create(name="mine"), Project.objects.create(name="theirs")
    worker = WorkerFactory(architectures=["x86_64-linux"], system_features=["kvm"])
    worker.projects.add(mine)
    queued = EvaluationFactory(project=mine)
    EvaluationFactory(project=theirs)
    EvaluationFactory(project=mine, status=EvaluationStatus.FETCHING)
    assigned = EvaluationFactory(project=mine)
    DispatchedJobFactory(kind=JobKind.EVAL, evaluation=assigned, derivation_build=None)
    dependency = DerivationBuildFactory(
        status=BuildStatus.COMPLETED, outputs=[{"name": "out", "path": "/nix/store/aaa-dep"}]
    )
    buildable = _needed_by(
        mine, required_features=["kvm"], outputs=[{"name": "out", "path": "/nix/store/bbb-pkg"}]
    )
    DerivationBuildDependency.objects.create(build=buildable, dependency=dependency)
    CachedPath.objects.create(path="/nix/store/aaa-dep", nar_size=4096)
    builtin = _needed_by(mine, system="builtin")
    _needed_by(mine, system="aarch64-linux")
    _needed_by(mine, required_features=["big-parallel"])
    _needed_by(theirs)
    _needed_by(mine, retry_at=timezone.now() + timedelta(minutes=5))

    [page] = _pages(_connected(worker))

    by_id = {c.job_id: c for c in page.candidates}
    assert set(by_id) == {eval_key(queued.id), build_key(buildable.id), build_key(builtin.id)}
    build = by_id[build_key(buildable.id)]
    assert build.kind == "build" and build.drv_paths == [buildable.drv_path]
    assert build.output_paths == ["/nix/store/bbb-pkg"]
    assert [(p.path, p.nar_size) for p in build.required_paths] == [("/nix/store/aaa-dep", 4096)]
    assert build.requirement is not None and build.requirement.required_features == ["kvm"]
    assert by_id[eval_key(queued.id)].kind == "flake" and by_id[eval_key(queued.id)].requirement is None


def test_request_job_records_an_idle_slot_and_sends_nothing() -> None:
    worker = WorkerFactory()
    session = _connected(worker)

    assert jobloop.request_job(session=session, message=RequestJob(kind="build")) == []
    assert jobloop.request_job(session=session, message=RequestJob(kind="build")) == []

    assert list(IdleSlot.objects.filter(worker=worker).values_list("kind", flat=True)) == [JobKind.BUILD]


def test_a_draining_session_records_no_idle_slot() -> None:
    worker = WorkerFactory()
    jobloop.request_job(session=_connected(worker, draining=True), message=RequestJob(kind="flake"))
    assert not IdleSlot.objects.filter(worker=worker).exists()


def test_scores_replace_earlier_ones_and_ignore_what_is_not_a_job_key() -> None:
    worker = WorkerFactory()
    session = _connected(worker)
    job = build_key(DerivationBuildFactory(status=BuildStatus.QUEUED).id)  # a job that can be handed out

    for missing in (3, 1):
        jobloop.request_job_chunk(
            session=session,
            message=RequestJobChunk(
                scores=[
                    Score(
                        job_id=job, missing_count=missing, missing_nar_size=missing * 10, outputs_present=True
                    ),
                    Score(job_id="nonsense", missing_count=0, missing_nar_size=0, outputs_present=False),
                ],
                is_final=True,
            ),
        )

    assert list(CandidateScore.objects.values_list("job_id", "missing_count", "missing_nar_size")) == [
        (job, 1, 10)
    ]


def _reports(dispatch: DispatchedJob, assignment_id: str) -> list[object]:
    job = dispatch.job_id
    return [
        JobUpdate(job_id=job, assignment_id=assignment_id, update=Fetching()),
        EvalProgress(job_id=job, assignment_id=assignment_id, phase="fetching", done=1),
        BuildProgress(job_id=job, assignment_id=assignment_id, build_id="b", phase="download", bytes_done=1),
        JobCompleted(job_id=job, assignment_id=assignment_id, elapsed_ms=1),
        JobFailed(job_id=job, assignment_id=assignment_id, error="e", kind="transient", elapsed_ms=1),
        AssignJobResponse(job_id=job, assignment_id=assignment_id, accepted=False),
    ]


HANDLERS = {
    JobUpdate: jobloop.job_update,
    EvalProgress: jobloop.eval_progress,
    BuildProgress: jobloop.build_progress,
    JobCompleted: jobloop.job_completed,
    JobFailed: jobloop.job_failed,
    AssignJobResponse: jobloop.assign_job_response,
}


@pytest.mark.parametrize("stale", ["closed", "another worker's", "another job's", "garbage", "unknown"])
def test_a_report_that_is_not_the_jobs_open_assignment_on_this_worker_changes_nothing(stale: str) -> None:
    worker = WorkerFactory()
    session = _connected(worker)
    build = DerivationBuildFactory(status=BuildStatus.BUILDING)
    mine = DispatchedJobFactory(worker=worker, derivation_build=build)
    other = DispatchedJobFactory()
    closed = DispatchedJobFactory(
        worker=worker, finished_at=timezone.now(), outcome=DispatchOutcome.FAILED, job_id=mine.job_id
    )
    assignment = {
        "closed": str(closed.id),
        "another worker's": str(other.id),
        "another job's": str(other.id),
        "garbage": "'; DROP TABLE dispatched_job; --",
        "unknown": str(uuid.uuid4()),
    }[stale]
    if stale == "another job's":
        DispatchedJob.objects.filter(id=other.id).update(worker=worker)
    before = list(DispatchedJob.objects.order_by("id").values())

    for report in _reports(mine, assignment):
        assert HANDLERS[type(report)](session=session, message=report) == []

    assert list(DispatchedJob.objects.order_by("id").values()) == before
    build.refresh_from_db()
    assert build.status == BuildStatus.BUILDING


def test_a_report_for_the_open_assignment_is_recorded_and_moves_the_job_on() -> None:
    worker = WorkerFactory()
    session = _connected(worker)
    evaluation = EvaluationFactory(status=EvaluationStatus.QUEUED)
    dispatch = DispatchedJobFactory(
        worker=worker, kind=JobKind.EVAL, evaluation=evaluation, derivation_build=None
    )

    jobloop.job_update(
        session=session,
        message=JobUpdate(job_id=dispatch.job_id, assignment_id=str(dispatch.id), update=Fetching()),
    )

    dispatch.refresh_from_db()
    evaluation.refresh_from_db()
    assert dispatch.phase == "fetching" and dispatch.last_report_at is not None
    assert evaluation.status == EvaluationStatus.FETCHING


def test_an_accepted_assignment_is_noted_and_a_declined_one_returns_to_the_pool() -> None:
    worker = WorkerFactory()
    session = _connected(worker)
    accepted = DispatchedJobFactory(worker=worker)
    build = DerivationBuildFactory(status=BuildStatus.BUILDING)
    declined = DispatchedJobFactory(worker=worker, derivation_build=build)

    jobloop.assign_job_response(
        session=session,
        message=AssignJobResponse(job_id=accepted.job_id, assignment_id=str(accepted.id), accepted=True),
    )
    jobloop.assign_job_response(
        session=session,
        message=AssignJobResponse(
            job_id=declined.job_id, assignment_id=str(declined.id), accepted=False, reason="full"
        ),
    )

    accepted.refresh_from_db()
    declined.refresh_from_db()
    build.refresh_from_db()
    assert accepted.accepted_at is not None and accepted.finished_at is None
    assert declined.outcome == DispatchOutcome.ABANDONED and "full" in declined.reason
    assert build.status == BuildStatus.QUEUED


# --- Cluster members ------------------------------------------------------------------------------------


def _session_of(worker: Worker) -> SessionRef:
    session = WorkerSession.objects.get(worker=worker, closed_at__isnull=True)
    return SessionRef(session.id, worker.id)


def _pair() -> tuple[ClusterJob, list[DerivationBuild], list[Worker]]:
    """A cluster of two Queued builds and two connected workers of its project, idle for builds."""
    project = ProjectFactory()
    builds = [queued_build(project), queued_build(project)]
    cluster = make_cluster([("peer", builds[0]), ("peer", builds[1])], retry_budget=2)
    return cluster, builds, [seat_worker(project), seat_worker(project)]


def _member_seats(claimed: ClaimedAttempt) -> list[tuple[Worker, str, str]]:
    """(worker, job key, assignment id) of every member of a claimed attempt."""
    rows = DispatchedJob.objects.filter(cluster_attempt_id=claimed.attempt_id).select_related("worker")
    return [(row.worker, row.job_id, str(row.id)) for row in rows.order_by("job_id")]


def test_a_members_answers_go_to_the_cluster_code_and_the_last_accept_starts_the_attempt() -> None:
    cluster, _, workers = _pair()
    claimed = claim(cluster, workers)

    for worker, job_key, assignment_id in _member_seats(claimed):
        message = AssignJobResponse(job_id=job_key, assignment_id=assignment_id, accepted=True)
        assert jobloop.assign_job_response(session=_session_of(worker), message=message) == []

    attempt = ClusterAttempt.objects.get(id=claimed.attempt_id)
    cluster.refresh_from_db()
    assert attempt.started_at is not None and attempt.finished_at is None
    assert cluster.status == ClusterStatus.RUNNING and cluster.attempts == 1


def test_a_held_members_job_failed_goes_to_the_cluster_code_and_fails_the_prepare() -> None:
    cluster, builds, workers = _pair()
    claimed = claim(cluster, workers)
    worker, job_key, assignment_id = _member_seats(claimed)[0]

    jobloop.job_failed(
        session=_session_of(worker),
        message=JobFailed(
            job_id=job_key,
            assignment_id=assignment_id,
            error="cluster start timed out",
            kind=BuildFailureKind.ABORTED,
            elapsed_ms=1,
        ),
    )

    attempt = ClusterAttempt.objects.get(id=claimed.attempt_id)
    cluster.refresh_from_db()
    assert attempt.outcome == AttemptOutcome.PREPARE_FAILED
    assert cluster.status == ClusterStatus.QUEUED and cluster.attempts == 0
    assert {b.status for b in DerivationBuild.objects.filter(id__in=[b.id for b in builds])} == {
        BuildStatus.QUEUED
    }


def test_a_started_members_job_completed_is_held_for_the_verdict_not_settled_as_a_single_job() -> None:
    cluster, _, workers = _pair()
    claimed = started(cluster, workers)
    worker, job_key, assignment_id = _member_seats(claimed)[0]

    jobloop.job_completed(
        session=_session_of(worker),
        message=JobCompleted(job_id=job_key, assignment_id=assignment_id, elapsed_ms=5),
    )

    build = DerivationBuild.objects.get(id=job_key.split(":", 1)[1])
    assert build.status == BuildStatus.BUILDING  # held until every member is in
    seat = ClusterSeat.objects.get(attempt_id=claimed.attempt_id, job_key=job_key)
    assert seat.result == SeatResult.SUCCEEDED
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.RUNNING


def test_an_unanswered_request_job_places_a_waiting_cluster_at_once() -> None:
    cluster, _, workers = _pair()
    IdleSlot.objects.all().delete()

    assert jobloop.request_job(session=_session_of(workers[0]), message=RequestJob(kind="build")) == []
    assert not ClusterAttempt.objects.filter(cluster_job=cluster).exists()  # one idle worker: too few
    assert jobloop.request_job(session=_session_of(workers[1]), message=RequestJob(kind="build")) == []

    attempt = ClusterAttempt.objects.get(cluster_job=cluster)
    assert set(ClusterSeat.objects.filter(attempt=attempt).values_list("worker_id", flat=True)) == {
        w.id for w in workers
    }
    assert not IdleSlot.objects.filter(kind="build").exists()  # the seats' slots were taken


def test_no_dispatch_pass_runs_on_an_unanswered_request_job_when_no_cluster_waits() -> None:
    cluster, _, workers = _pair()
    ClusterJob.objects.filter(id=cluster.id).update(retry_at=timezone.now() + timedelta(minutes=5))

    jobloop.request_job(session=_session_of(workers[0]), message=RequestJob(kind="build"))

    assert not PassState.objects.filter(name="cluster-dispatch").exists()


def test_scores_for_jobs_that_do_not_exist_or_have_finished_are_not_stored() -> None:
    """Issue 25, finding 9: 100 000 scores for made-up ids were stored as 100 000 rows."""
    session = _connected(WorkerFactory())
    queued = DerivationBuildFactory(status=BuildStatus.QUEUED)
    finished = DerivationBuildFactory(status=BuildStatus.COMPLETED)
    made_up = [build_key(uuid.uuid4()) for _ in range(500)] + [f"eval:{uuid.uuid4()}" for _ in range(500)]

    jobloop.request_job_chunk(
        session=session,
        message=RequestJobChunk(
            scores=[
                Score(job_id=job, missing_count=1, missing_nar_size=10, outputs_present=False)
                for job in [*made_up, build_key(finished.id), build_key(queued.id)]
            ],
            is_final=True,
        ),
    )

    assert list(CandidateScore.objects.values_list("job_id", flat=True)) == [build_key(queued.id)]
