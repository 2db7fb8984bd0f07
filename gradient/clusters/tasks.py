"""Periodic passes of the clusters app: thin tasks that call services."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from gradient.clusters.services.dispatch import PASS_NAME, cluster_dispatch_pass
from gradient.clusters.services.retention import RETENTION_BATCH, cluster_jobs_delete_expired
from gradient.runtime.passes import pass_run


def _retention() -> int:
    deleted = 0
    while True:
        n = cluster_jobs_delete_expired(now=timezone.now(), retention_days=settings.GRADIENT_RETENTION_DAYS)
        deleted += n
        if n < RETENTION_BATCH:
            return deleted


@shared_task(name="gradient.clusters.tasks.retention_pass")
def retention_pass() -> int | None:
    """Hourly: delete finished cluster jobs past GRADIENT_RETENTION_DAYS, in batches of 5000."""
    return pass_run(name="cluster-retention", body=_retention)


@shared_task(name="gradient.clusters.tasks.dispatch_pass")
def dispatch_pass() -> dict[str, Any] | None:
    """Every GRADIENT_SCHEDULER_PASS_INTERVAL_SECS: expire overdue prepares, place and claim clusters,
    age reservations, record waiting reasons."""
    return pass_run(
        name=PASS_NAME, body=lambda: asdict(cluster_dispatch_pass(now=timezone.now())), lease_secs=60
    )
