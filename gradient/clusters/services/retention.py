"""Retention of finished cluster jobs (cluster-jobs.md, Tables)."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import connection, transaction

from gradient.clusters.models import ClusterJob
from gradient.core.vocab import CLUSTER_TERMINAL

RETENTION_BATCH = 5000


def cluster_jobs_delete_expired(
    *, now: datetime, retention_days: int, batch_size: int = RETENTION_BATCH
) -> int:
    """Delete one batch of finished cluster jobs older than the retention window; returns how many.

    Never an active one: the status must be terminal and no attempt may be open. On PostgreSQL this is a
    plain SQL DELETE and the database's own ON DELETE actions remove members and attempts and detach
    assignment rows; SQLite (embedded mode) has no such actions, so there the ORM emulates them.
    """
    cutoff = now - timedelta(days=retention_days)
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    """
                    DELETE FROM cluster_job WHERE id IN (
                        SELECT cj.id FROM cluster_job cj
                        WHERE cj.status = ANY(%s) AND cj.finished_at < %s
                          AND NOT EXISTS (SELECT 1 FROM cluster_attempt ca
                                          WHERE ca.cluster_job_id = cj.id AND ca.finished_at IS NULL)
                        ORDER BY cj.finished_at
                        LIMIT %s
                        FOR UPDATE SKIP LOCKED
                    )
                    """,
                    [list(CLUSTER_TERMINAL), cutoff, batch_size],
                )
                return int(cursor.rowcount)
        ids = list(
            ClusterJob.objects.filter(status__in=CLUSTER_TERMINAL, finished_at__lt=cutoff)
            .exclude(attempt_rows__finished_at__isnull=True)
            .order_by("finished_at")
            .values_list("id", flat=True)[:batch_size]
        )
        ClusterJob.objects.filter(id__in=ids).delete()
        return len(ids)
