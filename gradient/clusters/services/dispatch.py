"""The cluster-dispatch pass (every GRADIENT_SCHEDULER_PASS_INTERVAL_SECS, and at once when a RequestJob
goes unanswered): expire overdue prepares first, load one snapshot (the cluster book, connected workers
with their sessions, idle slots, candidate scores, penalties, the reservation), let the planner place
every cluster able to start, claim each placement, then let the reservation step reserve, commit or
release, and record each waiting cluster's reason when it changed.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, connection, transaction

from gradient.clusters.decisions import reservation as reservations
from gradient.clusters.decisions.matcher import PoolIndex
from gradient.clusters.decisions.planner import plan_pass
from gradient.clusters.decisions.reservation import Commit, Release, ReservationInputs, Reserve
from gradient.clusters.decisions.types import Placement, Reservation, WaitingReason
from gradient.clusters.models import ClusterJob, ClusterReservation, ClusterWorkerPenalty
from gradient.clusters.selectors import (
    clusters_wait_for_placement,
    dispatch_pool,
    queued_clusters,
    reservation_state,
)
from gradient.clusters.services.attempts import claim_cluster, claim_clusters, expire_overdue_prepares
from gradient.clusters.services.common import planner_policy, reservation_policy
from gradient.core.vocab import ClusterStatus
from gradient.runtime.passes import pass_run
from gradient.runtime.setsql import fixed_cursor

log = logging.getLogger("gradient.clusters")

PASS_NAME = "cluster-dispatch"


@dataclass
class DispatchPassResult:
    expired: int = 0
    clusters: int = 0
    placed: int = 0
    claims_lost: int = 0
    reserved: int = 0
    committed: int = 0
    released: int = 0
    waiting: int = 0
    reasons_written: int = 0
    release_reasons: list[str] = field(default_factory=list)


def _claim(placement: Placement, now: datetime) -> bool:
    try:
        return claim_cluster(placement=placement, now=now) is not None
    except Exception:  # one broken cluster must not stop the pass; the next pass tries again
        log.exception("claiming cluster %s failed", placement.cluster_id)
        return False


def _claim_all(placements: list[Placement], now: datetime) -> set[str]:
    """Claim every placement of the pass as one set (claim_clusters); the ids of the clusters claimed.
    Should the set fail as a whole (a broken cluster), each is claimed on its own instead, so that one
    broken cluster does not stop the others."""
    if not placements:
        return set()
    try:
        claimed = claim_clusters(placements=placements, now=now)
    except Exception:
        log.exception("claiming %d clusters as a set failed; claiming them one by one", len(placements))
        return {p.cluster_id for p in placements if _claim(p, now)}
    return {cluster_id for cluster_id, attempt in claimed.items() if attempt is not None}


def _reserve(reservation: Reservation) -> bool:
    try:
        with transaction.atomic():
            ClusterReservation.objects.create(
                cluster_job_id=uuid.UUID(reservation.cluster_id),
                seats=[s.as_json() for s in reservation.seats],
                created_at=reservation.created_at,
                expires_at=reservation.expires_at,
            )
    except IntegrityError:  # idx-cluster_reservation-one: another reservation is in force
        return False
    return True


# Every waiting cluster's reason in one statement, written only where its JSON changed and only while the
# cluster is Queued; waiting_since starts when a cluster had no reason before.
_WRITE_WAITING_REASONS = """
UPDATE cluster_job c SET
    waiting_reason = v.reason,
    waiting_since = CASE WHEN c.waiting_reason IS NULL THEN %(now)s ELSE c.waiting_since END,
    updated_at = %(now)s
FROM json_to_recordset(%(reasons)s::json) AS v(id uuid, reason jsonb)
WHERE c.id = v.id AND c.status = %(queued)s AND c.waiting_reason IS DISTINCT FROM v.reason
"""


def write_waiting_reasons(*, reasons: dict[str, WaitingReason], now: datetime) -> int:
    """Record each Queued cluster's waiting reason, only where its JSON changed. Returns how many."""
    if not reasons:
        return 0
    if connection.vendor == "postgresql":
        document = json.dumps(
            [{"id": cluster_id, "reason": reason.as_json()} for cluster_id, reason in sorted(reasons.items())]
        )
        with fixed_cursor() as cursor:
            cursor.execute(
                _WRITE_WAITING_REASONS,
                {"reasons": document, "queued": ClusterStatus.QUEUED.value, "now": now},
            )
            return int(cursor.rowcount)
    ids = [uuid.UUID(c) for c in reasons]
    current = dict(
        ClusterJob.objects.filter(id__in=ids, status=ClusterStatus.QUEUED).values_list("id", "waiting_reason")
    )
    written = 0
    for cluster_id, previous in current.items():
        reason = reasons[str(cluster_id)].as_json()
        if reason == previous:
            continue
        updates: dict[str, Any] = {"waiting_reason": reason, "updated_at": now}
        if previous is None:
            updates["waiting_since"] = now
        written += ClusterJob.objects.filter(id=cluster_id, status=ClusterStatus.QUEUED).update(**updates)
    return written


def cluster_dispatch_pass(*, now: datetime) -> DispatchPassResult:
    result = DispatchPassResult(expired=expire_overdue_prepares(now=now))
    planner = planner_policy()
    clusters = queued_clusters(now=now)
    result.clusters = len(clusters)
    pool = dispatch_pool(
        job_keys=[m.job_key for c in clusters for m in c.members], now=now, policy=planner.match
    )
    index = PoolIndex(pool, now, planner.match)
    held = reservation_state()
    plan = plan_pass(clusters, pool, now, reservation=held, policy=planner, index=index)

    seated: set[str] = set()
    for placement in plan.placements:
        seated |= placement.worker_ids
    claimed = _claim_all(list(plan.placements), now)
    result.placed = len(claimed)
    result.claims_lost = len(plan.placements) - len(claimed)

    inputs = ReservationInputs(
        clusters=tuple(clusters), pool=pool, candidate=plan.reserve, seated=frozenset(seated)
    )
    _, actions = reservations.step(held, inputs, now, reservation_policy(), index=index)
    for action in actions:
        if isinstance(action, Reserve):
            result.reserved += int(_reserve(action.reservation))
        elif isinstance(action, Commit):
            ClusterReservation.objects.filter(cluster_job_id=uuid.UUID(action.placement.cluster_id)).delete()
            if _claim(action.placement, now):
                result.committed += 1
                claimed.add(action.placement.cluster_id)
            else:
                result.claims_lost += 1
        elif isinstance(action, Release):
            ClusterReservation.objects.filter(cluster_job_id=uuid.UUID(action.cluster_id)).delete()
            result.released += 1
            result.release_reasons.append(action.reason.value)

    waiting = {cid: reason for cid, reason in plan.waiting.items() if cid not in claimed}
    result.waiting = len(waiting)
    result.reasons_written = write_waiting_reasons(reasons=waiting, now=now)
    ClusterWorkerPenalty.objects.filter(
        at__lt=now - timedelta(seconds=planner.match.penalty_window_secs)
    ).delete()
    return result


def cluster_dispatch_kick(now: datetime) -> dict[str, Any] | None:
    """Run the dispatch pass at once (a RequestJob went unanswered), under the pass's lease: when another
    runner holds it, that run places the cluster and this returns None."""
    return pass_run(name=PASS_NAME, body=lambda: asdict(cluster_dispatch_pass(now=now)), lease_secs=60)


def cluster_idle_kick(now: datetime) -> None:
    """A RequestJob went unanswered: a new idle slot. When a cluster waits to be placed, run the
    dispatch pass at once (under its lease; skipped when another runner holds it). Its AssignJobs leave
    through the outbox on commit. One cheap query when nothing waits."""
    if clusters_wait_for_placement(now=now):
        cluster_dispatch_kick(now)
