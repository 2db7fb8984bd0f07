"""The single-assignment claim: one conditional INSERT, won by rows affected, across real connections."""

from __future__ import annotations

import random
import threading
import uuid

import pytest
from django.db import connection, transaction
from django.utils import timezone

from gradient.scheduling.models import (
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    DispatchOutcome,
    EvaluationStatus,
    JobKind,
    build_key,
    eval_key,
)
from gradient.scheduling.services.claims import ClaimRequest, assignment_close, claim_assignment
from tests.factories import DerivationBuildFactory, EvaluationFactory, WorkerFactory


def build_claim(build: DerivationBuild, worker_id: uuid.UUID) -> ClaimRequest:
    return ClaimRequest(
        kind=JobKind.BUILD, job_key=build_key(build.id), worker_id=worker_id, build_id=build.id
    )


@pytest.mark.django_db
def test_a_claim_on_a_queued_build_wins_and_writes_one_open_row() -> None:
    build = DerivationBuildFactory(status=BuildStatus.QUEUED)
    worker = WorkerFactory()
    assignment_id = claim_assignment(request=build_claim(build, worker.id), now=timezone.now())
    assert assignment_id is not None
    row = DispatchedJob.objects.get(id=assignment_id)
    assert (row.job_id, row.worker_id, row.finished_at, row.kind) == (
        build_key(build.id),
        worker.id,
        None,
        "build",
    )


@pytest.mark.django_db
def test_a_second_claim_on_an_open_job_is_lost_and_writes_nothing() -> None:
    build = DerivationBuildFactory(status=BuildStatus.QUEUED)
    first, second = WorkerFactory(), WorkerFactory()
    assert claim_assignment(request=build_claim(build, first.id), now=timezone.now()) is not None
    assert claim_assignment(request=build_claim(build, second.id), now=timezone.now()) is None
    assert DispatchedJob.objects.filter(job_id=build_key(build.id)).count() == 1


@pytest.mark.django_db
def test_a_claim_on_a_build_that_is_not_queued_is_lost() -> None:
    worker = WorkerFactory()
    for status in (BuildStatus.CREATED, BuildStatus.BUILDING, BuildStatus.COMPLETED, BuildStatus.ABORTED):
        build = DerivationBuildFactory(status=status)
        assert claim_assignment(request=build_claim(build, worker.id), now=timezone.now()) is None
    assert DispatchedJob.objects.count() == 0


@pytest.mark.django_db
def test_an_evaluation_can_be_claimed_until_it_is_terminal() -> None:
    worker = WorkerFactory()
    live = EvaluationFactory(status=EvaluationStatus.QUEUED)
    done = EvaluationFactory(status=EvaluationStatus.ABORTED, finished_at=timezone.now())
    for evaluation, expected in ((live, True), (done, False)):
        request = ClaimRequest(
            kind=JobKind.EVAL,
            job_key=eval_key(evaluation.id),
            worker_id=worker.id,
            evaluation_id=evaluation.id,
        )
        assert (claim_assignment(request=request, now=timezone.now()) is not None) is expected


@pytest.mark.django_db
def test_after_close_the_job_can_be_claimed_again_and_a_second_close_changes_nothing() -> None:
    build = DerivationBuildFactory(status=BuildStatus.QUEUED)
    worker = WorkerFactory()
    first = claim_assignment(request=build_claim(build, worker.id), now=timezone.now())
    assert first is not None
    row = DispatchedJob.objects.get(id=first)
    assert assignment_close(row=row, outcome=DispatchOutcome.ABANDONED, reason="x", now=timezone.now())
    assert not assignment_close(row=row, outcome=DispatchOutcome.COMPLETED, reason="late", now=timezone.now())
    assert DispatchedJob.objects.get(id=first).outcome == DispatchOutcome.ABANDONED
    assert claim_assignment(request=build_claim(build, worker.id), now=timezone.now()) is not None


@pytest.mark.django_db
def test_the_claim_keeps_the_score_breakdown_on_the_row() -> None:
    build = DerivationBuildFactory(status=BuildStatus.QUEUED)
    worker = WorkerFactory()
    request = ClaimRequest(
        kind=JobKind.BUILD,
        job_key=build_key(build.id),
        worker_id=worker.id,
        build_id=build.id,
        score=4200.5,
        breakdown={"WaitTime": 600.5, "EstimatedTime": 3600},
        missing_nar_size=1234,
        missing_count=2,
        job={"kind": "build"},
    )
    row = DispatchedJob.objects.get(id=claim_assignment(request=request, now=timezone.now()))
    assert (row.score, row.score_breakdown, row.missing_nar_size, row.missing_count, row.job) == (
        4200.5,
        {"WaitTime": 600.5, "EstimatedTime": 3600},
        1234,
        2,
        {"kind": "build"},
    )


@pytest.mark.django_db(transaction=True)
def test_sixteen_connections_racing_for_the_same_thousand_jobs_never_open_a_job_twice() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("needs concurrent connections")
    builds = DerivationBuild.objects.bulk_create(
        [
            DerivationBuild(drv_path=f"/nix/store/{i:032d}-race.drv", system="x86_64-linux", status="Queued")
            for i in range(1000)
        ]
    )
    workers = [WorkerFactory() for _ in range(16)]
    won: dict[uuid.UUID, int] = {}
    lost: dict[uuid.UUID, int] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(workers))

    def racer(worker_id: uuid.UUID, seed: int) -> None:
        order = list(builds)
        random.Random(seed).shuffle(order)
        wins = losses = 0
        try:
            barrier.wait()
            for build in order:
                with transaction.atomic():
                    outcome = claim_assignment(request=build_claim(build, worker_id), now=timezone.now())
                if outcome is None:
                    losses += 1
                else:
                    wins += 1
        except BaseException as exc:  # noqa: BLE001 - the test asserts there are none
            errors.append(exc)
        finally:
            won[worker_id], lost[worker_id] = wins, losses
            connection.close()

    threads = [threading.Thread(target=racer, args=(w.id, i)) for i, w in enumerate(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    assert sum(won.values()) == 1000
    assert sum(lost.values()) == 16 * 1000 - 1000
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT job_id, count(*) FROM dispatched_job WHERE finished_at IS NULL "
            "GROUP BY job_id HAVING count(*) > 1"
        )
        assert cursor.fetchall() == []
        cursor.execute("SELECT count(DISTINCT job_id) FROM dispatched_job WHERE finished_at IS NULL")
        assert cursor.fetchone() == (1000,)


@pytest.mark.django_db
def test_the_claims_count_of_a_workers_open_builds_reads_only_its_open_assignments() -> None:
    """The claim statement counts each claiming worker's open builds; its generic plan is made once per
    connection, maybe on the statistics of an empty table (a serve's start after a restore). Planned
    so, the count must still read the index of open assignments, not the worker's whole history."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's planner")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE dispatched_job")
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute("SET LOCAL enable_seqscan = off")  # as in the claim batches (setsql.generic_plans)
        cursor.execute(
            "PREPARE open_builds(uuid, text) AS SELECT count(*) FROM dispatched_job d "
            "WHERE d.worker_id = $1 AND d.finished_at IS NULL AND d.kind = $2"
        )
        cursor.execute("EXPLAIN EXECUTE open_builds(%s, 'build')", [uuid.uuid4()])
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("DEALLOCATE open_builds")
        # And whatever the statistics, no index of every assignment of a worker is there to take: each
        # index led by the worker holds only open ones or only finished ones.
        cursor.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'dispatched_job' "
            "AND indexdef LIKE '%%(worker_id%%'"
        )
        by_worker = dict(cursor.fetchall())
    assert "idx-dispatched_job-open-" in plan, plan  # an index of the open assignments only
    assert set(by_worker) == {"idx-dispatched_job-open-worker", "idx-dispatched_job-worker-done"}, by_worker
    assert all(" WHERE " in definition for definition in by_worker.values()), by_worker
