"""Attempts: claim a cluster and its seats in one transaction, start it once every member accepted, close
it, and carry out what the coordinator decides during the prepare (cluster-jobs.md, Claim, Close,
Prepare and Start).

claim_cluster runs every step in one transaction, and the first statement that inserts nothing rolls the
whole transaction back:

1. the cluster_attempt row, inserted only while cluster_job.status = Queued; a conflict on
   idx-cluster_attempt-open inserts nothing (ON CONFLICT DO NOTHING), so that index arbitrates between
   server instances claiming one cluster;
2. every seat's idle slot is taken (a worker that went busy, drained or left since the snapshot no longer
   has it: the step is refused), then every member is claimed with the single claim's conditions (its
   own key, its own start condition, cluster_attempt set), whose conflict on idx-dispatched_job-open-job
   refuses a member open as a single job, with the member's own transition (a build goes Building with
   its BuildAttempt, an evaluation to Fetching or EvaluatingFlake with its record facts); the seat rows;
3. the cluster's record facts: cluster_attempt_opened and the hold's call deadline.

The dispatch pass claims all its placements as one set (claim_clusters): each step above is one set
statement for every cluster of the pass (scheduling.services.lifecycle's claim_builds_together and
claim_evaluations for the members, records' set append for the facts), in one savepoint; when some
cluster lost a step, the savepoint is rolled back and the set claimed again without it, so each
cluster's claim stays all or nothing. claim_cluster is a set of one.

A won claim pushes AssignJob with `cluster{attempt, role, index, hold_secs}` to every seat once committed.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Exists, F, OuterRef
from psycopg.types.json import Jsonb

from gradient.clusters import history
from gradient.clusters.decisions import coordinator
from gradient.clusters.decisions.coordinator import (
    AttemptAction,
    AttemptEvent,
    AttemptState,
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
from gradient.runtime.setsql import fixed_cursor
from gradient.scheduling.models import CandidateScore, DerivationBuild, DispatchedJob, Evaluation
from gradient.scheduling.selectors import member_eval_steps
from gradient.scheduling.services import lifecycle
from gradient.scheduling.services.claims import assignment_close
from gradient.scheduling.services.lifecycle import ClaimTerms, requeue_job
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


# Take every seat's idle slot in one statement (an assignment clears the slot): a slot is taken only while
# it is fresh and its worker connected, active and not draining; a build slot only while the worker's open
# build assignments leave it a slot (a RequestJob that went unanswered just before the worker was handed a
# job, a member pushed to it say, left a stale one behind). Returns the (worker, kind) of the slots taken.
_TAKE_IDLE_SLOTS = """
DELETE FROM idle_slot s
USING unnest(%(workers)s::uuid[], %(kinds)s::text[]) AS v(worker_id, kind), worker w
WHERE s.worker_id = v.worker_id AND s.kind = v.kind AND w.id = s.worker_id
    AND s.recorded_at >= %(fresh)s
    AND w.active
    AND EXISTS (SELECT 1 FROM worker_session ws
                WHERE ws.worker_id = s.worker_id AND ws.closed_at IS NULL AND NOT ws.draining)
    AND (s.kind <> %(build)s OR (
        SELECT count(*) FROM dispatched_job d
        WHERE d.worker_id = s.worker_id AND d.finished_at IS NULL AND d.kind = %(build)s
    ) < GREATEST(1, w.max_concurrent_builds))
RETURNING s.worker_id, s.kind
"""

# Every attempt of a set in one statement, each only while its cluster is Queued (its row locked, in id
# order) and has no open attempt (idx-cluster_attempt-open: a conflict inserts nothing).
_INSERT_ATTEMPTS = """
WITH req AS (
    SELECT * FROM unnest(%(clusters)s::uuid[], %(attempts)s::uuid[], %(deadlines)s::timestamptz[],
        %(seats)s::jsonb[]) AS r(cluster_id, attempt_id, deadline, seats)
), queued AS (
    SELECT c.id FROM cluster_job c
    WHERE c.id = ANY(%(clusters)s::uuid[]) AND c.status = %(queued)s
    ORDER BY c.id FOR NO KEY UPDATE
)
INSERT INTO cluster_attempt (id, cluster_job_id, number, created_at, prepare_deadline, reason, seats)
SELECT r.attempt_id, q.id,
       COALESCE((SELECT MAX(a.number) FROM cluster_attempt a WHERE a.cluster_job_id = q.id), 0) + 1,
       %(now)s, r.deadline, '', r.seats
FROM queued q JOIN req r ON r.cluster_id = q.id
ORDER BY q.id
ON CONFLICT (cluster_job_id) WHERE finished_at IS NULL DO NOTHING
RETURNING cluster_job_id, number
"""

_SCORES = """
SELECT cs.worker_id, cs.job_id, cs.missing_nar_size, cs.missing_count
FROM candidate_score cs JOIN unnest(%s::uuid[], %s::text[]) AS p(worker_id, job_id)
    ON cs.worker_id = p.worker_id AND cs.job_id = p.job_id
"""


@dataclass
class _Planned:
    """One placement of a set, checked and read: what its claim writes."""

    cluster_id: uuid.UUID
    attempt_id: uuid.UUID
    seats: list[Seat]
    members: dict[str, ClusterMember]
    state: AttemptState
    prepare_deadline: datetime
    number: int = 0
    assignments: dict[str, uuid.UUID] = field(default_factory=dict)
    jobs: dict[str, Job] = field(default_factory=dict)


@dataclass
class _Reads:
    """What a set of claims reads once, before its transaction: workers, scores and member jobs."""

    workers: dict[uuid.UUID, Worker]
    scores: dict[tuple[uuid.UUID, str], tuple[int | None, int | None]]
    evaluations: dict[uuid.UUID, Evaluation]
    builds: dict[uuid.UUID, DerivationBuild]


class _SetLost(Exception):
    """Some clusters of the set lost a step: roll the set back and claim again without them."""

    def __init__(self, lost: set[uuid.UUID]) -> None:
        super().__init__(f"{len(lost)} claims lost")
        self.lost = lost


def _read_for_claims(planned: Sequence[_Planned]) -> _Reads:
    seats = [(uuid.UUID(s.worker_id), s.job_key) for p in planned for s in p.seats]
    workers = {w.id: w for w in Worker.objects.filter(id__in=[w for w, _ in seats])}
    scores: dict[tuple[uuid.UUID, str], tuple[int | None, int | None]] = {}
    if seats and connection.vendor == "postgresql":
        with fixed_cursor() as cursor:
            cursor.execute(_SCORES, [[w for w, _ in seats], [k for _, k in seats]])
            for worker_id, job_id, nar, count in cursor.fetchall():
                scores[(worker_id, job_id)] = (nar, count)
    else:
        for score in CandidateScore.objects.filter(
            worker_id__in=[w for w, _ in seats], job_id__in=[k for _, k in seats]
        ):
            scores[(score.worker_id, score.job_id)] = (score.missing_nar_size, score.missing_count)
    evals: list[uuid.UUID] = []
    builds: list[uuid.UUID] = []
    for p in planned:
        for s in p.seats:
            kind, job_id = parse_member_key(s.job_key)
            (evals if kind == SlotKind.EVAL else builds).append(job_id)
    return _Reads(
        workers=workers,
        scores=scores,
        evaluations={e.id: e for e in Evaluation.objects.filter(id__in=evals)},
        builds={b.id: b for b in DerivationBuild.objects.filter(id__in=builds)},
    )


def _insert_attempts(planned: Sequence[_Planned], now: datetime) -> dict[uuid.UUID, int]:
    """The attempt rows of a set (see _INSERT_ATTEMPTS): cluster id -> the attempt's number, for those
    inserted."""
    if connection.vendor != "postgresql":
        numbers = {}
        for p in planned:
            number = _insert_attempt(
                cluster_id=p.cluster_id, attempt_id=p.attempt_id, now=now, deadline=p.prepare_deadline
            )
            if number is not None:
                ClusterAttempt.objects.filter(id=p.attempt_id).update(seats=[s.as_json() for s in p.seats])
                numbers[p.cluster_id] = number
        return numbers
    with fixed_cursor() as cursor:
        cursor.execute(
            _INSERT_ATTEMPTS,
            {
                "clusters": [p.cluster_id for p in planned],
                "attempts": [p.attempt_id for p in planned],
                "deadlines": [p.prepare_deadline for p in planned],
                "seats": [Jsonb([s.as_json() for s in p.seats]) for p in planned],
                "queued": ClusterStatus.QUEUED.value,
                "now": now,
            },
        )
        return {cluster_id: int(number) for cluster_id, number in cursor.fetchall()}


def _take_idle_slots(seats: Sequence[tuple[uuid.UUID, str]], now: datetime) -> set[tuple[uuid.UUID, str]]:
    """Consume the idle slot of every (worker, kind) seat that still has a usable one (_TAKE_IDLE_SLOTS);
    returns those taken."""
    if not seats:
        return set()
    fresh = now - timedelta(seconds=IDLE_SLOT_TTL_SECS)
    if connection.vendor != "postgresql":
        return {(w, k) for w, k in seats if _take_idle_slot(worker_id=w, kind=k, fresh=fresh)}
    with fixed_cursor() as cursor:
        cursor.execute(
            _TAKE_IDLE_SLOTS,
            {
                "workers": [w for w, _ in seats],
                "kinds": [k for _, k in seats],
                "fresh": fresh,
                "build": JobKind.BUILD.value,
            },
        )
        return {(worker_id, kind) for worker_id, kind in cursor.fetchall()}


def _take_idle_slot(*, worker_id: uuid.UUID, kind: str, fresh: datetime) -> bool:
    """_TAKE_IDLE_SLOTS for one seat, in the ORM (databases other than PostgreSQL)."""
    if kind == JobKind.BUILD:
        limit = Worker.objects.filter(id=worker_id).values_list("max_concurrent_builds", flat=True).first()
        running = DispatchedJob.objects.filter(
            worker_id=worker_id, kind=JobKind.BUILD, finished_at__isnull=True
        ).count()
        if limit is None or running >= max(1, limit):
            return False
    connected = WorkerSession.objects.filter(
        worker_id=OuterRef("worker_id"), closed_at__isnull=True, draining=False, worker__active=True
    )
    deleted, _ = (
        IdleSlot.objects.filter(worker_id=worker_id, kind=kind, recorded_at__gte=fresh)
        .filter(Exists(connected))
        .delete()
    )
    return deleted == 1


def _claim_set(planned: Sequence[_Planned], reads: _Reads, now: datetime) -> None:
    """Every step of every claim of the set, a set statement each, in the caller's savepoint: the
    attempts, the seats' idle slots, the members' claims and starts (lifecycle's set claims), the seat
    rows, the clusters' rows and their records. Raises _SetLost naming every cluster that lost a step
    (the caller rolls the whole set back and claims again without them); returns only when every
    cluster of the set won every step."""
    lost: set[uuid.UUID] = set()
    numbers = _insert_attempts(planned, now)
    lost |= {p.cluster_id for p in planned if p.cluster_id not in numbers}
    for p in planned:
        p.number = numbers.get(p.cluster_id, 0)
        if any(uuid.UUID(s.worker_id) not in reads.workers for s in p.seats):
            lost.add(p.cluster_id)  # a worker that is unknown
    live = [p for p in planned if p.cluster_id not in lost]
    wanted = [(p, s, *parse_member_key(s.job_key)) for p in live for s in p.seats]
    taken = _take_idle_slots([(uuid.UUID(s.worker_id), kind.value) for _, s, kind, _ in wanted], now)
    builds: list[tuple[DerivationBuild, uuid.UUID, ClaimTerms, uuid.UUID]] = []
    evaluations: list[lifecycle.EvaluationClaim] = []
    seat_of: dict[uuid.UUID, tuple[_Planned, Seat]] = {}
    for p, seat, kind, job_id in wanted:
        worker = reads.workers[uuid.UUID(seat.worker_id)]
        if (worker.id, kind.value) not in taken:
            lost.add(p.cluster_id)  # the worker went busy, drained or left since the snapshot
            continue
        nar, count = reads.scores.get((worker.id, seat.job_key), (None, None))
        terms = ClaimTerms(missing_nar_size=nar, missing_count=count, cluster_attempt_id=p.attempt_id)
        aid = uuid.uuid4()
        seat_of[aid] = (p, seat)
        if kind == SlotKind.EVAL:
            evaluation = reads.evaluations.get(job_id)
            if evaluation is None:
                lost.add(p.cluster_id)
                continue
            evaluations.append(
                lifecycle.EvaluationClaim(
                    evaluation=evaluation,
                    steps=member_eval_steps(evaluation),
                    worker_id=worker.id,
                    worker_name=worker.name,
                    reason=(
                        f"cluster {p.cluster_id} attempt {p.number}: {seat.role}[{seat.index}] "
                        f"held on {worker.name}"
                    ),
                    terms=terms,
                    assignment_id=aid,
                )
            )
        else:
            build = reads.builds.get(job_id)
            if build is None:
                lost.add(p.cluster_id)
                continue
            builds.append((build, worker.id, terms, aid))
    # The members of a cluster that lost already are not claimed: the set is claimed again without it.
    builds = [b for b in builds if seat_of[b[3]][0].cluster_id not in lost]
    evaluations = [e for e in evaluations if seat_of[e.assignment_id][0].cluster_id not in lost]
    won = lifecycle.claim_builds_together(builds=builds, now=now)
    won.update(lifecycle.claim_evaluations(claims=evaluations, now=now))
    for aid, (p, seat) in seat_of.items():
        if p.cluster_id in lost:
            continue
        claimed = won.get(aid)
        if claimed is None:
            lost.add(p.cluster_id)  # open elsewhere, or no longer Queued
            continue
        p.assignments[seat.job_key] = aid
        p.jobs[seat.job_key] = claimed.job
    if lost:
        raise _SetLost(lost)
    ClusterSeat.objects.bulk_create(
        [
            ClusterSeat(
                attempt_id=p.attempt_id,
                member=p.members[s.job_key],
                role=s.role,
                index=s.index,
                kind=parse_member_key(s.job_key)[0].value,
                job_key=s.job_key,
                worker_id=worker.id,
                zone=worker.zone or None,
                endpoint=worker.endpoint or None,
                assignment_id=p.assignments[s.job_key],
            )
            for p in planned
            for s in p.seats
            for worker in [reads.workers[uuid.UUID(s.worker_id)]]
        ]
    )
    ids = [p.cluster_id for p in planned]
    ClusterJob.objects.filter(id__in=ids).update(waiting_reason=None, waiting_since=None, updated_at=now)
    ClusterReservation.objects.filter(cluster_job_id__in=ids).delete()
    history.append_many(
        {
            p.cluster_id: history.attempt_opened_facts(
                attempt_id=p.attempt_id,
                number=p.number,
                seats=[(s.role, s.index, reads.workers[uuid.UUID(s.worker_id)].name) for s in p.seats],
                prepare_deadline=p.prepare_deadline,
            )
            for p in planned
        },
        now,
    )


def _planned(
    placements: Sequence[Placement],
    now: datetime,
    policy: CoordinatorPolicy,
    attempt_ids: Mapping[str, uuid.UUID],
) -> list[_Planned]:
    """Each placement checked against its cluster's members (a placement seats every member once, each
    on its own worker: ValueError otherwise), with its attempt begun by the coordinator. A cluster that
    is gone is left out."""
    ids = [uuid.UUID(p.cluster_id) for p in placements]
    failures = dict(ClusterJob.objects.filter(id__in=ids).values_list("id", "prepare_failures"))
    members: dict[uuid.UUID, dict[str, ClusterMember]] = {c: {} for c in ids}
    for m in ClusterMember.objects.filter(cluster_job_id__in=ids):
        members[m.cluster_job_id][m.job_key] = m
    planned = []
    for placement, cluster_id in zip(placements, ids, strict=True):
        if cluster_id not in failures:
            continue
        seats = sorted(placement.seats, key=lambda s: s.job_key)
        keys = [s.job_key for s in seats]
        if sorted(members[cluster_id]) != keys or len({s.worker_id for s in seats}) != len(seats):
            raise ValueError("a placement seats every member of its cluster once, each on its own worker")
        attempt_id = attempt_ids.get(placement.cluster_id) or uuid.uuid4()
        state, actions = coordinator.begin_attempt(
            placement,
            attempt_id=str(attempt_id),
            now=now,
            prepare_failures=failures[cluster_id],
            policy=policy,
        )
        claim = next(a for a in actions if isinstance(a, ClaimCluster))
        planned.append(
            _Planned(cluster_id, attempt_id, seats, members[cluster_id], state, claim.prepare_deadline)
        )
    return planned


def _split_first(planned: list[_Planned]) -> tuple[list[_Planned], list[_Planned]]:
    """The placements a set can claim together, and those to claim after them: a later placement of a
    cluster already in the set, or one seating a worker for a kind whose idle slot an earlier placement
    takes, must see what the earlier claim did, as claims one after the other would (the attempt open,
    the slot gone: lost; or, the earlier claim lost, free). A pass's placements never share a cluster
    nor a worker, so a pass is one set."""
    clusters: set[uuid.UUID] = set()
    slots: set[tuple[str, str]] = set()
    first, later = [], []
    for p in planned:
        wanted = {(s.worker_id, parse_member_key(s.job_key)[0].value) for s in p.seats}
        if p.cluster_id in clusters or wanted & slots:
            later.append(p)
            continue
        clusters.add(p.cluster_id)
        slots |= wanted
        first.append(p)
    return first, later


def claim_clusters(
    *,
    placements: Sequence[Placement],
    now: datetime,
    policy: CoordinatorPolicy | None = None,
    attempt_ids: Mapping[str, uuid.UUID] | None = None,
) -> dict[str, ClaimedAttempt | None]:
    """claim_cluster for every placement of a pass at once: each cluster's claim all or nothing, as
    claim_cluster's, and the set's writes a few set statements in all rather than a few dozen per
    cluster. The set is claimed in one savepoint; when a step of some cluster was refused, the savepoint
    is rolled back and the set claimed again without the clusters that lost (clusters of one set share
    no worker and no job, so one's loss changes nothing for another). Returns each placement's claimed
    attempt, or None for a lost claim (nothing of it written): the same outcomes as claim_cluster for
    each placement in turn. AssignJob goes to every seat of the won claims on commit. A placement that
    does not seat every member once on its own worker raises ValueError before anything is written."""
    policy = policy or coordinator_policy()
    results: dict[str, ClaimedAttempt | None] = {p.cluster_id: None for p in placements}
    pending = _planned(placements, now, policy, attempt_ids or {})
    reads = _read_for_claims(pending) if pending else None
    while pending:
        assert reads is not None
        remaining, pending = _split_first(pending)
        while remaining:
            try:
                with transaction.atomic():
                    _claim_set(remaining, reads, now)
                    for p in remaining:
                        results[str(p.cluster_id)] = _won(p, now, policy)
                break
            except _SetLost as lost:
                log.debug("claims of %d clusters lost; claiming the set again without them", len(lost.lost))
                for p in remaining:
                    p.assignments.clear()
                    p.jobs.clear()
                remaining = [p for p in remaining if p.cluster_id not in lost.lost]
    return results


def _won(p: _Planned, now: datetime, policy: CoordinatorPolicy) -> ClaimedAttempt:
    """A claim won: the coordinator's AssignJob to every seat, pushed once the transaction commits."""
    _, sends = coordinator.step(p.state, ClaimWon(), now, policy)
    pushes = [
        push(
            a.worker_id,
            assign_job_message(
                job_key=a.job_key,
                assignment_id=p.assignments[a.job_key],
                job=p.jobs[a.job_key],
                membership=a.cluster,
            ),
        )
        for a in sends
        if isinstance(a, SendAssignJob)
    ]
    return ClaimedAttempt(p.attempt_id, p.number, dict(p.assignments), pushes)


def claim_cluster(
    *,
    placement: Placement,
    now: datetime,
    attempt_id: uuid.UUID | None = None,
    policy: CoordinatorPolicy | None = None,
) -> ClaimedAttempt | None:
    """Claim the cluster and every seat of `placement` in one transaction (a set of one: claim_clusters).
    Returns the claimed attempt, or None (false) when any step was refused: then nothing at all was
    written, and the members go back to the assignment passes, which re-read their cluster. AssignJob
    goes to every seat on commit."""
    ids = {placement.cluster_id: attempt_id} if attempt_id is not None else {}
    claimed = claim_clusters(placements=[placement], now=now, policy=policy, attempt_ids=ids)
    return claimed[placement.cluster_id]


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
