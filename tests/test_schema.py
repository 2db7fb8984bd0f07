"""The database constraints of cluster-jobs.md and the reference notes, each proved by violating it on
PostgreSQL, and each delete action proved by deleting with plain SQL and reading what is left."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from gradient.clusters.models import AttemptOutcome, ClusterAttempt, ClusterMember
from gradient.scheduling.models import BuildAttempt, BuildAttemptOutcome, DispatchedJob, DispatchOutcome
from gradient.workers.models import WorkerSession
from tests.factories import (
    ClusterAttemptFactory,
    ClusterJobFactory,
    ClusterMemberFactory,
    DerivationBuildFactory,
    DispatchedJobFactory,
    EvaluationFactory,
    WorkerFactory,
)

pytestmark = pytest.mark.usefixtures("postgres_only")


def violates(constraint: str):
    """Expect an IntegrityError that names `constraint`, raised by the database itself."""
    return pytest.raises(IntegrityError, match=constraint)


def _sql(statement: str, params: list[object] | None = None) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params or [])


def test_a_member_naming_both_an_evaluation_and_a_build_is_refused() -> None:
    with violates("cluster_member-exactly-one-job"), transaction.atomic():
        ClusterMemberFactory(evaluation=EvaluationFactory(), derivation_build=DerivationBuildFactory())


def test_a_member_naming_no_job_is_refused() -> None:
    cluster = ClusterJobFactory()
    with violates("cluster_member-exactly-one-job"), transaction.atomic():
        _sql(
            'INSERT INTO cluster_member (cluster_job_id, role, "index", "primary") VALUES (%s, %s, 0, false)',
            [cluster.id, "node"],
        )


def test_an_evaluation_belongs_to_at_most_one_cluster() -> None:
    evaluation = EvaluationFactory()
    ClusterMemberFactory(evaluation=evaluation, derivation_build=None)
    with violates("idx-cluster_member-evaluation"), transaction.atomic():
        ClusterMemberFactory(evaluation=evaluation, derivation_build=None)


def test_a_shared_build_belongs_to_at_most_one_cluster() -> None:
    build = DerivationBuildFactory()
    ClusterMemberFactory(derivation_build=build)
    with violates("idx-cluster_member-derivation_build"), transaction.atomic():
        ClusterMemberFactory(derivation_build=build)


def test_a_cluster_has_at_most_one_open_attempt() -> None:
    cluster = ClusterJobFactory()
    ClusterAttemptFactory(cluster_job=cluster)
    with violates("idx-cluster_attempt-open"), transaction.atomic():
        ClusterAttemptFactory(cluster_job=cluster, number=2)


def test_a_closed_attempt_does_not_block_the_next_one() -> None:
    cluster = ClusterJobFactory()
    ClusterAttemptFactory(
        cluster_job=cluster, finished_at=timezone.now(), outcome=AttemptOutcome.PREPARE_FAILED
    )
    ClusterAttemptFactory(cluster_job=cluster, number=2)
    assert ClusterAttempt.objects.filter(cluster_job=cluster).count() == 2


def test_a_job_has_at_most_one_open_assignment() -> None:
    first = DispatchedJobFactory()
    with violates("idx-dispatched_job-open-job"), transaction.atomic():
        DispatchedJobFactory(derivation_build=first.derivation_build)


def test_a_closed_assignment_does_not_block_the_next_hand_out() -> None:
    first = DispatchedJobFactory(finished_at=timezone.now(), outcome=DispatchOutcome.ABANDONED)
    second = DispatchedJobFactory(derivation_build=first.derivation_build)
    assert second.job_id == first.job_id


def test_an_assignment_has_an_outcome_exactly_when_finished() -> None:
    with violates("dispatched_job-outcome-iff-finished"), transaction.atomic():
        DispatchedJobFactory(outcome=DispatchOutcome.COMPLETED)
    with violates("dispatched_job-outcome-iff-finished"), transaction.atomic():
        DispatchedJobFactory(finished_at=timezone.now())


def test_a_shared_build_has_at_most_one_running_attempt() -> None:
    build = DerivationBuildFactory()
    BuildAttempt.objects.create(build=build, number=1, started_at=timezone.now())
    with violates("idx-build_attempt-running"), transaction.atomic():
        BuildAttempt.objects.create(build=build, number=2, started_at=timezone.now())
    assert BuildAttempt.objects.filter(build=build, outcome=BuildAttemptOutcome.RUNNING).count() == 1


def test_a_worker_has_at_most_one_open_session() -> None:
    worker = WorkerFactory()
    now = timezone.now()
    WorkerSession.objects.create(
        worker=worker,
        channel_name="a",
        server_boot="00000000-0000-0000-0000-000000000001",
        opened_at=now,
        last_seen=now,
    )
    with violates("idx-worker_session-open"), transaction.atomic():
        WorkerSession.objects.create(
            worker=worker,
            channel_name="b",
            server_boot="00000000-0000-0000-0000-000000000002",
            opened_at=now,
            last_seen=now,
        )


def test_deleting_a_cluster_job_with_sql_cascades_to_members_and_attempts_and_detaches_assignments() -> None:
    cluster = ClusterJobFactory(status="Completed", finished_at=timezone.now())
    member = ClusterMemberFactory(cluster_job=cluster)
    attempt = ClusterAttemptFactory(
        cluster_job=cluster, finished_at=timezone.now(), outcome=AttemptOutcome.SUCCEEDED
    )
    row = DispatchedJobFactory(
        derivation_build=member.derivation_build,
        cluster_attempt=attempt,
        finished_at=timezone.now(),
        outcome=DispatchOutcome.COMPLETED,
    )

    _sql("DELETE FROM cluster_job WHERE id = %s", [cluster.id])
    _sql("SET CONSTRAINTS ALL IMMEDIATE")  # check the deferred foreign keys now, not at commit

    assert not ClusterMember.objects.filter(pk=member.pk).exists()
    assert not ClusterAttempt.objects.filter(pk=attempt.pk).exists()
    row.refresh_from_db()
    assert row.cluster_attempt_id is None, "the member's assignment row outlives its attempt as telemetry"
    assert DispatchedJob.objects.filter(pk=row.pk).exists()


def test_deleting_an_attempt_with_sql_keeps_its_assignment_rows() -> None:
    attempt = ClusterAttemptFactory(finished_at=timezone.now(), outcome=AttemptOutcome.FAILED)
    row = DispatchedJobFactory(
        cluster_attempt=attempt, finished_at=timezone.now(), outcome=DispatchOutcome.FAILED
    )
    _sql("DELETE FROM cluster_attempt WHERE id = %s", [attempt.id])
    _sql("SET CONSTRAINTS ALL IMMEDIATE")
    row.refresh_from_db()
    assert row.cluster_attempt_id is None
