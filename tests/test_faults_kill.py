"""SIGKILL (issue 9): `serve` is killed with SIGKILL at random moments of a busy run, many times, and
started again on the same port each time; the same reference-worker processes reconnect by themselves.

After each restart, once the new boot has recovered (before it answers /healthz), SQL shows that nothing
of an earlier boot is open: no assignment dispatched and no cluster attempt created before the new boot
started, no session of an earlier boot. At the end every evaluation and cluster has finished, no job was
ever open twice at once nor completed twice, and every cluster attempt was all or nothing.

The passes run on a Celery worker with beat throughout (service mode), so they keep running while
`serve` is down, as they would in production. The short form kills 3 times; the long form
(--faults-long, GRADIENT_FAULTS_LONG=1) 20 times over more work. The seed of the random moments is
printed, and GRADIENT_FAULTS_SEED replays it.
"""

from __future__ import annotations

import os
import random
import signal
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gradient.clusters.models import ClusterAttempt, ClusterJob
from gradient.recovery.models import ServerBoot
from gradient.scheduling.models import DispatchedJob, Evaluation
from gradient.workers.models import WorkerSession
from tests.support.faults import (
    Operator,
    explain_jobs,
    invariant_violations,
    jobs_not_completed_exactly_once,
    ready_builds,
    scalar,
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

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.django_db(transaction=True)]

SHAPES = (
    "sim:wide?n=3&duration_ms=300&eval_ms=400&salt={i}",
    "sim:chain?n=3&duration_ms=300&salt={i}",
    "sim:diamond?duration_ms=200&eval_ms=800&salt={i}",
)


def _left_open_by_earlier_boots(boot: ServerBoot) -> dict[str, list[str]]:
    """What the new boot's recovery must have closed: anything open from before it started."""
    return {
        "assignments": [
            f"{r.job_id} on {r.worker_id} at {r.dispatched_at}"
            for r in DispatchedJob.objects.filter(finished_at__isnull=True, dispatched_at__lt=boot.started_at)
        ],
        "attempts": [
            f"{a.id} of {a.cluster_job_id} at {a.created_at}"
            for a in ClusterAttempt.objects.filter(finished_at__isnull=True, created_at__lt=boot.started_at)
        ],
        "sessions": [
            f"{s.worker_id} of boot {s.server_boot}"
            for s in WorkerSession.objects.filter(closed_at__isnull=True).exclude(server_boot=boot.id)
        ],
    }


def test_serve_killed_at_random_moments_recovers_each_time_and_every_evaluation_finishes_once(
    tmp_path: Path, faults_long: bool
) -> None:
    env = service_env()
    kills, evaluations_n, clusters_n = (20, 60, 4) if faults_long else (3, 12, 1)
    seed = int(os.environ.get("GRADIENT_FAULTS_SEED") or random.SystemRandom().randrange(1 << 30))
    print(f"GRADIENT_FAULTS_SEED={seed}")
    rng = random.Random(seed)
    workers: list[WorkerProcess] = []
    server: ServeProcess | None = None
    with ExitStack() as stack:
        beat = stack.enter_context(celery_worker(env, tmp_path))
        server = stack.enter_context(serve(env, tmp_path))
        port = server.port
        op = Operator.login(server)
        op.project("demo")
        try:
            # Cluster members before any worker connects, so no single assignment takes one of them.
            evaluations: list[str] = []
            clusters: list[str] = []
            # Clusters of ready builds (evaluation members: see docs/faults.md, "Left open").
            for c in range(clusters_n):
                builds = ready_builds(f"sim:wide?n=2&duration_ms=300&salt=member-{c}")
                clusters.append(op.cluster([{"build": b, "role": "peer"} for b in builds], retry_budget=30))
            batches = [evaluations_n // (kills + 1)] * (kills + 1)
            batches[0] += evaluations_n - sum(batches)
            evaluations += [op.evaluation(SHAPES[i % len(SHAPES)].format(i=i)) for i in range(batches[0])]

            workers += start_workers(stack, op, server.ws_url, tmp_path, [f"w{k}" for k in range(4)])

            submitted = batches[0]
            for kill in range(kills):
                # A busy moment: some job is out on a worker, then a random instant later.
                wait_until(
                    lambda: DispatchedJob.objects.filter(finished_at__isnull=True).exists(),
                    timeout=60,
                    what=f"a busy moment before kill {kill + 1}",
                )
                time.sleep(rng.uniform(0.0, 1.5))
                old = ServerBoot.objects.get(pid=server.process.pid, stopped_at__isnull=True)
                assert server.stop(signal.SIGKILL) == -signal.SIGKILL
                server = None
                time.sleep(rng.uniform(0.0, 1.0))
                server = stack.enter_context(serve(env, tmp_path, port=port))
                new = ServerBoot.objects.get(pid=server.process.pid)
                assert new.recovered_at is not None
                old.refresh_from_db()
                assert old.stopped_at is not None
                assert _left_open_by_earlier_boots(new) == {"assignments": [], "attempts": [], "sessions": []}
                op = Operator(server.base_url, op.token)
                evaluations += [
                    op.evaluation(SHAPES[i % len(SHAPES)].format(i=i))
                    for i in range(submitted, submitted + batches[kill + 1])
                ]
                submitted += batches[kill + 1]

            timeout = 400 if faults_long else 90
            wait_all_completed(
                evaluations, clusters, timeout, f"every evaluation to finish after {kills} kills"
            )
        except BaseException:
            for w in workers:
                print(f"--- {w.name}\n{w.log()[-2000:]}")
            if server is not None:
                print(f"--- serve\n{server.log()[-5000:]}")
            print(f"--- celery\n{beat.log()[-4000:]}")
            print("statuses", statuses(evaluations))
            for e in Evaluation.objects.exclude(status="Completed"):
                print("evaluation", e.id, e.repository, e.status, e.waiting_reason)
            for c in ClusterJob.objects.all():
                print("cluster", c.id, c.status, c.attempts, c.waiting_reason)
            raise

    assert ServerBoot.objects.count() == kills + 1
    assert not DispatchedJob.objects.filter(finished_at__isnull=True).exists()
    assert not ClusterAttempt.objects.filter(finished_at__isnull=True).exists()
    assert set(ClusterJob.objects.filter(id__in=clusters).values_list("status", flat=True)) == {"Completed"}
    assert invariant_violations() == {}
    offenders = jobs_not_completed_exactly_once(evaluations)
    assert offenders == {}, explain_jobs(list(offenders))
    abandoned = DispatchedJob.objects.filter(outcome="Abandoned", reason="server restarted").count()
    print(f"{kills} kills; {abandoned} assignments closed by startup recovery and handed out again")


@dataclass
class _Held:
    """A busy service (Celery beat, serve, three reference workers on a wide evaluation) and a
    connection of the test's own that takes a lock a batch of serve's will wait for, in its transaction."""

    env: dict[str, str]
    beat: Any
    server: ServeProcess
    port: int
    evaluation: str
    holder: Any

    def waiting_on(self, table: str) -> int | None:
        """The backend of a batch waiting for a lock on `table`, inside its transaction."""
        pid = scalar(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            f"AND wait_event_type = 'Lock' AND query LIKE '%%{table}%%' AND pid <> %s",
            (self.holder.info.backend_pid,),
        )
        return int(pid) if pid is not None else None

    def kill_while_waiting(self, table: str, what: str) -> int:
        """SIGKILL serve once a batch waits for the lock on `table`; returns that batch's backend, ended."""
        try:
            blocked = wait_until(lambda: self.waiting_on(table), timeout=60, what=what)
            assert self.server.stop(signal.SIGKILL) == -signal.SIGKILL
        finally:
            self.holder.rollback()  # the killed boot's backend goes on, finds its client gone, rolls back
        wait_until(
            lambda: not scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (blocked,)),
            timeout=30,
            what="the killed boot's batch transaction to end",
        )
        return blocked

    def restart_and_finish(self, stack: ExitStack, tmp_path: Path, what: str) -> None:
        self.server = stack.enter_context(serve(self.env, tmp_path, port=self.port))
        try:
            wait_all_completed([self.evaluation], [], 90, what)
        except BaseException:
            print(f"--- serve\n{self.server.log()[-5000:]}")
            print(f"--- celery\n{self.beat.log()[-4000:]}")
            raise


def _held(stack: ExitStack, tmp_path: Path, salt: str) -> _Held:
    import psycopg
    from django.db import connection

    env = service_env()
    beat = stack.enter_context(celery_worker(env, tmp_path))
    server = stack.enter_context(serve(env, tmp_path))
    op = Operator.login(server)
    op.project("demo")
    evaluation = op.evaluation(f"sim:wide?n=12&duration_ms=200&eval_ms=200&salt={salt}")
    start_workers(stack, op, server.ws_url, tmp_path, [f"w{k}" for k in range(3)])
    settings = connection.settings_dict
    holder = psycopg.connect(
        host=settings["HOST"] or "127.0.0.1",
        port=int(settings["PORT"] or 5432),
        user=settings["USER"],
        dbname=settings["NAME"],
        autocommit=False,
    )
    stack.callback(holder.close)
    return _Held(env, beat, server, server.port, evaluation, holder)


def test_serve_killed_in_the_middle_of_a_report_batch_commits_none_of_it_and_everything_finishes_once(
    tmp_path: Path,
) -> None:
    """A batch of reports is one transaction: SIGKILL while one is applied (held open, here, by this
    test's lock on the evaluation the batch's completions must finish) commits none of its reports, the
    next boot's recovery hands their jobs out again, and every build still completes exactly once."""
    with ExitStack() as stack:
        held = _held(stack, tmp_path, "batch-kill")
        evaluation = held.evaluation
        wait_until(
            lambda: DispatchedJob.objects.filter(kind="build", finished_at__isnull=True).exists(),
            timeout=60,
            what="a build out on a worker",
        )
        # Hold the evaluation: a batch that completes one of its builds waits for it, inside its
        # transaction, with the build's completion and its assignment's close written but not committed.
        held.holder.execute("SELECT id FROM evaluation WHERE id = %s FOR UPDATE", [evaluation])
        done_before = DispatchedJob.objects.filter(kind="build", outcome="Completed").count()
        held.kill_while_waiting("evaluation", "a report batch waiting in its transaction")
        # None of the batch committed: no build of it completed after the lock was taken.
        assert DispatchedJob.objects.filter(kind="build", outcome="Completed").count() == done_before
        held.restart_and_finish(stack, tmp_path, "the evaluation after the kill mid-batch")
    assert invariant_violations() == {}
    offenders = jobs_not_completed_exactly_once([evaluation])
    assert offenders == {}, explain_jobs(list(offenders))
    assert not DispatchedJob.objects.filter(finished_at__isnull=True).exists()


def test_serve_killed_in_the_middle_of_a_claim_batch_commits_none_of_its_claims_and_everything_finishes_once(
    tmp_path: Path,
) -> None:
    """A batch of RequestJobs is one transaction: SIGKILL while one is claiming (held open, here, by this
    test's lock on the idle slots, which the batch writes after its claim statement) commits none of its
    claims: no AssignJob went out for them, the builds are still Queued after the next boot, and every
    build still completes exactly once."""
    with ExitStack() as stack:
        held = _held(stack, tmp_path, "claim-kill")
        evaluation = held.evaluation
        wait_until(
            lambda: DispatchedJob.objects.filter(kind="build").exists(), timeout=60, what="a build handed out"
        )
        # Every claim batch writes the idle slots after its claim statement, inside its transaction.
        held.holder.execute("LOCK TABLE idle_slot IN SHARE ROW EXCLUSIVE MODE")
        dispatched_before = wait_until(
            lambda: held.waiting_on("idle_slot") and DispatchedJob.objects.filter(kind="build").count(),
            timeout=60,
            what="a claim batch waiting in its transaction",
        )
        held.kill_while_waiting("idle_slot", "a claim batch waiting in its transaction")
        # None of the batch's claims committed: no build was handed out after the lock was taken.
        assert DispatchedJob.objects.filter(kind="build").count() == dispatched_before
        held.restart_and_finish(stack, tmp_path, "the evaluation after the kill mid-claim-batch")
    assert invariant_violations() == {}
    offenders = jobs_not_completed_exactly_once([evaluation])
    assert offenders == {}, explain_jobs(list(offenders))
    assert not DispatchedJob.objects.filter(finished_at__isnull=True).exists()
