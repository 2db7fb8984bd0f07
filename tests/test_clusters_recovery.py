"""Startup recovery of clusters, in the reference notes' order, applied to the rows; and clusters whose
open attempt is entirely on workers of a live server are left to that server."""

from __future__ import annotations

import pytest
from django.utils import timezone

from gradient.clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterStatus
from gradient.clusters.services.recovery import recover_clusters_at_startup
from gradient.scheduling.models import (
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    Evaluation,
    EvaluationStatus,
)
from tests.clusters_helpers import (
    claim,
    cluster_only_build,
    make_cluster,
    queued_evaluation,
    record_problems,
    seat_worker,
    started,
)
from tests.factories import ProjectFactory

pytestmark = pytest.mark.django_db


def _pair(retry_budget: int = 2):  # type: ignore[no-untyped-def]
    project = ProjectFactory()
    build, evaluation = cluster_only_build(), queued_evaluation(project)
    cluster = make_cluster([("a", build), ("b", evaluation)], retry_budget=retry_budget)
    workers = [seat_worker(project, idle_for=("build",)), seat_worker(project, idle_for=("eval",))]
    return cluster, build, evaluation, workers


def _statuses(cluster, build, evaluation):  # type: ignore[no-untyped-def]
    return (
        ClusterJob.objects.get(id=cluster.id).status,
        DerivationBuild.objects.get(id=build.id).status,
        Evaluation.objects.get(id=evaluation.id).status,
    )


def test_an_unstarted_open_attempt_closes_prepare_failed_and_its_members_requeue() -> None:
    cluster, build, evaluation, workers = _pair()
    claimed = claim(cluster, workers)
    result = recover_clusters_at_startup(now=timezone.now())
    assert result.closed == 1
    assert ClusterAttempt.objects.get(id=claimed.attempt_id).outcome == AttemptOutcome.PREPARE_FAILED
    assert _statuses(cluster, build, evaluation) == (
        ClusterStatus.QUEUED,
        BuildStatus.QUEUED,
        EvaluationStatus.QUEUED,
    )
    assert DerivationBuild.objects.get(id=build.id).attempts == 0
    assert record_problems(cluster.job_key, evaluation.job_key) == {}


def test_a_started_attempt_closes_aborted_and_a_running_cluster_with_budget_goes_back_to_queued() -> None:
    cluster, build, evaluation, workers = _pair(retry_budget=2)
    claimed = started(cluster, workers)
    result = recover_clusters_at_startup(now=timezone.now())
    assert (result.closed, result.changed) == (1, {"Queued": 1})
    assert ClusterAttempt.objects.get(id=claimed.attempt_id).outcome == AttemptOutcome.ABORTED
    assert _statuses(cluster, build, evaluation) == (
        ClusterStatus.QUEUED,
        BuildStatus.QUEUED,
        EvaluationStatus.QUEUED,
    )
    assert not DispatchedJob.objects.filter(finished_at__isnull=True).exists()
    assert record_problems(cluster.job_key, evaluation.job_key) == {}


def test_a_running_cluster_whose_budget_is_spent_fails_and_its_members_end_aborted() -> None:
    cluster, build, evaluation, workers = _pair(retry_budget=1)
    started(cluster, workers)
    assert recover_clusters_at_startup(now=timezone.now()).changed == {"Failed": 1}
    assert _statuses(cluster, build, evaluation) == (
        ClusterStatus.FAILED,
        BuildStatus.ABORTED,
        EvaluationStatus.ABORTED,
    )
    assert record_problems(cluster.job_key, evaluation.job_key) == {}


def test_a_running_cluster_with_a_dead_member_is_aborted_before_its_budget_is_looked_at() -> None:
    cluster, build, evaluation, workers = _pair(retry_budget=1)
    started(cluster, workers)
    Evaluation.objects.filter(id=evaluation.id).update(
        status=EvaluationStatus.FAILED, finished_at=timezone.now()
    )
    assert recover_clusters_at_startup(now=timezone.now()).changed == {"Aborted": 1}
    assert _statuses(cluster, build, evaluation)[:2] == (ClusterStatus.ABORTED, BuildStatus.ABORTED)


def test_a_queued_cluster_with_a_dead_member_is_aborted_and_a_healthy_one_is_left_alone() -> None:
    dead, build, _, _ = _pair()
    healthy, *_ = _pair()
    DerivationBuild.objects.filter(id=build.id).update(status=BuildStatus.FAILED_PERMANENT)
    assert recover_clusters_at_startup(now=timezone.now()).changed == {"Aborted": 1}
    assert ClusterJob.objects.get(id=dead.id).status == ClusterStatus.ABORTED
    assert ClusterJob.objects.get(id=healthy.id).status == ClusterStatus.QUEUED


def test_an_attempt_entirely_on_workers_of_a_live_server_is_left_to_that_server() -> None:
    cluster, build, evaluation, workers = _pair()
    claimed = started(cluster, workers)
    result = recover_clusters_at_startup(now=timezone.now(), live_worker_ids=[w.id for w in workers])
    assert (result.closed, result.changed, result.left_to_live_servers) == (0, {}, 1)
    assert ClusterAttempt.objects.get(id=claimed.attempt_id).finished_at is None
    partly = recover_clusters_at_startup(now=timezone.now(), live_worker_ids=[workers[0].id])
    assert partly.closed == 1
    assert _statuses(cluster, build, evaluation)[0] == ClusterStatus.QUEUED
