"""Retention with the tables the database side adds: deleting a finished cluster_job with plain SQL also
removes its attempts' seats (ON DELETE CASCADE in PostgreSQL itself), and leaves member rows as
telemetry."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gradient.clusters.models import ClusterAttempt, ClusterJob, ClusterSeat
from gradient.clusters.services.lifecycle import cluster_abort
from gradient.clusters.services.retention import cluster_jobs_delete_expired
from gradient.scheduling.models import DispatchedJob
from tests.clusters_helpers import make_cluster, queued_build, seat_worker, started
from tests.factories import ProjectFactory

pytestmark = pytest.mark.usefixtures("postgres_only")


def test_a_finished_cluster_past_retention_goes_with_its_seats_and_its_member_rows_stay() -> None:
    project = ProjectFactory()
    cluster = make_cluster([("a", queued_build(project))])
    started(cluster, [seat_worker(project)])
    cluster_abort(cluster_id=cluster.id, reason="done", now=timezone.now())
    assert ClusterSeat.objects.count() == 1
    ClusterJob.objects.filter(id=cluster.id).update(finished_at=timezone.now() - timedelta(days=100))
    assert cluster_jobs_delete_expired(now=timezone.now(), retention_days=90) == 1
    assert (ClusterJob.objects.count(), ClusterAttempt.objects.count(), ClusterSeat.objects.count()) == (
        0,
        0,
        0,
    )
    (row,) = DispatchedJob.objects.all()
    assert row.cluster_attempt_id is None
