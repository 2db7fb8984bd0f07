"""Lost connections (issue 9): the server's database connections terminated mid-claim, and Redis
restarted; the service recovers by itself and loses nothing.

- `pg_terminate_backend`: the test holds a lock that makes the next claim (the INSERT into
  dispatched_job) wait, finds the `serve` backend waiting on it in pg_stat_activity (by its
  application_name, `gradient serve <pid>`, and its query), and terminates it there: mid-claim, every
  time. Every other connection of `serve` and of Celery is terminated along with it. The consumer makes
  the call again on a fresh connection (gradient.workers.proto.consumer._handle), so the workers never lose
  their sessions; every evaluation completes; no job is open twice nor completed twice.
- Redis restart: a redis-server of the test's own (never the shared one) on a free port serves as
  REDIS_URL for that test's `serve` and Celery. It is killed mid-run and started again empty. Each
  consumer's channel-layer receive fails; the consumer then closes its socket with 1011 and its session
  in the database (gradient.workers.proto.consumer.WorkerConsumer.__call__), so the workers reconnect at once
  rather than after the liveness timeout (left at its default of 120 s here, longer than the test
  waits). Work submitted before and after completes, including a cluster that can only be placed after
  the restart, whose AssignJob and StartCluster pushes go through the new Redis.

The short form terminates 3 times; the long form (--faults-long, GRADIENT_FAULTS_LONG=1) 15 times, and
restarts Redis 3 times.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import msgspec
import psycopg
import pytest
from django.conf import settings
from django.db import OperationalError
from django.utils import timezone

from gradient.clusters.models import ClusterJob
from gradient.core.protocol import RequestJob, RequestJobList
from gradient.scheduling.models import DerivationBuild, DispatchedJob, EvaluationBuild, Project
from gradient.scheduling.services import assignment
from gradient.workers.models import Worker, WorkerSession
from gradient.workers.proto import consumer, jobloop
from gradient.workers.services import SessionRef
from tests.factories import DerivationBuildFactory, EvaluationFactory, ProjectFactory, connected_worker
from tests.support.faults import (
    Operator,
    explain_jobs,
    invariant_violations,
    jobs_not_completed_exactly_once,
    own_redis,
    service_env,
    start_workers,
    statuses,
    wait_all_completed,
)
from tests.support.processes import (
    ServeProcess,
    WorkerProcess,
    celery_worker,
    serve,
    wait_until,
)

pytestmark = [pytest.mark.faults]

SHAPES = (
    "sim:wide?n=4&duration_ms=150&salt={i}",
    "sim:chain?n=3&duration_ms=150&salt={i}",
    "sim:diamond?duration_ms=150&salt={i}",
)


def _dsn() -> str:
    db = settings.DATABASES["default"]
    return f"host={db['HOST']} port={db['PORT']} user={db['USER']} dbname={db['NAME']}"


def _dump(
    server: ServeProcess | None, workers: list[WorkerProcess], celery_log: str, evaluations: list[str]
) -> None:
    for w in workers:
        print(f"--- {w.name}\n{w.log()[-2500:]}")
    if server is not None:
        print(f"--- serve\n{server.log()[-6000:]}")
    print(f"--- celery\n{celery_log[-3000:]}")
    print("statuses", statuses(evaluations))
    for c in ClusterJob.objects.all():
        print("cluster", c.id, c.status, c.attempts, c.waiting_reason)
    # What an unfinished evaluation waits on: its builds, and every open assignment with its session.
    from gradient.scheduling.models import Evaluation

    for e in Evaluation.objects.filter(id__in=evaluations).exclude(status="Completed"):
        print("evaluation", e.id, e.status, e.waiting_reason)
        builds = DerivationBuild.objects.filter(evaluation_links__evaluation=e).exclude(status="Completed")
        print(explain_jobs([f"eval:{e.id}"] + [f"build:{b.id}" for b in builds]))
        for b in builds:
            print("  build", b.id, b.status, b.attempts)
    for d in DispatchedJob.objects.filter(finished_at__isnull=True):
        session = WorkerSession.objects.filter(worker_id=d.worker_id).order_by("-opened_at").first()
        print(
            "open",
            d.job_id,
            d.worker_id,
            d.dispatched_at,
            "latest session",
            session and session.id,
            session and session.closed_at,
        )


def _terminate_mid_claim(server: ServeProcess, submit: Callable[[], str], timeout: float = 30.0) -> str:
    """With every worker idle, hold a lock that stops the next claim of `serve` at its INSERT, submit an
    evaluation, terminate the claiming backend while it waits (and every other connection of serve and
    Celery), then let go. Returns the evaluation."""
    # Idle, and nothing left to claim: between an evaluation's JobCompleted and its builds' claims (a
    # worker's next RequestJob{build}) no assignment is open, and a build's claim caught by the lock
    # below would hold its worker's session, not the evaluation's claim this waits for.
    wait_until(
        lambda: (
            not DispatchedJob.objects.filter(finished_at__isnull=True).exists()
            and not DerivationBuild.objects.filter(status__in=["Queued", "Building"]).exists()
        ),
        timeout=60,
        what="every worker idle and no build left to claim",
    )
    app = f"gradient serve {server.process.pid}"
    with psycopg.connect(_dsn()) as lock:
        # SHARE conflicts with the ROW EXCLUSIVE lock an INSERT (or an UPDATE) takes; reads go on. Idle
        # workers report nothing, so only the claim of the new evaluation waits on it.
        lock.execute("LOCK TABLE dispatched_job IN SHARE MODE")
        evaluation = submit()
        with psycopg.connect(_dsn(), autocommit=True) as admin:

            def waiting_claim() -> int | None:
                row = admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
                    "AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO dispatched_job%%' LIMIT 1",
                    (app,),
                ).fetchone()
                return int(row[0]) if row else None

            pid = wait_until(waiting_claim, timeout=timeout, interval=0.02, what=f"a claim of {app} waiting")
            assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE (application_name LIKE 'gradient serve %%' "
                "OR application_name LIKE 'gradient celery %%') "
                "AND datname = current_database() AND pid <> %s",
                (pid,),
            )
        lock.rollback()
    return evaluation


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_terminated_database_connections_mid_claim_cost_no_session_and_no_job(
    tmp_path: Path, faults_long: bool
) -> None:
    env = service_env()
    terminations, evaluations_n = (15, 40) if faults_long else (3, 9)
    workers: list[WorkerProcess] = []
    server: ServeProcess | None = None
    evaluations: list[str] = []
    with ExitStack() as stack:
        beat = stack.enter_context(celery_worker(env, tmp_path))
        server = stack.enter_context(serve(env, tmp_path))
        op = Operator.login(server)
        op.project("demo")
        try:
            workers = start_workers(stack, op, server.ws_url, tmp_path, ["w0", "w1", "w2"])
            for t in range(terminations):
                # The claim of this evaluation dies waiting at its INSERT; made again, it goes through.
                evaluations.append(
                    _terminate_mid_claim(server, lambda t=t: op.evaluation(SHAPES[0].format(i=t)))
                )
                wait_until(
                    lambda e=evaluations[-1]: DispatchedJob.objects.filter(job_id=f"eval:{e}").exists(),
                    timeout=30,
                    what="the claim made again",
                )
            evaluations += [
                op.evaluation(SHAPES[i % len(SHAPES)].format(i=i)) for i in range(terminations, evaluations_n)
            ]
            wait_all_completed(evaluations, [], 300 if faults_long else 90, "every evaluation to complete")
        except BaseException:
            _dump(server, workers, beat.log(), evaluations)
            raise
        log = server.log()

    # The claims died with their connections, and were made again: no worker lost its session for it.
    assert log.count("database connection lost handling RequestJob") >= terminations, log[-5000:]
    sessions = {w.name: WorkerSession.objects.filter(worker=w).count() for w in Worker.objects.all()}
    assert sessions == {f"w{k}": 1 for k in range(3)}, sessions
    assert "internal error" not in "".join(WorkerSession.objects.values_list("close_reason", flat=True))
    assert invariant_violations() == {}
    offenders = jobs_not_completed_exactly_once(evaluations)
    assert offenders == {}, explain_jobs(list(offenders))
    assert not DispatchedJob.objects.filter(finished_at__isnull=True).exists()


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_redis_restart_ends_sessions_cleanly_and_the_service_finishes_everything(
    tmp_path: Path, faults_long: bool
) -> None:
    restarts, evaluations_n = (3, 30) if faults_long else (1, 8)
    workers: list[WorkerProcess] = []
    server: ServeProcess | None = None
    evaluations: list[str] = []
    with ExitStack() as stack:
        redis = stack.enter_context(own_redis(tmp_path))
        # The liveness timeout at its default (120 s): a session left open by a dead consumer would keep
        # its worker out (496) for longer than this test waits.
        env = service_env(redis_url=redis.url, GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS="120")
        beat = stack.enter_context(celery_worker(env, tmp_path))
        server = stack.enter_context(serve(env, tmp_path))
        op = Operator.login(server)
        op.project("demo")
        op.project("late")
        try:
            # A cluster no worker may take yet: its project is given to the workers after the restart, so
            # its placement and pushes happen on the new Redis.
            members = [
                op.evaluation(f"sim:wide?n=2&duration_ms=150&salt=late-{k}", project="late") for k in range(2)
            ]
            cluster = op.cluster([{"evaluation": e, "role": "peer"} for e in members])
            evaluations += members
            workers = start_workers(stack, op, server.ws_url, tmp_path, ["w0", "w1", "w2"])
            per_round = evaluations_n // (restarts + 1)
            for r in range(restarts):
                evaluations += [
                    op.evaluation(SHAPES[i % len(SHAPES)].format(i=i))
                    for i in range(r * per_round, (r + 1) * per_round)
                ]
                wait_until(
                    lambda: DispatchedJob.objects.filter(finished_at__isnull=True).exists(),
                    timeout=30,
                    what="a busy moment",
                )
                opened = WorkerSession.objects.count()
                redis.stop()
                time.sleep(1.0)
                redis.start()
                # Every worker is back, on a new session (its consumer ended the old one).
                wait_until(
                    lambda opened=opened: (
                        WorkerSession.objects.filter(closed_at__isnull=True).count() == 3
                        and WorkerSession.objects.count() >= opened + 3
                    ),
                    timeout=40,
                    what="every worker reconnected after the Redis restart",
                )
            evaluations += [
                op.evaluation(SHAPES[i % len(SHAPES)].format(i=i))
                for i in range(restarts * per_round, evaluations_n)
            ]
            late = Project.objects.get(name="late")
            for worker in Worker.objects.all():
                worker.projects.add(late)
            wait_all_completed(
                evaluations, [cluster], 300 if faults_long else 90, "every evaluation and the cluster"
            )
        except BaseException:
            _dump(server, workers, beat.log(), evaluations)
            raise
        log = server.log()

    assert ClusterJob.objects.get(id=cluster).status == "Completed"
    # The sessions that Redis took down were ended by their consumers, not by the liveness pass.
    reasons = list(WorkerSession.objects.exclude(closed_at=None).values_list("close_reason", flat=True))
    assert reasons and not [r for r in reasons if "silent" in r], reasons
    assert "the consumer of" in log
    assert invariant_violations() == {}
    offenders = jobs_not_completed_exactly_once(evaluations)
    assert offenders == {}, explain_jobs(list(offenders))
    assert not DispatchedJob.objects.filter(finished_at__isnull=True).exists()


# --- The retry itself, at the seam ------------------------------------------------------------------


def _session_of(worker: Worker) -> SessionRef:
    session = WorkerSession.objects.get(worker=worker, closed_at__isnull=True)
    return SessionRef(session_id=session.id, worker_id=worker.id)


def _assert_handed_out_although_unheard(
    monkeypatch: pytest.MonkeyPatch, worker: Worker, kind: str, job_key: str, pause: float = 0.0
) -> None:
    """The claim of a RequestJob commits and the connection dies before the caller hears so: the job
    loop hands that claim out instead of leaving it open on a worker that never heard of it."""
    real = assignment.request_job

    def committed_then_lost(**kwargs: Any) -> Any:
        time.sleep(pause)  # the row is locked (and the claim stamped) after the request's `now`
        real(**kwargs)  # the claim commits...
        raise OperationalError("server closed the connection unexpectedly")  # ...and the caller never hears

    monkeypatch.setattr(assignment, "request_job", committed_then_lost)
    replies = jobloop.request_job(session=_session_of(worker), message=RequestJob(kind=kind))

    row = DispatchedJob.objects.get(job_id=job_key)
    assert [msgspec.to_builtins(r) for r in replies] == [
        {
            "type": "AssignJob",
            "job_id": row.job_id,
            "assignment_id": str(row.id),
            "job": row.job,
            "cluster": None,
        }
    ]
    assert row.finished_at is None and row.worker_id == worker.id


@pytest.mark.django_db(transaction=True)
def test_a_claim_whose_commit_went_unheard_is_handed_out_rather_than_left_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project)
    worker = connected_worker([project])
    _assert_handed_out_although_unheard(monkeypatch, worker, "flake", f"eval:{evaluation.id}")


@pytest.mark.django_db(transaction=True)
def test_a_build_claim_whose_commit_went_unheard_is_handed_out_rather_than_left_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The build case: its claim is stamped when the build's row was locked, later than the request's
    `now`, so the unheard claim is found by its id, not by its time."""
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status="Building")
    build = DerivationBuildFactory(status="Queued", queued_at=timezone.now())
    EvaluationBuild.objects.create(evaluation=evaluation, build=build)
    worker = connected_worker([project], can_build=True, architectures=[build.system])
    _assert_handed_out_although_unheard(monkeypatch, worker, "build", f"build:{build.id}", pause=0.01)


@pytest.mark.django_db(transaction=True)
def test_a_claim_lost_before_its_commit_is_left_to_the_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    project = ProjectFactory()
    EvaluationFactory(project=project)
    worker = connected_worker([project])

    def lost(**kwargs: Any) -> Any:
        raise OperationalError("terminating connection due to administrator command")

    monkeypatch.setattr(assignment, "request_job", lost)
    with pytest.raises(OperationalError):
        jobloop.request_job(session=_session_of(worker), message=RequestJob(kind="flake"))
    assert not DispatchedJob.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_job_loop_call_is_made_again_on_a_lost_connection_up_to_its_attempts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(consumer, "DB_RETRY_PAUSE_SECS", 0.0)
    worker = connected_worker([ProjectFactory()])
    session = _session_of(worker)
    calls: list[int] = []

    def flaky(failures: int) -> Any:
        def handler(*, session: SessionRef, message: Any) -> list[Any]:
            calls.append(1)
            if len(calls) <= failures:
                raise OperationalError("server closed the connection unexpectedly")
            return []

        return handler

    assert consumer._handle(flaky(consumer.DB_ATTEMPTS - 1), session, RequestJobList()) == []
    assert len(calls) == consumer.DB_ATTEMPTS
    calls.clear()
    with pytest.raises(OperationalError):
        consumer._handle(flaky(consumer.DB_ATTEMPTS), session, RequestJobList())
    assert len(calls) == consumer.DB_ATTEMPTS
