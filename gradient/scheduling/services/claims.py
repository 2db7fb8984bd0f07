"""The single-assignment claim: one conditional INSERT decides who gets a job.

    INSERT INTO dispatched_job (...) SELECT ... WHERE EXISTS (start condition)
    ON CONFLICT (job_id) WHERE finished_at IS NULL DO NOTHING RETURNING id

Won when a row came back. The partial unique index idx-dispatched_job-open-job arbitrates between
connections and server instances; the start condition (the shared build is Queued, the evaluation is
not terminal) is checked by the same statement. A lost claim raises nothing and writes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
from django.db import connection, transaction

from gradient.core.vocab import (
    CLUSTER_TERMINAL,
    EVALUATION_ACTIVE,
    EVALUATION_TERMINAL,
    BuildAttemptOutcome,
    BuildStatus,
    DispatchOutcome,
    JobKind,
)
from gradient.runtime import setsql
from gradient.runtime.setsql import fixed_cursor
from gradient.scheduling import history, selectors
from gradient.scheduling.models import DispatchedJob

_COLUMNS = (
    "id",
    "kind",
    "job_id",
    "evaluation_id",
    "derivation_build_id",
    "worker_id",
    "cluster_attempt_id",
    "score",
    "score_breakdown",
    "missing_nar_size",
    "missing_count",
    "job",
    "phase",
    "queued_at",
    "dispatched_at",
    "reason",
)


@dataclass(frozen=True)
class ClaimRequest:
    kind: str  # JobKind value
    job_key: str
    worker_id: uuid.UUID
    evaluation_id: uuid.UUID | None = None
    build_id: uuid.UUID | None = None
    score: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    missing_nar_size: int | None = None
    missing_count: int | None = None
    job: dict[str, Any] = field(default_factory=dict)
    queued_at: datetime | None = None
    cluster_attempt_id: uuid.UUID | None = None
    assignment_id: uuid.UUID | None = None  # chosen by the caller (to find the claim again), or new
    # The worker's session the AssignJob goes to: the claim holds only while it is open (None: any).
    session_id: uuid.UUID | None = None


def _prep(name: str, value: Any) -> Any:
    """The value as the database column takes it (UUIDs are hex text on SQLite, JSON is adapted)."""
    model_field = DispatchedJob._meta.get_field(name)  # accepts attnames such as worker_id
    return model_field.get_db_prep_save(value, connection)  # type: ignore[union-attr]


def _start_condition(request: ClaimRequest) -> tuple[str, list[Any]]:
    if request.kind == JobKind.BUILD:
        return (
            "SELECT 1 FROM derivation_build WHERE id = %s AND status = %s",
            [_prep("derivation_build_id", request.build_id), BuildStatus.QUEUED.value],
        )
    placeholders = ", ".join(["%s"] * len(EVALUATION_TERMINAL))
    return (
        f"SELECT 1 FROM evaluation WHERE id = %s AND status NOT IN ({placeholders})",  # noqa: S608 (fixed text)
        [_prep("evaluation_id", request.evaluation_id), *[s.value for s in EVALUATION_TERMINAL]],
    )


def _session_condition(session_id: uuid.UUID | None) -> tuple[str, list[Any]]:
    """The claim holds only while the session its AssignJob goes to is open. On PostgreSQL the session's
    row is locked FOR KEY SHARE until the claim commits, and a session's close locks it FOR UPDATE
    first (workers.services): a close that committed before is seen (the claim loses), one that comes
    after waits for the claim and then hands its job back with the session's others. Without it, a claim
    committing while its session closed (a socket or the channel layer failing mid-request) stayed open
    on a worker that never heard of it."""
    if session_id is None:
        return "", []
    lock = " FOR KEY SHARE" if connection.vendor == "postgresql" else ""
    return (
        f" AND EXISTS (SELECT 1 FROM worker_session WHERE id = %s AND closed_at IS NULL{lock})",  # noqa: S608
        [_prep("worker_id", session_id)],  # a UUID column like worker_id
    )


def claim_assignment(*, request: ClaimRequest, now: datetime) -> uuid.UUID | None:
    """Claim one job for one worker. Returns the new assignment id, or None when the claim was lost
    (another open assignment, or the start condition no longer holds). Call inside the transaction that
    also makes the job's own transition, so a failed transition rolls the claim back with it."""
    assignment_id = request.assignment_id or uuid.uuid4()
    values = {
        "id": assignment_id,
        "kind": request.kind,
        "job_id": request.job_key,
        "evaluation_id": request.evaluation_id,
        "derivation_build_id": request.build_id,
        "worker_id": request.worker_id,
        "cluster_attempt_id": request.cluster_attempt_id,
        "score": request.score,
        "score_breakdown": request.breakdown,
        "missing_nar_size": request.missing_nar_size,
        "missing_count": request.missing_count,
        "job": request.job,
        "phase": "",
        "queued_at": request.queued_at,
        "dispatched_at": now,
        "reason": "",
    }
    condition_sql, condition_params = _start_condition(request)
    select_list = ", ".join(["%s"] * len(_COLUMNS))
    session_sql, session_params = _session_condition(request.session_id)
    sql = (
        f"INSERT INTO dispatched_job ({', '.join(_COLUMNS)}) "  # noqa: S608 (fixed column list)
        f"SELECT {select_list} WHERE EXISTS ({condition_sql}){session_sql} "
        "ON CONFLICT (job_id) WHERE finished_at IS NULL DO NOTHING RETURNING id"
    )
    params = [_prep(c, values[c]) for c in _COLUMNS] + condition_params + session_params
    with fixed_cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return assignment_id if row is not None else None


def assignment_close(*, row: DispatchedJob, outcome: DispatchOutcome, reason: str, now: datetime) -> bool:
    """Close an open assignment, with its fact on the evaluation's record. False (and nothing written)
    when it was closed already: every close carries WHERE finished_at IS NULL. A batch of one."""
    return row.id in assignments_close(rows=[row], outcome=outcome, reason=reason, now=now)


def assignments_close(
    *, rows: Sequence[DispatchedJob], outcome: DispatchOutcome, reason: str, now: datetime
) -> set[uuid.UUID]:
    """assignment_close for many assignments of one outcome and reason, in one statement: the ids of
    those this call closed."""
    if not rows:
        return set()
    closed = setsql.update_returning(
        DispatchedJob,
        [row.id for row in rows],
        {"finished_at": now, "outcome": outcome, "reason": reason[:2000]},
        where={"finished_at": None},
    )
    _closed_history([row for row in rows if row.id in closed], outcome, reason, now)
    return closed


@dataclass(frozen=True, slots=True)
class AssignmentReports:
    """What one batch's usual reports of a job say about its assignment row, folded: accepted, the
    last phase reported (or None), completed."""

    row: DispatchedJob
    accepted: bool = False
    phase: str | None = None
    completed: bool = False


def assignments_reported(*, reports: Sequence[AssignmentReports], now: datetime) -> set[uuid.UUID]:
    """The assignment rows of a batch's usual reports, each written once: accepted (the first time
    only), its phase, reported now, and closed as Completed where it completed; only rows still open
    change. Returns the ids of the rows closed. On PostgreSQL one statement for the whole batch (a job
    whose accept, phases and completion came in one batch is one row version, not five); elsewhere the
    same writes one kind after the other."""
    if not reports:
        return set()
    if connection.vendor != "postgresql":
        return _assignments_reported_apart(reports, now)
    params: dict[str, Any] = {
        "ids": [r.row.id for r in reports],
        "accepted": [r.accepted for r in reports],
        "phase": [r.phase for r in reports],
        "completed": [r.completed for r in reports],
        "now": now,
        "outcome": DispatchOutcome.COMPLETED.value,
        "reason": "completed",
    }
    with fixed_cursor() as cursor:
        cursor.execute(_ASSIGNMENTS_REPORTED, params)
        closed = {row[0] for row in cursor.fetchall() if row[1]}
    _closed_history(
        [r.row for r in reports if r.row.id in closed], DispatchOutcome.COMPLETED, "completed", now
    )
    return closed


_ASSIGNMENTS_REPORTED = """
UPDATE dispatched_job d SET
    accepted_at = CASE WHEN v.accepted AND d.accepted_at IS NULL THEN %(now)s ELSE d.accepted_at END,
    phase = COALESCE(v.phase, d.phase),
    last_report_at = %(now)s,
    finished_at = CASE WHEN v.completed THEN %(now)s ELSE d.finished_at END,
    outcome = CASE WHEN v.completed THEN %(outcome)s ELSE d.outcome END,
    reason = CASE WHEN v.completed THEN %(reason)s ELSE d.reason END
FROM unnest(%(ids)b::uuid[], %(accepted)b::bool[], %(phase)b::text[], %(completed)b::bool[])
    AS v(id, accepted, phase, completed)
WHERE d.id = v.id AND d.finished_at IS NULL
RETURNING d.id, v.completed
"""


def _assignments_reported_apart(reports: Sequence[AssignmentReports], now: datetime) -> set[uuid.UUID]:
    open_ids = [r.row.id for r in reports]
    DispatchedJob.objects.filter(
        id__in=[r.row.id for r in reports if r.accepted], accepted_at__isnull=True, finished_at__isnull=True
    ).update(accepted_at=now)
    for phase in {r.phase for r in reports if r.phase is not None}:
        DispatchedJob.objects.filter(
            id__in=[r.row.id for r in reports if r.phase == phase], finished_at__isnull=True
        ).update(phase=phase)
    DispatchedJob.objects.filter(id__in=open_ids, finished_at__isnull=True).update(last_report_at=now)
    return assignments_close(
        rows=[r.row for r in reports if r.completed],
        outcome=DispatchOutcome.COMPLETED,
        reason="completed",
        now=now,
    )


def _closed_history(
    rows: Sequence[DispatchedJob], outcome: DispatchOutcome, reason: str, now: datetime
) -> None:
    for row in rows:
        history.closed(row=row, outcome=outcome, reason=reason, now=now)


@dataclass(frozen=True, slots=True)
class BuildClaim:
    """One shared build to claim for one worker, as part of a batch (claims_of_builds)."""

    assignment_id: uuid.UUID  # chosen by the caller, before the claim (to find an unheard one again)
    build_id: uuid.UUID
    worker_id: uuid.UUID
    job: dict[str, Any]
    queued_at: datetime | None
    score: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    missing_nar_size: int | None = None
    missing_count: int | None = None
    cluster_attempt_id: uuid.UUID | None = None
    session_id: uuid.UUID | None = None  # as ClaimRequest's: the claim holds only while it is open
    # A RequestJob's claim on PostgreSQL: the worker's build slots left for it (its slots less the
    # batch's earlier requests of that worker), and how many of its open builds are finishing (their end
    # on its way). The claim holds only while its open builds, less those, stay below `room`. None: no
    # check (a cluster's seat, or the caller checked already).
    room: int | None = None
    finishing: int = 0


# Why the claim statement refused a claim for its worker rather than for its build (claim_builds'
# `refused`): the session closed or draining, the worker's seat held (a cluster's reservation), or its
# slots full. A claim lost for its build (taken, no longer Queued, not wanted) is in neither.
REFUSED_SESSION = "session"
REFUSED_HELD = "held"
REFUSED_FULL = "full"


# Claims and starts of a whole batch of shared builds in one statement (PostgreSQL): each build's row is
# locked if it is still Queued and out of backoff (SKIP LOCKED: one another batch is claiming now is
# left to it), the assignment row inserted unless the job already has an open one (the partial unique
# index idx-dispatched_job-open-job arbitrates, as in the single claim), the build moved to Building with
# one more attempt counted by the database, and its BuildAttempt row written; a claim naming a session
# holds only while that session is open (its row locked FOR KEY SHARE: see _session_condition). A claim
# that lost writes nothing; the ids of the won assignments come back with their attempt numbers.
_CLAIM_BUILDS = """
WITH req AS (
    -- One JSON document for the batch's rows (msgspec writes it in C; psycopg dumped eleven arrays
    -- element by element in Python, a fifth of a claim batch's time on its thread).
    SELECT * FROM json_to_recordset(%(claims)s::json) AS r(aid uuid, build_id uuid, worker_id uuid,
        cluster_attempt_id uuid, score float8, breakdown jsonb, nar bigint, cnt int, job jsonb,
        queued_at timestamptz, session_id uuid, room int, fin int)
), sess AS (
    -- Open and not draining (the worker's Draining, or its serve's), locked: see _session_condition.
    SELECT s.id FROM worker_session s
    WHERE s.id = ANY(ARRAY(SELECT session_id FROM req)) AND s.closed_at IS NULL AND NOT s.draining
    FOR KEY SHARE
), checked AS (
    -- Each claim with what its worker allows: a claim naming a session holds while it is open; a
    -- RequestJob's (no cluster attempt) not on a seat a rule holds (a cluster's reservation), nor
    -- beyond its worker's free slots. What the process remembers of its sessions (their capabilities,
    -- their slots) may be behind: checked here.
    SELECT r.*,
        CASE
            WHEN r.session_id IS NOT NULL AND r.session_id NOT IN (SELECT id FROM sess) THEN '{session}'
            WHEN r.cluster_attempt_id IS NULL AND ({held}) THEN '{held_reason}'
            -- The worker's open build assignments, on the index of open assignments by worker (a
            -- generic plan made the first time walked every open assignment for each claim instead).
            WHEN r.room IS NOT NULL AND GREATEST((
                SELECT count(*) FROM dispatched_job d
                WHERE d.worker_id = r.worker_id AND d.finished_at IS NULL AND d.kind = %(kind)s
            ) - r.fin, 0) >= r.room
                THEN '{full}'
            ELSE ''
        END AS refused
    FROM req r
), cleared AS (
    -- The idle build slots of the batch's workers go (recorded again, after, for those left unanswered):
    -- here rather than a statement of their own, one round trip less per batch.
    DELETE FROM idle_slot WHERE worker_id = ANY(%(idle)b::uuid[]) AND kind = %(kind)s
), locked AS (
    -- Each claim with its build's row, locked (a row another transaction holds: lost at once), joined
    -- in the lock's own scan by the build's key. Joined to the locked rows afterwards, the claims were
    -- planned as a nested loop over both lists (estimated at one row each): a fifth of the statement's
    -- time at 140 claims, and growing with the square of the batch.
    SELECT r.*, b.queued_at AS row_queued_at FROM checked r JOIN derivation_build b ON b.id = r.build_id
    WHERE r.refused = '' AND b.status = %(queued_status)s AND (b.retry_at IS NULL OR b.retry_at <= %(now)s)
    FOR NO KEY UPDATE OF b SKIP LOCKED
), eligible AS (
    -- A RequestJob's claim (no cluster attempt) holds only for a build no live cluster has as a member
    -- and that an active evaluation of one of the worker's projects needs: the choice came from the
    -- process's book, which may be behind (gradient.scheduling.book); checked on the locked row.
    SELECT * FROM locked r
    WHERE (r.cluster_attempt_id IS NOT NULL OR (
        NOT EXISTS (
            SELECT 1 FROM cluster_member m JOIN cluster_job c ON c.id = m.cluster_job_id
            WHERE m.derivation_build_id = r.build_id AND c.status <> ALL(%(cluster_ended)s))
        AND EXISTS (
            SELECT 1 FROM evaluation_build eb JOIN evaluation e ON e.id = eb.evaluation_id
                JOIN worker_project wp ON wp.project_id = e.project_id AND wp.worker_id = r.worker_id
            WHERE eb.build_id = r.build_id AND eb.blocks_evaluation AND e.status = ANY(%(active)s))))
), ins AS (
    INSERT INTO dispatched_job (id, kind, job_id, evaluation_id, derivation_build_id, worker_id,
        cluster_attempt_id, score, score_breakdown, missing_nar_size, missing_count, job, phase, queued_at,
        dispatched_at, reason)
    SELECT r.aid, %(kind)s, 'build:' || r.build_id::text, NULL, r.build_id, r.worker_id, r.cluster_attempt_id,
        r.score, r.breakdown, r.nar, r.cnt, r.job, '', COALESCE(r.row_queued_at, r.queued_at),
        %(now)s, ''
    FROM eligible r
    ON CONFLICT (job_id) WHERE finished_at IS NULL DO NOTHING
    RETURNING id, derivation_build_id, worker_id
), started AS (
    UPDATE derivation_build b
    SET status = %(building_status)s, attempts = b.attempts + 1, updated_at = %(now)s
    FROM ins WHERE b.id = ins.derivation_build_id
    RETURNING b.id AS build_id, b.attempts, ins.id AS aid, ins.worker_id
), attempted AS (
    INSERT INTO build_attempt (id, build_id, dispatched_job_id, worker_id, number, outcome, error, started_at)
    SELECT gen_random_uuid(), s.build_id, s.aid, s.worker_id, s.attempts, %(running)s, '', %(now)s
    FROM started s
)
SELECT aid, attempts, '' FROM started
UNION ALL
SELECT aid, NULL, refused FROM checked WHERE refused <> ''
"""


_statements: dict[str, str] = {}


def _claim_builds_sql() -> str:
    """_CLAIM_BUILDS with the registered seat holds' condition (made once: its text is fixed, and so its
    prepared plan)."""
    sql = _statements.get("claim")
    if sql is None:
        held = selectors.seat_held_sql(worker="r.worker_id", kind="%(kind)s")
        sql = _statements["claim"] = (
            _CLAIM_BUILDS.replace("{held}", held)
            .replace("{session}", REFUSED_SESSION)
            .replace("{held_reason}", REFUSED_HELD)
            .replace("{full}", REFUSED_FULL)
        )
    return sql


_encode_json = msgspec.json.Encoder().encode


class _ClaimRow(msgspec.Struct):
    """A claim as the claim statement reads it (json_to_recordset: the keys are its column names)."""

    aid: uuid.UUID
    build_id: uuid.UUID
    worker_id: uuid.UUID
    cluster_attempt_id: uuid.UUID | None
    score: float
    breakdown: dict[str, float]
    nar: int | None
    cnt: int | None
    job: dict[str, Any]
    queued_at: datetime | None
    session_id: uuid.UUID | None
    room: int | None
    fin: int


def _claim_params(claims_json: str, idle_cleared: Sequence[uuid.UUID], now: datetime) -> dict[str, Any]:
    return {
        "claims": claims_json,
        "idle": list(idle_cleared),
        "now": now,
        "kind": JobKind.BUILD.value,
        "queued_status": BuildStatus.QUEUED.value,
        "building_status": BuildStatus.BUILDING.value,
        "running": BuildAttemptOutcome.RUNNING.value,
        "cluster_ended": [s.value for s in CLUSTER_TERMINAL],
        "active": [s.value for s in EVALUATION_ACTIVE],
    }


def claim_statement_prepare(*, now: datetime) -> None:
    """Plan the claim statement on this thread's connection before any claim needs it (a serve's claims
    lane at start, gradient.workers.proto.dispatcher.warm_lanes): its generic plan is made once per
    connection, and a fleet's first claim batches each met a fresh connection (connecting and planning:
    ~20 ms on a quiet machine, several times that while the fleet connects). Claims nothing, and
    commits (psycopg forgets every prepared statement of a connection whose transaction rolls back).
    PostgreSQL only."""
    if connection.vendor != "postgresql":
        return
    with transaction.atomic(), setsql.generic_plans():
        with fixed_cursor() as cursor:
            # No claims, and the types of a claim batch's values (a worker's uuid among those whose idle
            # slots go: a new one, which has none), so that the same prepared statement serves a batch.
            cursor.execute(_claim_builds_sql(), _claim_params("[]", [uuid.uuid4()], now))
            cursor.fetchall()


def claim_builds_statement(
    *,
    claims: Sequence[BuildClaim],
    now: datetime,
    idle_cleared: Sequence[uuid.UUID] = (),
    refused: dict[uuid.UUID, str] | None = None,
) -> dict[uuid.UUID, int]:
    """The batch's claims and starts in one statement (PostgreSQL only; the caller has a transaction):
    won assignment id -> the build's attempt number. Two claims of one build in a batch: one wins; a
    build another transaction holds is lost at once (SKIP LOCKED), never waited for. `idle_cleared`:
    workers whose idle build slots the same statement deletes (a RequestJob batch's). `refused` gets
    the claims refused for their worker (REFUSED_*), by assignment id."""
    if not claims:
        return {}
    rows = [
        _ClaimRow(
            c.assignment_id,
            c.build_id,
            c.worker_id,
            c.cluster_attempt_id,
            float(c.score),
            c.breakdown,
            c.missing_nar_size,
            c.missing_count,
            c.job,
            c.queued_at,
            c.session_id,
            c.room,
            c.finishing,
        )
        for c in claims
    ]
    won: dict[uuid.UUID, int] = {}
    with fixed_cursor() as cursor:
        cursor.execute(_claim_builds_sql(), _claim_params(_encode_json(rows).decode(), idle_cleared, now))
        for aid, attempts, why in cursor.fetchall():
            if not why:
                won[aid] = int(attempts)
            elif refused is not None:
                refused[aid] = why
    return won
