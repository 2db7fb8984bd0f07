"""Reads of the clusters app: the cluster book and the pool the dispatch pass plans over, memberships
for the assignment passes, what the sweeps must skip, and whether a seat is reserved."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.db import connection
from django.db.models import Exists, OuterRef, Q

from gradient.clusters.decisions.matcher import MatchPolicy
from gradient.clusters.decisions.reservation import is_reserved
from gradient.clusters.decisions.types import (
    Cluster,
    Member,
    Penalty,
    Pool,
    Reservation,
    ReservedSeat,
    SlotSnapshot,
    WorkerSnapshot,
)
from gradient.clusters.models import (
    ClusterAttempt,
    ClusterJob,
    ClusterMember,
    ClusterReservation,
    ClusterWorkerPenalty,
)
from gradient.core.ids import parse_uuid
from gradient.core.jobkey import SINGLE_JOB_KEYS, JobKey, build_key, eval_key
from gradient.core.vocab import (
    EVALUATION_ACTIVE,
    PROTOCOL_JOB_KINDS,
    BuildStatus,
    ClusterStatus,
    EvaluationStatus,
    JobKind,
    member_of,
)
from gradient.runtime import setsql
from gradient.runtime.setsql import fixed_cursor
from gradient.scheduling.models import CandidateScore, DispatchedJob, Evaluation, EvaluationBuild
from gradient.scheduling.selectors import eval_needs_fetch, member_eval_steps
from gradient.workers.models import IdleSlot, Worker, WorkerSession


def _member_key(evaluation_id: uuid.UUID | None, build_id: uuid.UUID) -> str:
    """A cluster_member row's job key: exactly one of its two jobs is set."""
    return eval_key(evaluation_id) if evaluation_id is not None else build_key(build_id)


# --- For the job loop and the sweeps --------------------------------------------------------------------


def is_cluster_assignment(assignment_id: str | uuid.UUID) -> bool:
    """Whether this assignment is a cluster member's (its reports go to the clusters services)."""
    parsed = parse_uuid(assignment_id)
    if parsed is None:
        return False
    return DispatchedJob.objects.filter(id=parsed, cluster_attempt__isnull=False).exists()


def _open_attempt() -> Exists:
    return Exists(
        ClusterAttempt.objects.filter(cluster_job_id=OuterRef("cluster_job_id"), finished_at__isnull=True)
    )


def tracked_job_keys() -> frozenset[str]:
    """Job keys of members whose attempt is open: tracked by their cluster, so the abandoned-dispatch
    sweep and the evaluation watchdog skip them."""
    rows = ClusterMember.objects.filter(_open_attempt()).values_list("evaluation_id", "derivation_build_id")
    return frozenset(_member_key(e, b) for e, b in rows)


def tracked_dispatch_q() -> Q:
    """For DispatchedJob querysets: the member rows of an open attempt (`.exclude(tracked_dispatch_q())`)."""
    return Q(cluster_attempt__isnull=False, cluster_attempt__finished_at__isnull=True)


def tracked_evaluation_q() -> Q:
    """For Evaluation querysets: evaluations that are members of a cluster with an open attempt."""
    members = ClusterMember.objects.filter(evaluation_id=OuterRef("pk")).filter(_open_attempt())
    return Q(Exists(members))


@dataclass(frozen=True)
class Membership:
    cluster_id: uuid.UUID
    cluster_status: str
    role: str
    index: int
    primary: bool

    @property
    def in_book(self) -> bool:
        """Members of a Queued cluster join the cluster book; members of any other cluster wait for it."""
        return self.cluster_status == ClusterStatus.QUEUED


def cluster_membership(*, job_keys: Iterable[str]) -> dict[str, Membership]:
    """The memberships of a batch of job keys, in one query. A key that is no member is absent: it
    queues as a single job as before."""
    evals: list[uuid.UUID] = []
    builds: list[uuid.UUID] = []
    for text in job_keys:
        key = JobKey.parse(text, kinds=SINGLE_JOB_KEYS)
        if key is not None:
            (evals if key.job_kind is JobKind.EVAL else builds).append(key.id)
    rows = ClusterMember.objects.filter(
        Q(evaluation_id__in=evals) | Q(derivation_build_id__in=builds)
    ).values_list(
        "evaluation_id",
        "derivation_build_id",
        "cluster_job_id",
        "cluster_job__status",
        "role",
        "index",
        "primary",
    )
    out: dict[str, Membership] = {}
    for e, b, cluster_id, status, role, index, primary in rows:
        out[_member_key(e, b)] = Membership(cluster_id, status, role, index, primary)
    return out


def needed_outside_its_cluster(build_id: uuid.UUID) -> bool:
    """Whether an active evaluation that is not a member of the build's cluster needs the build."""
    cluster_ids = ClusterMember.objects.filter(derivation_build_id=build_id).values("cluster_job_id")
    in_cluster = ClusterMember.objects.filter(
        cluster_job_id__in=cluster_ids, evaluation_id__isnull=False
    ).values("evaluation_id")
    return (
        EvaluationBuild.objects.filter(
            build_id=build_id, blocks_evaluation=True, evaluation__status__in=EVALUATION_ACTIVE
        )
        .exclude(evaluation_id__in=in_cluster)
        .exists()
    )


# --- Reservations ---------------------------------------------------------------------------------------


def reservation_state() -> Reservation | None:
    """The reservation in force (cluster_reservation holds at most one row). Every batch of RequestJobs
    asks (scheduling.selectors.workers_held): on PostgreSQL one fixed-text read, no query to build, sent
    with the batch's first statement (registered in apps.py)."""
    if connection.vendor == "postgresql":
        rows = setsql.read_along(RESERVATION_SQL)  # read with the claim batch's first statement
        if rows is None:
            with fixed_cursor() as cursor:
                cursor.execute(RESERVATION_SQL)
                rows = cursor.fetchall()
        found = rows[0] if rows else None
        if found is None:
            return None
        row = setsql.from_row(ClusterReservation, _RESERVATION_NAMES, found)
    else:
        row = ClusterReservation.objects.first()
        if row is None:
            return None
    return Reservation(
        cluster_id=str(row.cluster_job_id),
        seats=tuple(
            ReservedSeat(
                role=s["role"], index=int(s["index"]), kind=JobKind(s["kind"]), worker_id=s["worker_id"]
            )
            for s in row.seats or []
        ),
        created_at=row.created_at,
        expires_at=row.expires_at,
    )


_RESERVATION_NAMES = tuple(f.attname for f in ClusterReservation._meta.concrete_fields)
RESERVATION_SQL = (
    f"SELECT {', '.join(f.column for f in ClusterReservation._meta.concrete_fields)} "  # noqa: S608 (names)
    f"FROM {ClusterReservation._meta.db_table} ORDER BY id LIMIT 1"
)


# is_reserved in SQL, for the claim statement (scheduling.selectors.register_seat_hold): the seat's worker
# and kind in the reservation's JSON (ReservedSeat.as_json).
RESERVED_SEAT_SQL = (
    "EXISTS (SELECT 1 FROM cluster_reservation cr CROSS JOIN LATERAL jsonb_array_elements(cr.seats) seat "
    "WHERE cr.singleton = true AND seat->>'kind' = {kind} AND seat->>'worker_id' = {worker}::text)"
)


def worker_reserved_for(worker_id: uuid.UUID | str, kind: str) -> bool:
    """Whether single assignment must not give this worker a new job of `kind` ("eval"/"flake" or
    "build"): a reserved seat keeps its running jobs but gets nothing new of the reserved kind."""
    slot_kind = PROTOCOL_JOB_KINDS.get(kind) or member_of(JobKind, kind)
    if slot_kind is None:
        return False
    return is_reserved(reservation_state(), str(worker_id), slot_kind)


def workers_reserved_for(worker_ids: Sequence[uuid.UUID], kind: str) -> set[uuid.UUID]:
    """worker_reserved_for for many workers at once, with one read of the reservation (a batch of
    RequestJobs asks for all its workers together)."""
    slot_kind = PROTOCOL_JOB_KINDS.get(kind) or member_of(JobKind, kind)
    reservation = reservation_state() if slot_kind is not None else None
    if reservation is None or slot_kind is None:
        return set()
    return {w for w in worker_ids if is_reserved(reservation, str(w), slot_kind)}


# --- The dispatch snapshot ------------------------------------------------------------------------------


def clusters_wait_for_placement(*, now: datetime) -> bool:
    """Whether a Queued cluster without an open attempt is out of backoff: an unanswered RequestJob is
    then worth a placement pass at once (one cheap query, so idle workers cost nothing otherwise)."""
    return (
        ClusterJob.objects.filter(status=ClusterStatus.QUEUED)
        .filter(Q(retry_at__isnull=True) | Q(retry_at__lte=now))
        .exclude(_open_attempt_of_cluster())
        .exists()
    )


def _open_attempt_of_cluster() -> Exists:
    return Exists(ClusterAttempt.objects.filter(cluster_job_id=OuterRef("pk"), finished_at__isnull=True))


def queued_clusters(*, now: datetime) -> list[Cluster]:
    """The cluster book: every Queued cluster without an open attempt, with its members and whether each
    can start now (its job Queued, out of backoff, with no open assignment). Memberships, job rows, open
    assignments and build projects are each loaded in one query."""
    open_attempt = ClusterAttempt.objects.filter(cluster_job_id=OuterRef("pk"), finished_at__isnull=True)
    clusters = list(ClusterJob.objects.filter(status=ClusterStatus.QUEUED).exclude(Exists(open_attempt)))
    if not clusters:
        return []
    members: list[Any] = list(
        ClusterMember.objects.filter(cluster_job_id__in=[c.id for c in clusters]).values_list(
            *_BOOK_MEMBER_FIELDS, named=True
        )
    )
    keys = [_member_key(m.evaluation_id, m.derivation_build_id) for m in members]
    open_keys = set(
        DispatchedJob.objects.filter(job_id__in=keys, finished_at__isnull=True).values_list(
            "job_id", flat=True
        )
    )
    build_ids = [m.derivation_build_id for m in members if m.derivation_build_id is not None]
    build_projects: dict[uuid.UUID, set[str]] = defaultdict(set)
    for build_id, project in EvaluationBuild.objects.filter(
        build_id__in=build_ids, blocks_evaluation=True, evaluation__status__in=EVALUATION_ACTIVE
    ).values_list("build_id", "evaluation__project__name"):
        build_projects[build_id].add(project)

    by_cluster: dict[uuid.UUID, list[Member]] = defaultdict(list)
    for m in members:
        by_cluster[m.cluster_job_id].append(_member(m, now, open_keys, build_projects))
    return [
        Cluster(
            cluster_id=str(c.id),
            members=tuple(sorted(by_cluster.get(c.id, []), key=lambda x: (x.role, x.index))),
            queued_at=c.queued_at or c.created_at,
            same_zone=c.same_zone,
            priority=c.priority,
            retry_at=c.retry_at,
            prepare_failures=c.prepare_failures,
        )
        for c in clusters
        if by_cluster.get(c.id)
    ]


# What the cluster book reads of a member and its job (_member): values, not whole rows of three tables.
_BOOK_MEMBER_FIELDS = (
    "cluster_job_id",
    "evaluation_id",
    "derivation_build_id",
    "role",
    "index",
    "primary",
    "pin",
    "evaluation__status",
    "evaluation__followup_pending",
    "evaluation__project__name",
    "derivation_build__system",
    "derivation_build__required_features",
    "derivation_build__status",
    "derivation_build__retry_at",
)


def _member(m: Any, now: datetime, open_keys: set[str], build_projects: dict[uuid.UUID, set[str]]) -> Member:
    """A member of the book from its row of _BOOK_MEMBER_FIELDS."""
    key = _member_key(m.evaluation_id, m.derivation_build_id)
    if m.evaluation_id is not None:
        steps = member_eval_steps(Evaluation(followup_pending=m.evaluation__followup_pending))
        return Member(
            role=m.role,
            index=m.index,
            job_key=key,
            kind=JobKind.EVAL,
            primary=m.primary,
            pin=m.pin or None,
            needs_fetch=eval_needs_fetch(steps),
            projects=frozenset({m.evaluation__project__name}),
            can_start=m.evaluation__status == EvaluationStatus.QUEUED and key not in open_keys,
        )
    retry_at = m.derivation_build__retry_at
    return Member(
        role=m.role,
        index=m.index,
        job_key=key,
        kind=JobKind.BUILD,
        primary=m.primary,
        pin=m.pin or None,
        system=m.derivation_build__system,
        required_features=frozenset(m.derivation_build__required_features or []),
        projects=frozenset(build_projects.get(m.derivation_build_id, set())),
        can_start=m.derivation_build__status == BuildStatus.QUEUED
        and (retry_at is None or retry_at <= now)
        and key not in open_keys,
    )


def dispatch_pool(*, job_keys: Iterable[str], now: datetime, policy: MatchPolicy) -> Pool:
    """Free capacity and what is known about it: connected active workers (draining ones included, the
    matcher seats nothing on them), their fresh idle slots, their scores for the member jobs, and the
    penalties still inside the window."""
    sessions: list[Any] = list(
        WorkerSession.objects.filter(closed_at__isnull=True, worker__active=True).values_list(
            "worker_id",
            "draining",
            "worker__name",
            "worker__zone",
            "worker__can_fetch",
            "worker__can_eval",
            "worker__can_build",
            "worker__architectures",
            "worker__system_features",
            "worker__endpoint",
            named=True,
        )
    )
    ids = [s.worker_id for s in sessions]
    projects: dict[uuid.UUID, set[str]] = defaultdict(set)
    for worker_id, name in Worker.projects.through.objects.filter(worker_id__in=ids).values_list(
        "worker_id", "project__name"
    ):
        projects[worker_id].add(name)
    workers = [
        WorkerSnapshot(
            worker_id=str(s.worker_id),
            name=s.worker__name,
            zone=s.worker__zone or None,
            can_fetch=s.worker__can_fetch,
            can_eval=s.worker__can_eval,
            can_build=s.worker__can_build,
            architectures=frozenset(s.worker__architectures or []),
            system_features=frozenset(s.worker__system_features or []),
            projects=frozenset(projects.get(s.worker_id, set())),
            endpoint=s.worker__endpoint or None,
            draining=s.draining,
        )
        for s in sessions
    ]
    fresh = now - timedelta(seconds=policy.idle_slot_ttl_secs)
    slots = [
        SlotSnapshot(worker_id=str(w), kind=JobKind(k), recorded_at=at)
        for w, k, at in IdleSlot.objects.filter(worker_id__in=ids, recorded_at__gte=fresh).values_list(
            "worker_id", "kind", "recorded_at"
        )
    ]
    scores = _scores_by_job(job_keys, ids)
    penalties = [
        Penalty(worker_id=str(w), at=at, reason=r)
        for w, at, r in ClusterWorkerPenalty.objects.filter(
            at__gte=now - timedelta(seconds=policy.penalty_window_secs)
        ).values_list("worker_id", "at", "reason")
    ]
    return replace(Pool.of(workers=workers, idle_slots=slots, penalties=penalties), scores=scores)


# The member jobs' scores by the connected workers, one JSON object per job (a pass reads tens of
# thousands: a row each, made into uuids by the driver and back into text for the planner, they were most
# of the pool's read, and their tuples most of what the collector then scanned).
_SCORES_SQL = (
    "SELECT job_id, json_object_agg(worker_id, missing_nar_size) FROM candidate_score "
    "WHERE job_id = ANY(%s::text[]) AND worker_id = ANY(%s::uuid[]) GROUP BY job_id"
)


def _scores_by_job(job_keys: Iterable[str], worker_ids: list[uuid.UUID]) -> dict[str, dict[str, int]]:
    """Pool.scores: the missing NAR sizes by job key, then worker id, in one read."""
    keys = list(job_keys)
    by_job: dict[str, dict[str, int]] = {}
    if not keys or not worker_ids:
        return by_job
    if connection.vendor != "postgresql":
        rows: Iterable[tuple[str, Any, int]] = CandidateScore.objects.filter(
            job_id__in=keys, worker_id__in=worker_ids
        ).values_list("job_id", "worker_id", "missing_nar_size")
    else:
        with fixed_cursor() as cursor:
            cursor.execute(_SCORES_SQL, [keys, worker_ids])
            return dict(cursor.fetchall())
    for job, worker, size in rows:
        by_job.setdefault(job, {})[str(worker)] = size
    return by_job
