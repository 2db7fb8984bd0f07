"""Reads of the clusters app: routing member reports, what the sweeps skip, memberships per batch, the
cluster book, and reserved seats."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gradient.clusters.models import ClusterJob, ClusterReservation, ClusterStatus
from gradient.clusters.selectors import (
    cluster_membership,
    clusters_wait_for_placement,
    is_cluster_assignment,
    queued_clusters,
    tracked_dispatch_q,
    tracked_evaluation_q,
    tracked_job_keys,
    worker_reserved_for,
)
from gradient.scheduling.models import BuildStatus, DerivationBuild, DispatchedJob, Evaluation
from tests.clusters_helpers import claim, make_cluster, queued_build, queued_evaluation, seat_worker
from tests.factories import DispatchedJobFactory, ProjectFactory, WorkerFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def claimed():  # type: ignore[no-untyped-def]
    project = ProjectFactory()
    build, evaluation = queued_build(project), queued_evaluation(project)
    cluster = make_cluster([("a", build), ("b", evaluation)])
    attempt = claim(
        cluster, [seat_worker(project, idle_for=("build",)), seat_worker(project, idle_for=("eval",))]
    )
    return cluster, build, evaluation, attempt


def test_member_assignments_are_routed_to_the_clusters_services_and_nothing_else_is(claimed) -> None:  # type: ignore[no-untyped-def]
    _, build, _, attempt = claimed
    single = DispatchedJobFactory()
    assert is_cluster_assignment(attempt.assignments[build.job_key])
    assert is_cluster_assignment(str(attempt.assignments[build.job_key]))
    assert not is_cluster_assignment(single.id)
    assert not is_cluster_assignment("not-a-uuid")


def test_members_of_an_open_attempt_are_tracked_and_the_sweeps_can_skip_them(claimed) -> None:  # type: ignore[no-untyped-def]
    _, build, evaluation, _ = claimed
    make_cluster([("x", queued_build(ProjectFactory()))])  # Queued without an attempt: not tracked
    single = DispatchedJobFactory()
    assert tracked_job_keys() == {build.job_key, evaluation.job_key}
    assert set(DispatchedJob.objects.exclude(tracked_dispatch_q()).values_list("id", flat=True)) == {
        single.id
    }
    assert list(Evaluation.objects.filter(tracked_evaluation_q()).values_list("id", flat=True)) == [
        evaluation.id
    ]


def test_memberships_of_a_batch_are_looked_up_at_once_and_non_members_are_absent(  # type: ignore[no-untyped-def]
    claimed, django_assert_num_queries
) -> None:
    cluster, build, evaluation, _ = claimed
    stranger = DerivationBuild.objects.create(drv_path="/nix/store/x-stranger.drv", system="x86_64-linux")
    with django_assert_num_queries(1):
        found = cluster_membership(job_keys=[build.job_key, evaluation.job_key, stranger.job_key, "junk"])
    assert set(found) == {build.job_key, evaluation.job_key}
    assert (found[build.job_key].cluster_id, found[build.job_key].role) == (cluster.id, "a")
    assert found[build.job_key].in_book
    ClusterJob.objects.filter(id=cluster.id).update(status="Running")
    assert not cluster_membership(job_keys=[build.job_key])[build.job_key].in_book


def test_the_book_holds_queued_clusters_without_an_open_attempt_and_says_which_members_can_start() -> None:
    project = ProjectFactory()
    ready, waiting = queued_build(project), queued_build(project)
    evaluation = queued_evaluation(project)
    cluster = make_cluster([("ready", ready), ("waiting", waiting), ("eval", evaluation)])
    DerivationBuild.objects.filter(id=waiting.id).update(
        status=BuildStatus.QUEUED, retry_at=timezone.now() + timedelta(minutes=1)
    )
    (book,) = queued_clusters(now=timezone.now())
    assert book.cluster_id == str(cluster.id)
    by_role = {m.role: m for m in book.members}
    assert (by_role["ready"].can_start, by_role["waiting"].can_start, by_role["eval"].can_start) == (
        True,
        False,
        True,
    )
    assert by_role["ready"].projects == frozenset({project.name})
    assert by_role["eval"].needs_fetch and by_role["ready"].system == "x86_64-linux"


def test_a_reserved_seat_is_reserved_for_its_kind_only() -> None:
    project = ProjectFactory()
    cluster = make_cluster([("a", queued_build(project))])
    worker, other = WorkerFactory(), WorkerFactory()
    now = timezone.now()
    ClusterReservation.objects.create(
        cluster_job=cluster,
        seats=[{"role": "a", "index": 0, "kind": "build", "worker_id": str(worker.id)}],
        created_at=now,
        expires_at=now + timedelta(minutes=30),
    )
    assert worker_reserved_for(worker.id, "build")
    assert not worker_reserved_for(worker.id, "flake") and not worker_reserved_for(worker.id, "eval")
    assert not worker_reserved_for(other.id, "build")
    assert not worker_reserved_for(worker.id, "nonsense")


def test_only_a_queued_cluster_without_an_open_attempt_out_of_backoff_waits_for_placement(claimed) -> None:  # type: ignore[no-untyped-def]
    now = timezone.now()
    assert not clusters_wait_for_placement(now=now)  # the claimed cluster has an open attempt
    waiting = make_cluster([("x", queued_build(ProjectFactory()))])
    assert clusters_wait_for_placement(now=now)
    ClusterJob.objects.filter(id=waiting.id).update(retry_at=now + timedelta(seconds=30))
    assert not clusters_wait_for_placement(now=now)
    assert clusters_wait_for_placement(now=now + timedelta(seconds=31))
    ClusterJob.objects.filter(id=waiting.id).update(retry_at=None, status=ClusterStatus.RUNNING)
    assert not clusters_wait_for_placement(now=now)
