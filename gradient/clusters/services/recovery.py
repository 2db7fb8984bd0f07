"""Startup recovery of clusters (reference notes, in order): close unstarted open attempts
PrepareFailed, then started ones Aborted; Running clusters with a dead member become Aborted; Running
clusters whose budget is spent become Failed; the remaining Running clusters become Queued (members
requeued); Queued clusters with a dead member are aborted. settlement.recover_clusters decides; this
applies its plan, each step in its own transaction.

Several servers may share one database: an open attempt every seat of which is on a worker still
connected to a live server (`live_worker_ids`) is that server's to finish, and its cluster is left alone.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime

from django.db import transaction
from django.db.models import Q

from gradient.clusters.decisions.settlement import (
    AttemptClose,
    ClusterChange,
    MemberSettlement,
    OpenAttempt,
    RecoveringCluster,
    Verdict,
    recover_clusters,
)
from gradient.clusters.decisions.types import ClusterStatus as ClusterState
from gradient.clusters.models import ClusterAttempt, ClusterJob, ClusterMember, ClusterSeat
from gradient.clusters.services.attempts import close_cluster_attempt, requeue_members
from gradient.clusters.services.common import abort_cluster_message, abort_job_message, lock_cluster, push
from gradient.clusters.services.settle import (
    abort_member_job,
    job_statuses,
    member_is_dead,
    set_cluster_status,
)
from gradient.core.vocab import AttemptOutcome, ClusterStatus
from gradient.scheduling.models import DispatchedJob
from gradient.scheduling.services.lifecycle import requeue_job

_VERDICT = {
    ClusterStatus.ABORTED: Verdict.ABORT,
    ClusterStatus.FAILED: Verdict.FAIL,
    ClusterStatus.QUEUED: Verdict.RETRY,
}


@dataclass
class ClusterRecoveryResult:
    closed: int = 0
    changed: dict[str, int] = field(default_factory=dict)
    left_to_live_servers: int = 0


def recover_clusters_at_startup(
    *, now: datetime, live_worker_ids: Collection[uuid.UUID | str] = ()
) -> ClusterRecoveryResult:
    live = {str(w) for w in live_worker_ids}
    result = ClusterRecoveryResult()
    open_attempts = {
        a.cluster_job_id: a
        for a in ClusterAttempt.objects.filter(finished_at__isnull=True).order_by("created_at")
    }
    seats: dict[uuid.UUID, set[str]] = {}
    for attempt_id, worker_id in ClusterSeat.objects.filter(
        attempt_id__in=[a.id for a in open_attempts.values()]
    ).values_list("attempt_id", "worker_id"):
        seats.setdefault(attempt_id, set()).add(str(worker_id))
    clusters = list(
        ClusterJob.objects.filter(
            Q(status__in=[ClusterStatus.QUEUED, ClusterStatus.RUNNING]) | Q(id__in=list(open_attempts))
        )
    )
    members = list(ClusterMember.objects.filter(cluster_job_id__in=[c.id for c in clusters]))
    statuses = job_statuses([m.job_key for m in members])
    dead = {m.cluster_job_id for m in members if member_is_dead(m.job_key, statuses.get(m.job_key))}

    snapshot: list[RecoveringCluster] = []
    for c in clusters:
        attempt = open_attempts.get(c.id)
        if attempt is not None and seats.get(attempt.id) and seats[attempt.id] <= live:
            result.left_to_live_servers += 1
            continue
        snapshot.append(
            RecoveringCluster(
                cluster_id=str(c.id),
                status=ClusterState(c.status),
                attempts=c.attempts,
                retry_budget=c.retry_budget,
                has_dead_member=c.id in dead,
                open_attempt=OpenAttempt(str(attempt.id), attempt.started_at is not None)
                if attempt
                else None,
            )
        )
    plan = recover_clusters(snapshot)
    for close in plan.closes:
        result.closed += int(_close(close, now))
    for change in plan.changes:
        if _change(change, now):
            result.changed[change.status_to.value] = result.changed.get(change.status_to.value, 0) + 1
    return result


def _close(close: AttemptClose, now: datetime) -> bool:
    attempt_id = uuid.UUID(close.attempt_id)
    with transaction.atomic():
        if lock_cluster(uuid.UUID(close.cluster_id)) is None:
            return False
        open_rows = list(
            DispatchedJob.objects.filter(cluster_attempt_id=attempt_id, finished_at__isnull=True)
        )
        for row in open_rows:  # a worker still connected elsewhere stops what it holds or runs
            push(row.worker_id, abort_job_message(row.job_id, row.id, close.reason))
        for worker_id in {r.worker_id for r in open_rows}:
            push(worker_id, abort_cluster_message(close.attempt_id, close.reason))
        if not close_cluster_attempt(
            attempt_id=attempt_id,
            outcome=close.outcome.value,
            reason=close.reason,
            now=now,
            verdict=Verdict.ABORT.value if close.outcome.value == AttemptOutcome.ABORTED else None,
        ):
            return False
        if close.outcome.value == AttemptOutcome.PREPARE_FAILED:
            requeue_members(attempt_id=attempt_id, reason=close.reason, now=now)
    return True


def _change(change: ClusterChange, now: datetime) -> bool:
    cluster_id = uuid.UUID(change.cluster_id)
    with transaction.atomic():
        cluster = lock_cluster(cluster_id)
        if cluster is None or cluster.status != change.status_from.value:
            return False
        latest: dict[str, DispatchedJob] = {}
        for row in DispatchedJob.objects.filter(cluster_attempt__cluster_job_id=cluster_id).order_by(
            "dispatched_at"
        ):
            latest[row.job_id] = row
        for member in ClusterMember.objects.filter(cluster_job_id=cluster_id).order_by("role", "index"):
            last = latest.get(member.job_key)
            if change.members == MemberSettlement.REQUEUED:
                if last is not None:
                    requeue_job(last, now=now, refund=True, reason=change.reason)
            else:
                abort_member_job(job_key=member.job_key, row=last, reason=change.reason, now=now)
        set_cluster_status(
            cluster=cluster,
            verdict=_VERDICT[ClusterStatus(change.status_to.value)],
            reason=change.reason,
            now=now,
        )
    return True
