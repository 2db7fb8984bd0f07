"""Periodic passes of the clusters app: thin tasks that call services."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from gradient.clusters.services import RETENTION_BATCH, cluster_jobs_delete_expired
from gradient.recovery.services import pass_run


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
