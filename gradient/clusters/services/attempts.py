"""Attempts: claim a cluster and its seats in one transaction, start it once every member accepted, close
it, and carry out what the coordinator decides during the prepare (cluster-jobs.md, Claim, Close,
Prepare and Start).

claim_cluster runs every step in one transaction, and the first statement that inserts nothing rolls the
whole transaction back:

1. the cluster_attempt row, inserted only while cluster_job.status = Queued; a conflict on
   idx-cluster_attempt-open inserts nothing (ON CONFLICT DO NOTHING), so that index arbitrates between
   server instances claiming one cluster;
2. per seat (in job-key order): the seat's idle slot is taken (a worker that went busy, drained or left
   since the snapshot no longer has it: the step is refused), then the member is claimed with the single
   claim (claim_assignment: its own key, its own start condition, cluster_attempt set), whose conflict on
   idx-dispatched_job-open-job refuses a member open as a single job; then the member's own transition
   (a build goes Building with its BuildAttempt, an evaluation to Fetching or EvaluatingFlake with its
   record facts) and its seat row;
3. the cluster's record facts: cluster_attempt_opened and the hold's call deadline.

A won claim pushes AssignJob with `cluster{attempt, role, index, hold_secs}` to every seat once committed.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Exists, F, OuterRef

from gradient.clusters import history
from gradient.clusters.decisions import coordinator
from gradient.clusters.decisions.coordinator import (
    AttemptAction,
    AttemptEvent,
    ClaimCluster,
    ClaimWon,
    ClosePrepareFailed,
    CoordinatorPolicy,
    ParkCluster,
    PenaliseWorker,
    PrepareTimedOut,
    ScheduleRetry,
    SendAbortCluster,
    SendAssignJob,
    SendStartCluster,
    StartAttempt,
)
from gradient.clusters.decisions.matcher import IDLE_SLOT_TTL_SECS
from gradient.clusters.decisions.types import Placement, Seat, SlotKind, WaitingCode, WaitingReason
from gradient.clusters.models import (
    ClusterAttempt,
    ClusterJob,
    ClusterMember,
    ClusterReservation,
    ClusterSeat,
    ClusterWorkerPenalty,
)
from gradient.clusters.services.common import (
    Push,
    abort_cluster_message,
    assign_job_message,
    attempt_seats,
    attempt_state,
    coordinator_policy,
    lock_cluster,
    push,
    start_cluster_message,
)
from gradient.core.jobkey import SINGLE_JOB_KEYS, JobKey
from gradient.core.protocol import Job
from gradient.core.vocab import AttemptOutcome, ClusterStatus, DispatchOutcome, JobKind, member_of
from gradient.scheduling.models import CandidateScore, DerivationBuild, DispatchedJob, Evaluation
from gradient.scheduling.selectors import member_eval_steps
from gradient.scheduling.services import lifecycle
from gradient.scheduling.services.claims import assignment_close
from gradient.scheduling.services.lifecycle import Claimed, ClaimTerms, requeue_job
from gradient.workers.models import IdleSlot, Worker, WorkerSession

log = logging.getLogger("gradient.clusters")


@dataclass(frozen=True)
class ClaimedAttempt:
    """A won claim: the attempt, its claim number, each member's assignment id, the AssignJob pushes."""

    attempt_id: uuid.UUID
    number: int
    assignments: dict[str, uuid.UUID]
    pushes: list[Push] = field(default_factory=list)


class _ClaimLost(Exception):
    """A statement inserted (or changed) nothing: roll the whole claim back."""


def parse_member_key(job_key: str) -> tuple[JobKind, uuid.UUID]:
    """A member's job key as (kind, id); a key that is not a single job's raises JobKeyError."""
    key = JobKey.require(job_key, kinds=SINGLE_JOB_KEYS)
    assert key.job_kind is not None  # a single job's key has a job kind
    return key.job_kind, key.id


_INSERT_ATTEMPT = """
WITH queued AS (
    SELECT id FROM cluster_job WHERE id = %s AND status = %s {lock}
)
INSERT INTO cluster_attempt (id, cluster_job_id, number, created_at, prepare_deadline, reason, seats)
SELECT %s, queued.id,
       COALESCE((SELECT MAX(number) FROM cluster_attempt WHERE cluster_job_id = queued.id), 0) + 1,
       %s, %s, '', %s
FROM queued WHERE true
ON CONFLICT (cluster_job_id) WHERE finished_at IS NULL DO NOTHING
RETURNING number
"""


def _prep(model: type[ClusterAttempt], name: str, value: object) -> Any:
    return model._meta.get_field(name).get_db_prep_save(value, connection)  # type: ignore[union-attr]


def _insert_attempt(
    *, cluster_id: uuid.UUID, attempt_id: uuid.UUID, now: datetime, deadline: datetime
) -> int | None:
    """The attempt row, only while the cluster is Queued and has no open attempt; its number or None.
    On PostgreSQL the cluster row is locked by the same statement, so nothing changes the cluster's
    status until this claim commits or rolls back."""
    lock = "FOR NO KEY UPDATE" if connection.vendor == "postgresql" else ""
    params = [
        _prep(ClusterAttempt, "cluster_job_id", cluster_id),
        ClusterStatus.QUEUED.value,
        _prep(ClusterAttempt, "id", attempt_id),
        _prep(ClusterAttempt, "created_at", now),
        _prep(ClusterAttempt, "prepare_deadline", deadline),
        _prep(ClusterAttempt, "seats", []),
    ]
    with connection.cursor() as cursor:
        cursor.execute(_INSERT_ATTEMPT.format(lock=lock), params)
        row = cursor.fetchone()
    return int(row[0]) if row is not None else None


def _take_idle_slot(*, worker_id: uuid.UUID, kind: str, now: datetime) -> bool:
    """Consume the seat's idle slot (an assignment clears the slot). False when the worker went busy,
    drained or disconnected since the snapshot: its slot is gone or stale. A build slot of a worker whose
    build slots are all taken is stale too: a RequestJob that went unanswered just before the worker was
    handed a job (a member pushed to it, say) left it behind."""
    if kind == "build":
        limit = Worker.objects.filter(id=worker_id).values_list("max_concurrent_builds", flat=True).first()
        running = DispatchedJob.objects.filter(
            worker_id=worker_id, kind="build", finished_at__isnull=True
        ).count()
        if limit is None or running >= max(1, limit):
            IdleSlot.objects.filter(worker_id=worker_id, kind=kind).delete()
            return False
    connected = WorkerSession.objects.filter(
        worker_id=OuterRef("worker_id"), closed_at__isnull=True, draining=False, worker__active=True
    )
    deleted, _ = (
        IdleSlot.objects.filter(
            worker_id=worker_id, kind=kind, recorded_at__gte=now - timedelta(seconds=IDLE_SLOT_TTL_SECS)
        )
        .filter(Exists(connected))
        .delete()
    )
    return deleted == 1


def claim_cluster(
    *,
    placement: Placement,
    now: datetime,
    attempt_id: uuid.UUID | None = None,
    policy: CoordinatorPolicy | None = None,
) -> ClaimedAttempt | None:
    """Claim the cluster and every seat of `placement` in one transaction. Returns the claimed attempt,
    or None (false) when any step was refused: then nothing at all was written, and the members go back
    to the assignment passes, which re-read their cluster. AssignJob goes to every seat on commit."""
    policy = policy or coordinator_policy()
    attempt_id = attempt_id or uuid.uuid4()
    cluster_id = uuid.UUID(placement.cluster_id)
    cluster = ClusterJob.objects.filter(id=cluster_id).first()
    if cluster is None:
        return None
    members = {m.job_key: m for m in ClusterMember.objects.filter(cluster_job_id=cluster_id)}
    seats = sorted(placement.seats, key=lambda s: s.job_key)
    if sorted(members) != [s.job_key for s in seats] or len({s.worker_id for s in seats}) != len(seats):
        raise ValueError("a placement seats every member of its cluster once, each on its own worker")
    state, actions = coordinator.begin_attempt(
        placement,
        attempt_id=str(attempt_id),
        now=now,
        prepare_failures=cluster.prepare_failures,
        policy=policy,
    )
    claim = next(a for a in actions if isinstance(a, ClaimCluster))
    try:
        with transaction.atomic():
            number = _insert_attempt(
                cluster_id=cluster_id, attempt_id=attempt_id, now=now, deadline=claim.prepare_deadline
            )
            if number is None:
                raise _ClaimLost("the cluster is not Queued or already has an open attempt")
            workers = {w.id: w for w in Worker.objects.filter(id__in=[uuid.UUID(s.worker_id) for s in seats])}
            assignments: dict[str, uuid.UUID] = {}
            jobs_sent: dict[str, Job] = {}
            for seat in seats:
                worker = workers.get(uuid.UUID(seat.worker_id))
                if worker is None:
                    raise _ClaimLost(f"worker {seat.worker_id} is unknown")
                aid, job = _claim_seat(
                    seat=seat,
                    member=members[seat.job_key],
                    worker=worker,
                    attempt_id=attempt_id,
                    cluster_id=cluster_id,
                    number=number,
                    now=now,
                )
                assignments[seat.job_key] = aid
                jobs_sent[seat.job_key] = job
            ClusterAttempt.objects.filter(id=attempt_id).update(seats=[s.as_json() for s in seats])
            ClusterJob.objects.filter(id=cluster_id).update(
                waiting_reason=None, waiting_since=None, updated_at=now
            )
            ClusterReservation.objects.filter(cluster_job_id=cluster_id).delete()
            history.attempt_opened(
                cluster_id=cluster_id,
                attempt_id=attempt_id,
                number=number,
                seats=[(s.role, s.index, workers[uuid.UUID(s.worker_id)].name) for s in seats],
                prepare_deadline=claim.prepare_deadline,
                now=now,
            )
            _, sends = coordinator.step(state, ClaimWon(), now, policy)
            pushes = [
                push(
                    a.worker_id,
                    assign_job_message(
                        job_key=a.job_key,
                        assignment_id=assignments[a.job_key],
                        job=jobs_sent[a.job_key],
                        membership=a.cluster,
                    ),
                )
                for a in sends
                if isinstance(a, SendAssignJob)
            ]
            return ClaimedAttempt(attempt_id, number, assignments, pushes)
    except _ClaimLost as lost:
        log.debug("claim of cluster %s lost: %s", cluster_id, lost)
        return None


def _claim_seat(
    *,
    seat: Seat,
    member: ClusterMember,
    worker: Worker,
    attempt_id: uuid.UUID,
    cluster_id: uuid.UUID,
    number: int,
    now: datetime,
) -> tuple[uuid.UUID, Job]:
    kind, job_id = parse_member_key(seat.job_key)
    if not _take_idle_slot(worker_id=worker.id, kind=kind.value, now=now):
        raise _ClaimLost(f"{worker.name} is no longer idle for {kind.value}")
    score = CandidateScore.objects.filter(worker_id=worker.id, job_id=seat.job_key).first()
    terms = ClaimTerms(
        missing_nar_size=score.missing_nar_size if score else None,
        missing_count=score.missing_count if score else None,
        cluster_attempt_id=attempt_id,
    )
    claimed: Claimed | None
    if kind == SlotKind.EVAL:
        evaluation = Evaluation.objects.filter(id=job_id).first()
        if evaluation is None:
            raise _ClaimLost(f"evaluation {job_id} is gone")
        claimed = lifecycle.claim_evaluation(
            evaluation=evaluation,
            steps=member_eval_steps(evaluation),
            worker_id=worker.id,
            worker_name=worker.name,
            reason=f"cluster {cluster_id} attempt {number}: {seat.role}[{seat.index}] held on {worker.name}",
            now=now,
            terms=terms,
        )
    else:
        build = DerivationBuild.objects.filter(id=job_id).first()
        if build is None:
            raise _ClaimLost(f"build {job_id} is gone")
        claimed = lifecycle.claim_build(build=build, worker_id=worker.id, now=now, terms=terms)
    if claimed is None:
        raise _ClaimLost(f"{seat.job_key} is open elsewhere or no longer Queued")
    assignment_id = claimed.assignment_id
    ClusterSeat.objects.create(
        attempt_id=attempt_id,
        member=member,
        role=seat.role,
        index=seat.index,
        kind=kind.value,
        job_key=seat.job_key,
        worker_id=worker.id,
        zone=worker.zone or None,
        endpoint=worker.endpoint or None,
        assignment_id=assignment_id,
    )
    return assignment_id, claimed.job


# --- Start and close ------------------------------------------------------------------------------------


class _NotStarted(Exception):
    pass


def start_cluster_attempt(*, attempt_id: uuid.UUID, now: datetime) -> bool:
    """Every member accepted: the attempt starts and the cluster goes Running, its started attempts + 1
    and its consecutive prepare failures reset. False, changing nothing, unless the attempt is open and
    unstarted and its cluster Queued."""
    cluster_id = ClusterAttempt.objects.filter(id=attempt_id).values_list("cluster_job_id", flat=True).first()
    if cluster_id is None:
        return False
    try:
        with transaction.atomic():
            started = ClusterAttempt.objects.filter(
                id=attempt_id, finished_at__isnull=True, started_at__isnull=True
            ).update(started_at=now)
            if started != 1:
                raise _NotStarted
            running = ClusterJob.objects.filter(id=cluster_id, status=ClusterStatus.QUEUED).update(
                status=ClusterStatus.RUNNING,
                attempts=F("attempts") + 1,
                prepare_failures=0,
                retry_at=None,
                waiting_reason=None,
                waiting_since=None,
                updated_at=now,
            )
            if running != 1:
                raise _NotStarted
            history.attempt_started(
                cluster_id=cluster_id, attempt_id=attempt_id, reason="every member accepted", now=now
            )
    except _NotStarted:
        return False
    return True


def close_cluster_attempt(
    *, attempt_id: uuid.UUID, outcome: str, reason: str, now: datetime, verdict: str | None = None
) -> bool:
    """Close the attempt with `outcome` while it is open, marking every open member row Abandoned in the
    same transaction. A second close (a prepare timeout racing a member failure) returns False and
    touches nothing. The member jobs themselves are the caller's to requeue or settle."""
    if member_of(AttemptOutcome, outcome) is None:
        raise ValueError(f"unknown attempt outcome {outcome!r}")
    with transaction.atomic():
        cluster_id = (
            ClusterAttempt.objects.filter(id=attempt_id).values_list("cluster_job_id", flat=True).first()
        )
        if cluster_id is None:
            return False
        closed = ClusterAttempt.objects.filter(id=attempt_id, finished_at__isnull=True).update(
            finished_at=now, outcome=outcome, reason=reason[:2000], verdict=verdict
        )
        if closed != 1:
            return False
        open_rows = DispatchedJob.objects.filter(cluster_attempt_id=attempt_id, finished_at__isnull=True)
        for row in open_rows.order_by("job_id"):
            assignment_close(
                row=row,
                outcome=DispatchOutcome.ABANDONED,
                reason=f"cluster attempt {outcome}: {reason}",
                now=now,
            )
        history.attempt_closed(
            cluster_id=cluster_id,
            attempt_id=attempt_id,
            outcome=outcome,
            verdict=verdict,
            reason=reason,
            now=now,
        )
    return True


def member_rows(attempt_id: uuid.UUID) -> list[DispatchedJob]:
    return list(DispatchedJob.objects.filter(cluster_attempt_id=attempt_id).order_by("job_id"))


def requeue_members(*, attempt_id: uuid.UUID, reason: str, now: datetime) -> None:
    """After a failed prepare (or a Retry): every member job goes back to the assignment passes, without
    spending a build attempt; through the cluster book, never as a single job."""
    for row in member_rows(attempt_id):
        requeue_job(row, now=now, refund=True, reason=reason)


# --- The coordinator's actions --------------------------------------------------------------------------


def apply_attempt_actions(
    *, cluster: ClusterJob, attempt: ClusterAttempt, actions: Sequence[AttemptAction], now: datetime
) -> list[Push]:
    """Carry out what coordinator.step decided, in order, in the caller's transaction (which holds the
    cluster lock). Messages go out once it commits."""
    pushes: list[Push] = []
    for action in actions:
        if isinstance(action, StartAttempt):
            if not start_cluster_attempt(attempt_id=attempt.id, now=now):
                log.warning("attempt %s could not start", attempt.id)
                return pushes
        elif isinstance(action, SendStartCluster):
            message = start_cluster_message(action.attempt_id, action.roster)
            pushes.extend(push(w, message) for w in action.worker_ids)
        elif isinstance(action, ClosePrepareFailed):
            if not close_cluster_attempt(
                attempt_id=attempt.id, outcome=AttemptOutcome.PREPARE_FAILED, reason=action.reason, now=now
            ):
                return pushes  # closed already: the other closer did the rest
            requeue_members(attempt_id=attempt.id, reason=f"cluster prepare failed: {action.reason}", now=now)
        elif isinstance(action, SendAbortCluster):
            abort = abort_cluster_message(action.attempt_id, action.reason)
            pushes.extend(push(w, abort) for w in action.worker_ids)
        elif isinstance(action, PenaliseWorker):
            ClusterWorkerPenalty.objects.create(
                worker_id=uuid.UUID(action.worker_id),
                at=action.at,
                reason=action.reason[:2000],
                attempt_id=attempt.id,
            )
        elif isinstance(action, ScheduleRetry):
            reason = WaitingReason(
                WaitingCode.BACKOFF, until=action.retry_at, prepare_failures=action.prepare_failures
            )
            ClusterJob.objects.filter(id=cluster.id).update(
                retry_at=action.retry_at,
                prepare_failures=action.prepare_failures,
                waiting_reason=reason.as_json(),
                waiting_since=now,
                updated_at=now,
            )
        elif isinstance(action, ParkCluster):
            ClusterJob.objects.filter(id=cluster.id).update(
                retry_at=None,
                prepare_failures=action.prepare_failures,
                waiting_reason=action.waiting_reason.as_json(),
                waiting_since=now,
                updated_at=now,
            )
    return pushes


def attempt_event(
    *, cluster: ClusterJob, attempt: ClusterAttempt, event: AttemptEvent, now: datetime
) -> list[Push]:
    """Feed one prepare event to the coordinator and carry out what it decides (caller holds the lock)."""
    state = attempt_state(cluster, attempt, attempt_seats(attempt.id))
    _, actions = coordinator.step(state, event, now, coordinator_policy())
    return apply_attempt_actions(cluster=cluster, attempt=attempt, actions=actions, now=now)


def expire_overdue_prepares(*, now: datetime) -> int:
    """Close every prepare past its deadline PrepareFailed (AbortCluster to its members, backoff): the
    dispatch pass does this before placing anything. Returns how many it closed."""
    overdue = list(
        ClusterAttempt.objects.filter(
            finished_at__isnull=True, started_at__isnull=True, prepare_deadline__lte=now
        ).values_list("id", "cluster_job_id")
    )
    expired = 0
    for attempt_id, cluster_id in overdue:
        with transaction.atomic():
            cluster = lock_cluster(cluster_id)
            attempt = ClusterAttempt.objects.filter(id=attempt_id).first()
            if cluster is None or attempt is None or attempt.finished_at is not None:
                continue
            if attempt.started_at is not None:
                continue
            attempt_event(cluster=cluster, attempt=attempt, event=PrepareTimedOut(), now=now)
            attempt.refresh_from_db(fields=["finished_at"])
            expired += int(attempt.finished_at is not None)
    return expired
