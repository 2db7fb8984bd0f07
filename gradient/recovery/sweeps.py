"""The sweeps: the abandoned-dispatch sweep and the evaluation watchdog.

Both only touch what nobody tracks: an assignment is tracked while its worker holds an open session
(it is connected and heartbeating) or while it is a member of an open cluster attempt.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import Exists, OuterRef

from gradient.core.vocab import EVALUATION_EVALUATING
from gradient.scheduling.models import DispatchedJob, Evaluation
from gradient.scheduling.services.lifecycle import assignment_return_to_pool, requeue_evaluation
from gradient.workers.models import WorkerSession

ABANDONED_AFTER_SECS = 1800
WATCHDOG_GRACE_SECS = 60


def _connected() -> Exists:
    return Exists(WorkerSession.objects.filter(worker_id=OuterRef("worker_id"), closed_at__isnull=True))


def abandoned_dispatch_sweep(*, now: datetime, older_than_secs: int = ABANDONED_AFTER_SECS) -> int:
    """Close open single-job assignments older than 30 minutes whose worker is gone, and give their jobs
    back (lost). Cluster members are the cluster code's."""
    rows = (
        DispatchedJob.objects.filter(
            finished_at__isnull=True,
            cluster_attempt__isnull=True,
            dispatched_at__lt=now - timedelta(seconds=older_than_secs),
        )
        .exclude(_connected())
        .order_by("dispatched_at")[:5000]
    )
    return sum(
        assignment_return_to_pool(row=row, reason="abandoned: its worker is gone", lost=True, now=now)
        for row in rows
    )


def evaluation_watchdog(*, now: datetime, grace_secs: int = WATCHDOG_GRACE_SECS) -> int:
    """An evaluation shown as fetching or evaluating with no open assignment for a minute is on no
    worker: back to Queued. Cluster member evaluations are skipped (their cluster tracks them)."""
    open_row = DispatchedJob.objects.filter(evaluation_id=OuterRef("pk"), finished_at__isnull=True)
    stale = (
        Evaluation.objects.filter(
            status__in=EVALUATION_EVALUATING, updated_at__lt=now - timedelta(seconds=grace_secs)
        )
        .filter(cluster_members__isnull=True)
        .exclude(Exists(open_row))
        .values_list("id", flat=True)
    )
    count = 0
    for evaluation_id in stale:
        if requeue_evaluation(evaluation_id, reason="watchdog: no worker holds its evaluation job", now=now):
            count += 1
    return count
