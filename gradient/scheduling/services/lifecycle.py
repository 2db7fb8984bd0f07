"""THE job lifecycle: every transition of an evaluation's job or a shared build that follows a claim or
a report, for single jobs and cluster members alike.

Start (a claim and the job's own transition, together or not at all), apply a worker's progress,
complete, fail, requeue, return to the pool, forget what was offered. Nothing outside this module writes
an evaluation's or a shared build's status after its claim: single-job reports (services.reports), the
cluster code (gradient.clusters) and recovery (gradient.recovery) call these functions. Each expects to
run inside the caller's transaction and is safe to repeat: every write is conditional on the state it
expects, so a second call changes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
from django.db import connection, transaction
from django.db.models import Count, Exists, F, OuterRef

from gradient.core.jobkey import build_key, eval_key
from gradient.core.protocol import (
    Building,
    BuildOutput,
    EvalResult,
    EvaluatingDerivations,
    EvaluatingFlake,
    Fetching,
    FetchResult,
    FlakeStep,
    Job,
    JobUpdateKind,
    tag_of,
)
from gradient.core.vocab import (
    BUILD_ABORTABLE,
    BUILD_SUCCESS,
    EVALUATION_EVALUATING,
    EVALUATION_TERMINAL,
    BuildAttemptOutcome,
    BuildStatus,
    DispatchOutcome,
    EvaluationKind,
    EvaluationStatus,
    JobKind,
)
from gradient.records.schemas import AssignmentClaimed, ReportKind
from gradient.runtime import metrics, savepoints, setsql
from gradient.scheduling import history, jobs
from gradient.scheduling.decisions.failures import (
    BuildVerdict,
    EvalVerdict,
    decide_eval_failure,
)
from gradient.scheduling.models import (
    BuildAttempt,
    DerivationBuild,
    DerivationBuildDependency,
    DispatchedJob,
    Evaluation,
)
from gradient.scheduling.services import drv_recovery, eval_parts, failures, graph
from gradient.scheduling.services.claims import (
    BuildClaim,
    ClaimRequest,
    assignment_close,
    claim_assignment,
    claim_builds_statement,
)
from gradient.scheduling.services.offers import forget_scores, forget_scores_of, forget_sent, forget_sent_all
from gradient.workers.models import IdleSlot

EVAL_PHASES: dict[type[JobUpdateKind], EvaluationStatus] = {
    Fetching: EvaluationStatus.FETCHING,
    EvaluatingFlake: EvaluationStatus.EVALUATING_FLAKE,
    EvaluatingDerivations: EvaluationStatus.EVALUATING_DERIVATION,
}
# Statuses an evaluation's job moves between before its result (Queued, or on a worker).
EVAL_RUNNING = (EvaluationStatus.QUEUED, *EVALUATION_EVALUATING)
REQUEUE_KINDS = ("canceled", "aborted")  # a worker that stops or was told to: no attempt is spent


@dataclass(frozen=True)
class ReportOutcome:
    """What a report did: accepted (it changed the job) or not, and in words."""

    accepted: bool
    detail: str = ""


@dataclass(frozen=True)
class Claimed:
    """A won claim: the new assignment and the job payload its AssignJob carries."""

    assignment_id: uuid.UUID
    job: Job


@dataclass(frozen=True)
class ClaimTerms:
    """How the claim was decided, kept on its assignment row: the score and what the worker reported."""

    score: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    missing_nar_size: int | None = None
    missing_count: int | None = None
    cluster_attempt_id: uuid.UUID | None = None


@dataclass
class BatchEffects:
    """What the transitions of one batch of reports leave for once per batch: the builds that
    completed, whose dependents may be queued and whose evaluations may finish. A single report's
    transition that is given none settles its own at once (a batch of one)."""

    completed: list[uuid.UUID] = field(default_factory=list)

    def settle(self, now: datetime) -> None:
        """Queue the dependents every dependency of which has now succeeded and finish the evaluations
        that needed the completed builds: one set-based pass for the whole batch."""
        completed, self.completed = self.completed, []
        if not completed:
            return
        forget_scores_of([build_key(b) for b in completed])
        dependents, evaluations = graph.after_completions(completed)
        graph.queue_ready_builds(build_ids=dependents, now=now)
        graph.finish_evaluations(evaluation_ids=evaluations, now=now, after_successes=True)


class _StartRefused(Exception):
    """The job's own transition found it changed after the claim: roll the claim back."""


# --- Start ----------------------------------------------------------------------------------------------


def claim_build(
    *,
    build: DerivationBuild,
    worker_id: uuid.UUID,
    now: datetime,
    terms: ClaimTerms | None = None,
    assignment_id: uuid.UUID | None = None,
) -> Claimed | None:
    """Claim a Queued shared build for a worker and start it (Building, one more attempt, its
    BuildAttempt row), together or not at all: a batch of one (claim_builds). None, with nothing
    written, when the claim was lost. `assignment_id`: the id the new assignment gets (the caller keeps
    it to find an unheard claim)."""
    terms = terms or ClaimTerms()
    job = jobs.build_job(build)
    claim = build_claim(
        build=build, worker_id=worker_id, job=job, terms=terms, assignment_id=assignment_id or uuid.uuid4()
    )
    won = claim_builds(claims=[claim], now=now, skip_locked=False)
    return Claimed(claim.assignment_id, job) if claim.assignment_id in won else None


def build_claim(
    *,
    build: DerivationBuild,
    worker_id: uuid.UUID,
    job: Job,
    terms: ClaimTerms,
    assignment_id: uuid.UUID,
    job_builtins: dict[str, Any] | None = None,
    session_id: uuid.UUID | None = None,
    room: int | None = None,
    finishing: int = 0,
) -> BuildClaim:
    """What claim_builds needs to claim `build` for a worker, with the AssignJob's `job` payload (and
    its plain form, when the caller keeps it made already). With `session_id`, the claim holds only
    while that session of the worker is open (the one its AssignJob goes to); with `room`, only while
    the worker's open builds less `finishing` stay below it (BuildClaim)."""
    return BuildClaim(
        assignment_id=assignment_id,
        build_id=build.id,
        worker_id=worker_id,
        job=job_builtins if job_builtins is not None else msgspec.to_builtins(job),
        queued_at=build.queued_at,
        score=terms.score,
        breakdown=terms.breakdown,
        missing_nar_size=terms.missing_nar_size,
        missing_count=terms.missing_count,
        cluster_attempt_id=terms.cluster_attempt_id,
        session_id=session_id,
        room=room,
        finishing=finishing,
    )


def claim_builds(
    *,
    claims: Sequence[BuildClaim],
    now: datetime,
    skip_locked: bool = True,
    idle_cleared: Sequence[uuid.UUID] = (),
    refused: dict[uuid.UUID, str] | None = None,
) -> set[uuid.UUID]:
    """Claim and start a batch of shared builds, each for its worker, inside the caller's transaction:
    THE claim-and-start of a shared build (a RequestJob batch, a single claim, a cluster's seat). Each
    claim wins or loses alone; a won build is Building with one more attempt and its BuildAttempt row,
    and drops out of every worker's sent set. Returns the ids of the assignments won.

    PostgreSQL does the batch in one statement (claims.claim_builds_statement); SQLite, which has no
    such statement, claims one after the other with the same conditions, each in a savepoint.
    `skip_locked`: a batch of RequestJobs loses a build another transaction holds at once (the request
    takes its next choice); a claim of one given build (claim_build: a cluster's seat) waits for that
    transaction instead, taking its locks in the order every other claim does (the assignment row, then
    the build's), so that it never deadlocks with one: claim by claim, each in a savepoint.
    `idle_cleared`: workers whose idle build slots go with the claims (a RequestJob batch's: in the
    claim statement on PostgreSQL, by the caller elsewhere). `refused`: on PostgreSQL, the claims the
    statement refused for their worker rather than their build (claims.REFUSED_*: the session closed
    or draining, the seat held, the slots full), by assignment id; elsewhere the caller checks those."""
    if not claims:
        return set()
    turned: dict[uuid.UUID, str] = {}
    if connection.vendor == "postgresql" and skip_locked:
        won = set(claim_builds_statement(claims=claims, now=now, idle_cleared=idle_cleared, refused=turned))
        if refused is not None:
            refused.update(turned)
    else:
        if idle_cleared:
            IdleSlot.objects.filter(worker_id__in=list(idle_cleared), kind=JobKind.BUILD).delete()
        won = {c.assignment_id for c in claims if _claim_build_alone(c, now)}
    # The claimed builds stay in the workers' sent sets as rows until each worker's next delta deletes
    # the rows of builds no longer visible (offers._fresh_candidates): a delete of one row per worker
    # offered the build, on every claim, was most of a hand-out's writes. Back in the pool (requeue_job,
    # fail_build, abandon_assignment) a build's rows go at once, so it is offered again.
    if lost := len(claims) - len(won) - len(turned):
        metrics.count(metrics.CLAIMS_LOST, amount=float(lost))
    return won


def _claim_build_alone(claim: BuildClaim, now: datetime) -> bool:
    request = ClaimRequest(
        kind=JobKind.BUILD,
        job_key=build_key(claim.build_id),
        worker_id=claim.worker_id,
        build_id=claim.build_id,
        score=claim.score,
        breakdown=claim.breakdown,
        missing_nar_size=claim.missing_nar_size,
        missing_count=claim.missing_count,
        job=claim.job,
        queued_at=claim.queued_at,
        cluster_attempt_id=claim.cluster_attempt_id,
        assignment_id=claim.assignment_id,
        session_id=claim.session_id,
    )
    try:
        with savepoints.part():
            assignment_id = claim_assignment(request=request, now=now)
            if assignment_id is None:
                return False
            _start_build(claim.build_id, assignment_id, claim.worker_id, now)
    except _StartRefused:
        return False
    return True


def claim_evaluation(
    *,
    evaluation: Evaluation,
    steps: Sequence[FlakeStep],
    worker_id: uuid.UUID,
    worker_name: str,
    reason: str,
    now: datetime,
    terms: ClaimTerms | None = None,
    assignment_id: uuid.UUID | None = None,
    session_id: uuid.UUID | None = None,
) -> Claimed | None:
    """Claim a Queued evaluation's job (these `steps`) for a worker and start it (Fetching or
    EvaluatingFlake, with its record facts), together or not at all. None when the claim was lost.
    With `session_id`, the claim holds only while that session of the worker is open."""
    terms = terms or ClaimTerms()
    job = jobs.eval_job(evaluation, steps)
    queued_at = evaluation.updated_at if evaluation.followup_pending else evaluation.created_at
    request = _request(
        JobKind.EVAL,
        evaluation.job_key,
        worker_id,
        job,
        terms,
        queued_at,
        evaluation_id=evaluation.id,
        assignment_id=assignment_id,
        session_id=session_id,
    )

    def start(assignment_id: uuid.UUID) -> None:
        _start_evaluation(evaluation.id, steps, assignment_id, worker_name, reason, terms, now)

    return _claim_and_start(request, job, start, now)


# --- Start, a set at a time (a pass's cluster claims) ------------------------------------------------------


@dataclass(frozen=True)
class EvaluationClaim:
    """One evaluation to claim and start for one worker, as part of a set (claim_evaluations)."""

    evaluation: Evaluation
    steps: Sequence[FlakeStep]
    worker_id: uuid.UUID
    worker_name: str
    reason: str
    terms: ClaimTerms
    assignment_id: uuid.UUID


class _SetClaimRow(msgspec.Struct):
    """A claim as the set claim statements read it (json_to_recordset: the keys are its column names)."""

    aid: uuid.UUID
    job_key: str
    job_id: uuid.UUID
    worker_id: uuid.UUID
    cluster_attempt_id: uuid.UUID | None
    score: float
    breakdown: dict[str, float]
    nar: int | None
    cnt: int | None
    job: dict[str, Any]
    queued_at: datetime | None


_encode_json = msgspec.json.Encoder().encode

# The single claim (claims.claim_assignment) for a set of jobs of one kind in one statement: each row
# inserted only while its start condition holds (the build Queued; the evaluation not terminal) and no
# open assignment of its job exists (idx-dispatched_job-open-job arbitrates, waiting for a transaction
# that inserted one, as the single claim does); rows in job-key order, as claim after claim took them.
_CLAIM_SET = """
WITH req AS (
    SELECT * FROM json_to_recordset(%(claims)s::json) AS r(aid uuid, job_key text, job_id uuid,
        worker_id uuid, cluster_attempt_id uuid, score float8, breakdown jsonb, nar bigint, cnt int,
        job jsonb, queued_at timestamptz)
)
INSERT INTO dispatched_job (id, kind, job_id, evaluation_id, derivation_build_id, worker_id,
    cluster_attempt_id, score, score_breakdown, missing_nar_size, missing_count, job, phase, queued_at,
    dispatched_at, reason)
SELECT r.aid, %(kind)s, r.job_key, {evaluation}, {build}, r.worker_id, r.cluster_attempt_id, r.score,
    r.breakdown, r.nar, r.cnt, r.job, '', r.queued_at, %(now)s, ''
FROM req r
WHERE EXISTS ({condition})
ORDER BY r.job_key
ON CONFLICT (job_id) WHERE finished_at IS NULL DO NOTHING
RETURNING id
"""
_CLAIM_BUILD_SET = _CLAIM_SET.format(
    evaluation="NULL",
    build="r.job_id",
    condition="SELECT 1 FROM derivation_build b WHERE b.id = r.job_id AND b.status = %(queued)s",
)
_CLAIM_EVALUATION_SET = _CLAIM_SET.format(
    evaluation="r.job_id",
    build="NULL",
    condition="SELECT 1 FROM evaluation e WHERE e.id = r.job_id AND e.status <> ALL(%(terminal)s)",
)

# _start_build for a set: Queued -> Building with one more attempt counted by the database, and the
# BuildAttempt row of each build started.
_START_BUILD_SET = """
WITH started AS (
    UPDATE derivation_build b SET status = %(building)s, attempts = b.attempts + 1, updated_at = %(now)s
    FROM unnest(%(aids)s::uuid[], %(builds)s::uuid[], %(workers)s::uuid[]) AS v(aid, build_id, worker_id)
    WHERE b.id = v.build_id AND b.status = %(queued)s
    RETURNING b.id AS build_id, b.attempts, v.aid, v.worker_id
), attempted AS (
    INSERT INTO build_attempt (id, build_id, dispatched_job_id, worker_id, number, outcome, error, started_at)
    SELECT gen_random_uuid(), s.build_id, s.aid, s.worker_id, s.attempts, %(running)s, '', %(now)s
    FROM started s
)
SELECT aid FROM started
"""

# The evaluations' own transition of a set (history.evaluation_transition from Queued), in one statement.
_START_EVALUATION_SET = """
UPDATE evaluation e SET status = v.status, updated_at = %(now)s, waiting_reason = NULL, waiting_since = NULL
FROM unnest(%(ids)s::uuid[], %(statuses)s::text[]) AS v(id, status)
WHERE e.id = v.id AND e.status = %(queued)s
RETURNING e.id
"""


def _set_claim_row(
    aid: uuid.UUID,
    job_key: str,
    job_id: uuid.UUID,
    worker_id: uuid.UUID,
    terms: ClaimTerms,
    job: Job,
    queued_at: datetime | None,
) -> _SetClaimRow:
    return _SetClaimRow(
        aid,
        job_key,
        job_id,
        worker_id,
        terms.cluster_attempt_id,
        float(terms.score),
        terms.breakdown,
        terms.missing_nar_size,
        terms.missing_count,
        msgspec.to_builtins(job),
        queued_at,
    )


def _insert_claims(sql: str, rows: Sequence[_SetClaimRow], params: dict[str, Any]) -> set[uuid.UUID]:
    with setsql.fixed_cursor() as cursor:
        cursor.execute(sql, {"claims": _encode_json(rows).decode(), **params})
        return {row[0] for row in cursor.fetchall()}


def _unclaim(assignment_ids: Sequence[uuid.UUID]) -> None:
    """Take back claims inserted by this transaction whose start was refused: no one else ever saw them,
    so deleting them is what a rolled-back savepoint would have left."""
    if assignment_ids:
        DispatchedJob.objects.filter(id__in=list(assignment_ids), finished_at__isnull=True).delete()


def claim_builds_together(
    *, builds: Sequence[tuple[DerivationBuild, uuid.UUID, ClaimTerms, uuid.UUID]], now: datetime
) -> dict[uuid.UUID, Claimed]:
    """claim_build for a set of (build, worker, terms, assignment id) at once: the same conditions and
    the same lock order (every assignment row first, waiting for a transaction that holds one, then the
    builds), in two statements for the set on PostgreSQL instead of five per build. Each claim wins or
    loses alone; nothing is written for a lost one. Returns the won claims by assignment id. Call inside
    the caller's transaction. Elsewhere claim_build one after the other."""
    if not builds:
        return {}
    if connection.vendor != "postgresql":
        won: dict[uuid.UUID, Claimed] = {}
        for build, worker_id, terms, aid in builds:
            one = claim_build(build=build, worker_id=worker_id, now=now, terms=terms, assignment_id=aid)
            if one is not None:
                won[one.assignment_id] = one
        return won
    jobs_of = {aid: jobs.build_job(build) for build, _, _, aid in builds}
    rows = [
        _set_claim_row(aid, build_key(build.id), build.id, worker_id, terms, jobs_of[aid], build.queued_at)
        for build, worker_id, terms, aid in builds
    ]
    inserted = _insert_claims(
        _CLAIM_BUILD_SET,
        rows,
        {"kind": JobKind.BUILD.value, "now": now, "queued": BuildStatus.QUEUED.value},
    )
    claimed = [(build, worker_id, aid) for build, worker_id, _, aid in builds if aid in inserted]
    started: set[uuid.UUID] = set()
    if claimed:
        with setsql.fixed_cursor() as cursor:
            cursor.execute(
                _START_BUILD_SET,
                {
                    "aids": [aid for _, _, aid in claimed],
                    "builds": [build.id for build, _, _ in claimed],
                    "workers": [worker_id for _, worker_id, _ in claimed],
                    "building": BuildStatus.BUILDING.value,
                    "queued": BuildStatus.QUEUED.value,
                    "running": BuildAttemptOutcome.RUNNING.value,
                    "now": now,
                },
            )
            started = {row[0] for row in cursor.fetchall()}
    _unclaim([aid for aid in inserted if aid not in started])
    if lost := len(builds) - len(started):
        metrics.count(metrics.CLAIMS_LOST, amount=float(lost))
    return {aid: Claimed(aid, jobs_of[aid]) for aid in started}


def claim_evaluations(*, claims: Sequence[EvaluationClaim], now: datetime) -> dict[uuid.UUID, Claimed]:
    """claim_evaluation for a set at once: each evaluation's claim and its start (Fetching or
    EvaluatingFlake from Queued, with its record facts: the status and the claim), together or not at
    all, each claim winning or losing alone; on PostgreSQL a few statements for the whole set. Returns
    the won claims by assignment id. Call inside the caller's transaction."""
    if not claims:
        return {}
    if connection.vendor != "postgresql":
        won: dict[uuid.UUID, Claimed] = {}
        for c in claims:
            one = claim_evaluation(
                evaluation=c.evaluation,
                steps=c.steps,
                worker_id=c.worker_id,
                worker_name=c.worker_name,
                reason=c.reason,
                now=now,
                terms=c.terms,
                assignment_id=c.assignment_id,
            )
            if one is not None:
                won[one.assignment_id] = one
        return won
    jobs_of = {c.assignment_id: jobs.eval_job(c.evaluation, c.steps) for c in claims}
    rows = [
        _set_claim_row(
            c.assignment_id,
            c.evaluation.job_key,
            c.evaluation.id,
            c.worker_id,
            c.terms,
            jobs_of[c.assignment_id],
            c.evaluation.updated_at if c.evaluation.followup_pending else c.evaluation.created_at,
        )
        for c in claims
    ]
    inserted = _insert_claims(
        _CLAIM_EVALUATION_SET,
        rows,
        {"kind": JobKind.EVAL.value, "now": now, "terminal": [s.value for s in EVALUATION_TERMINAL]},
    )
    status_of = {
        c.assignment_id: (
            EvaluationStatus.FETCHING if jobs.FETCH_FLAKE in c.steps else EvaluationStatus.EVALUATING_FLAKE
        )
        for c in claims
    }
    claimed = [c for c in claims if c.assignment_id in inserted]
    started_ids: set[uuid.UUID] = set()
    if claimed:
        with setsql.fixed_cursor() as cursor:
            cursor.execute(
                _START_EVALUATION_SET,
                {
                    "ids": [c.evaluation.id for c in claimed],
                    "statuses": [status_of[c.assignment_id].value for c in claimed],
                    "queued": EvaluationStatus.QUEUED.value,
                    "now": now,
                },
            )
            started_ids = {row[0] for row in cursor.fetchall()}
    started = [c for c in claimed if c.evaluation.id in started_ids]
    _unclaim([c.assignment_id for c in claimed if c.evaluation.id not in started_ids])
    if started:
        numbers = dict(
            DispatchedJob.objects.filter(evaluation_id__in=[c.evaluation.id for c in started])
            .values("evaluation_id")
            .annotate(n=Count("id"))
            .values_list("evaluation_id", "n")
        )
        history.append_many(
            {
                c.evaluation.id: [
                    *history.status_facts(status_of[c.assignment_id], c.reason),
                    AssignmentClaimed(
                        submission=numbers[c.evaluation.id],
                        assignment_id=c.assignment_id,
                        worker=c.worker_name,
                        attempt=numbers[c.evaluation.id],
                        cluster_attempt_id=c.terms.cluster_attempt_id,
                    ),
                ]
                for c in started
            },
            now,
        )
        forget_sent_all([c.evaluation.job_key for c in started])
    if lost := len(claims) - len(started):
        metrics.count(metrics.CLAIMS_LOST, amount=float(lost))
    return {c.assignment_id: Claimed(c.assignment_id, jobs_of[c.assignment_id]) for c in started}


def _request(
    kind: JobKind,
    job_key: str,
    worker_id: uuid.UUID,
    job: Job,
    terms: ClaimTerms,
    queued_at: datetime | None,
    *,
    evaluation_id: uuid.UUID | None = None,
    build_id: uuid.UUID | None = None,
    assignment_id: uuid.UUID | None = None,
    session_id: uuid.UUID | None = None,
) -> ClaimRequest:
    return ClaimRequest(
        kind=kind,
        job_key=job_key,
        worker_id=worker_id,
        evaluation_id=evaluation_id,
        build_id=build_id,
        score=terms.score,
        breakdown=terms.breakdown,
        missing_nar_size=terms.missing_nar_size,
        missing_count=terms.missing_count,
        job=msgspec.to_builtins(job),
        queued_at=queued_at,
        cluster_attempt_id=terms.cluster_attempt_id,
        assignment_id=assignment_id,
        session_id=session_id,
    )


def _claim_and_start(
    request: ClaimRequest, job: Job, start: Callable[[uuid.UUID], None], now: datetime
) -> Claimed | None:
    """The claim and the job's own transition in one savepoint; a claimed job drops out of every
    worker's sent set (a job returned to the pool is offered afresh; its scores go when it finishes)."""
    # A part of the caller's transaction (a RequestJob's, a cluster claim's), not a transaction of its
    # own: a refused start rolls back this claim alone.
    try:
        with savepoints.part():
            assignment_id = claim_assignment(request=request, now=now)
            if assignment_id is not None:
                start(assignment_id)
                forget_sent(request.job_key)
    except _StartRefused:
        assignment_id = None
    if assignment_id is None:
        metrics.count(metrics.CLAIMS_LOST)
        return None
    return Claimed(assignment_id, job)


_START_BUILD = (
    "UPDATE derivation_build SET status = %s, attempts = attempts + 1, updated_at = %s "
    "WHERE id = %s AND status = %s RETURNING attempts"
)


def _start_build(build_id: uuid.UUID, assignment_id: uuid.UUID, worker_id: uuid.UUID, now: datetime) -> None:
    """Queued -> Building with one more attempt, counted by the database (never from a stale read)."""
    prep = DerivationBuild._meta.get_field("id").get_db_prep_value
    updated_at = DerivationBuild._meta.get_field("updated_at").get_db_prep_value
    with connection.cursor() as cursor:
        cursor.execute(
            _START_BUILD,
            [
                BuildStatus.BUILDING.value,
                updated_at(now, connection),
                prep(build_id, connection),
                BuildStatus.QUEUED.value,
            ],
        )
        row = cursor.fetchone()
    if row is None:
        raise _StartRefused
    BuildAttempt.objects.create(
        build_id=build_id,
        dispatched_job_id=assignment_id,
        worker_id=worker_id,
        number=int(row[0]),
        started_at=now,
    )


def _start_evaluation(
    evaluation_id: uuid.UUID,
    steps: Sequence[FlakeStep],
    assignment_id: uuid.UUID,
    worker_name: str,
    reason: str,
    terms: ClaimTerms,
    now: datetime,
) -> None:
    status = EvaluationStatus.FETCHING if jobs.FETCH_FLAKE in steps else EvaluationStatus.EVALUATING_FLAKE
    if not history.evaluation_transition(
        evaluation_id=evaluation_id,
        to=status,
        expect=[EvaluationStatus.QUEUED],
        reason=reason,
        now=now,
        waiting_reason=None,
        waiting_since=None,
    ):
        raise _StartRefused
    history.claimed(
        row_id=assignment_id,
        evaluation_id=evaluation_id,
        worker=worker_name,
        now=now,
        cluster_attempt_id=terms.cluster_attempt_id,
    )


# --- Progress -------------------------------------------------------------------------------------------


def apply_job_update(
    row: DispatchedJob, update: JobUpdateKind, now: datetime, effects: BatchEffects | None = None
) -> ReportOutcome:
    """A JobUpdate of the assignment `row` (fenced by the caller): an evaluation's phase or result, a
    build's start or output."""
    if row.kind == JobKind.EVAL:
        return _evaluation_update(row, update, now)
    return _build_update(row, update, now, effects)


def _evaluation_update(row: DispatchedJob, update: JobUpdateKind, now: datetime) -> ReportOutcome:
    phase = tag_of(type(update))
    evaluation_id = row.evaluation_id
    if evaluation_id is None or isinstance(update, Building | BuildOutput):
        return ReportOutcome(False, f"{phase} does not belong to an evaluation job")
    note_phase(row, phase)
    target = EVAL_PHASES.get(type(update))
    if target is not None:
        history.evaluation_transition(
            evaluation_id=evaluation_id,
            to=target,
            expect=[s for s in EVAL_RUNNING if s != target],
            reason=f"worker reports {phase}",
            now=now,
        )
        return ReportOutcome(True, phase)
    evaluation = Evaluation.objects.select_for_update(no_key=True).get(id=evaluation_id)
    if evaluation.status in EVALUATION_TERMINAL:
        return ReportOutcome(False, "evaluation already finished")
    match update:
        case FetchResult(flake_source=source):
            evaluation.flake_source = source
            evaluation.save(update_fields=["flake_source", "updated_at"])
            return ReportOutcome(True, f"fetched {evaluation.flake_source}")
        case EvalResult():
            # a whole result, or one part of it (eval_parts: stored as it arrives, decided at the last)
            accepted, detail = eval_parts.eval_result_part(
                row=row, evaluation=evaluation, update=update, now=now
            )
            return ReportOutcome(accepted, detail)
    raise AssertionError(f"unhandled evaluation update {phase}")  # every JobUpdateKind is matched above


def _build_update(
    row: DispatchedJob, update: JobUpdateKind, now: datetime, effects: BatchEffects | None
) -> ReportOutcome:
    phase = tag_of(type(update))
    build_id = row.derivation_build_id
    if build_id is None or not isinstance(update, Building | BuildOutput):
        return ReportOutcome(False, f"{phase} does not belong to a build job")
    if update.build_id != str(build_id):
        return ReportOutcome(False, "build_id is not this job's build")
    note_phase(row, phase)
    if isinstance(update, Building):
        return ReportOutcome(True, "building")
    graph.cache_paths(paths=((o.path, o.nar_size) for o in update.outputs))
    complete_build(row, now=now, substituted=update.substituted, effects=effects)
    return ReportOutcome(True, "build_output")


# --- Completion -----------------------------------------------------------------------------------------


def complete_build(
    row: DispatchedJob, *, now: datetime, substituted: bool = False, effects: BatchEffects | None = None
) -> None:
    """The build of `row` succeeded (built, or its outputs substituted): its dependents may be queued,
    its evaluations may finish (at once, or with `effects` once for the caller's whole batch). A batch
    of one (complete_builds)."""
    complete_builds([(row, substituted)], now=now, effects=effects)


def complete_builds(
    done: Sequence[tuple[DispatchedJob, bool]], *, now: datetime, effects: BatchEffects | None = None
) -> None:
    """complete_build for many assignments at once, each with whether its outputs were substituted: a
    statement per outcome for the builds and one for their attempts, whatever the number."""
    rows = [(row, substituted) for row, substituted in done if row.derivation_build_id is not None]
    if not rows:
        return
    own = effects is None
    effects = effects if effects is not None else BatchEffects()
    for substituted in (False, True):
        group = [row for row, s in rows if s is substituted]
        if not group:
            continue
        build_ids = [row.derivation_build_id for row in group]
        status = BuildStatus.SUBSTITUTED if substituted else BuildStatus.COMPLETED
        outcome = BuildAttemptOutcome.SUBSTITUTED if substituted else BuildAttemptOutcome.BUILT
        if connection.vendor == "postgresql":  # every report batch: one fixed-text statement
            with setsql.fixed_cursor() as cursor:
                cursor.execute(
                    _COMPLETE_BUILDS,
                    {
                        "builds": build_ids,
                        "rows": [row.id for row in group],
                        "status": status.value,
                        "outcome": outcome.value,
                        "building": BuildStatus.BUILDING.value,
                        "running": BuildAttemptOutcome.RUNNING.value,
                        "now": now,
                    },
                )
                changed = {r[0] for r in cursor.fetchall()}
        else:
            changed = setsql.update_returning(
                DerivationBuild,
                build_ids,
                {
                    "status": status,
                    "finished_at": now,
                    "updated_at": now,
                    "retry_at": None,
                    "failure_kind": None,
                },
                where={"status": BuildStatus.BUILDING},
            )
            BuildAttempt.objects.filter(
                dispatched_job_id__in=[row.id for row in group], outcome=BuildAttemptOutcome.RUNNING
            ).update(outcome=outcome, finished_at=now)
        effects.completed.extend(sorted(changed))
    if own:
        effects.settle(now)


# complete_builds' two writes in one statement: the Building builds of the group end with `status`, and
# the running attempts of the group's assignments with `outcome`; the builds that changed come back.
_COMPLETE_BUILDS = """
WITH attempts AS (
    UPDATE build_attempt SET outcome = %(outcome)s, finished_at = %(now)s
    WHERE dispatched_job_id = ANY(%(rows)b::uuid[]) AND outcome = %(running)s
)
UPDATE derivation_build SET status = %(status)s, finished_at = %(now)s, updated_at = %(now)s,
    retry_at = NULL, failure_kind = NULL
WHERE id = ANY(%(builds)b::uuid[]) AND status = %(building)s
RETURNING id
"""


def _locked_evaluation(row: DispatchedJob) -> Evaluation:
    assert row.evaluation_id is not None  # an eval assignment always names its evaluation
    return Evaluation.objects.select_for_update(no_key=True).get(id=row.evaluation_id)


def complete_evaluation(row: DispatchedJob, now: datetime) -> ReportOutcome:
    """The evaluation job of `row` completed: a fetch-only job queues its cached follow-up; otherwise the
    evaluation builds what it found (or fails on its errors, or without a result)."""
    evaluation = _locked_evaluation(row)
    if evaluation.status in EVALUATION_TERMINAL:
        return ReportOutcome(True, "evaluation already finished")
    if (incomplete := eval_parts.incomplete_result(row=row, evaluation=evaluation, now=now)) is not None:
        return ReportOutcome(*incomplete)
    steps = tuple(row.job.get("steps") or ())
    if steps == jobs.FETCH_ONLY_STEPS:
        if not evaluation.flake_source:
            fail_evaluation(evaluation, now, "the fetch completed without a flake_source")
            return ReportOutcome(True, "fetch without source: evaluation failed")
        # The cached follow-up, under the same eval:{id} key, with the source as a required path.
        history.evaluation_transition(
            evaluation_id=evaluation.id,
            to=EvaluationStatus.QUEUED,
            expect=EVAL_RUNNING,
            reason="fetched; the cached follow-up is queued",
            now=now,
            followup_pending=True,
        )
        forget_sent(evaluation.job_key)
        return ReportOutcome(True, "fetched; follow-up queued")
    if evaluation.kind == EvaluationKind.DRV_RECOVERY:
        return ReportOutcome(True, drv_recovery.drv_recovery_finish(evaluation=evaluation, now=now))
    if evaluation.errors:
        fail_evaluation(evaluation, now, None)
        return ReportOutcome(True, "evaluation errors: failed")
    if row.phase != "eval_result" and not evaluation.build_links.exists():
        fail_evaluation(evaluation, now, "the evaluation job completed without an eval_result")
        return ReportOutcome(True, "no eval_result: failed")
    history.evaluation_transition(
        evaluation_id=evaluation.id,
        to=EvaluationStatus.BUILDING,
        expect=EVAL_RUNNING,
        reason="evaluated",
        now=now,
        followup_pending=False,
    )
    graph.finish_evaluations(evaluation_ids=[evaluation.id], now=now)
    return ReportOutcome(True, "evaluated; building")


# --- Failure --------------------------------------------------------------------------------------------


def fail_evaluation(
    evaluation: Evaluation, now: datetime, error: str | None, *, reason: str | None = None
) -> None:
    """End the evaluation Failed, `error` added to its errors (the record's reason: `reason` or the
    error)."""
    errors = [*evaluation.errors, error][:500] if error else list(evaluation.errors)
    history.evaluation_transition(
        evaluation_id=evaluation.id,
        to=EvaluationStatus.FAILED,
        expect=None,
        reason=reason or error or (errors[-1] if errors else "evaluation failed"),
        now=now,
        errors=errors,
    )


def fail_evaluation_job(row: DispatchedJob, *, kind: str, error: str, now: datetime) -> ReportOutcome:
    """The evaluation job of `row` failed (its assignment is closed): requeued, or the evaluation
    fails, by scheduling.decisions.failures."""
    evaluation = _locked_evaluation(row)
    if evaluation.status in EVALUATION_TERMINAL:
        return ReportOutcome(True, "evaluation already finished")
    if kind in REQUEUE_KINDS:
        # A worker's cancels in a row past the free ones count as lost dispatches (failures.py).
        decision = failures.evaluation_cancel_decision(evaluation=evaluation, row=row, kind=kind, now=now)
        if decision.verdict == BuildVerdict.PERMANENT:
            fail_evaluation(evaluation, now, f"{kind}: {error}", reason=decision.reason)
            return ReportOutcome(True, "evaluation failed")
        requeue_job(row, now=now, refund=True, reason=kind if decision.refund_attempt else decision.reason)
        return ReportOutcome(True, f"{kind}: requeued")
    verdict = decide_eval_failure(kind=kind, lost_dispatches=evaluation.lost_dispatches)
    if verdict == EvalVerdict.FAIL:
        fail_evaluation(evaluation, now, f"{kind}: {error}")
        return ReportOutcome(True, "evaluation failed")
    requeue_job(row, now=now, refund=False, reason=f"{kind}: {error}")
    return ReportOutcome(True, "evaluation requeued")


def _close_running_attempt(row: DispatchedJob, *, outcome: str, kind: str, error: str, now: datetime) -> None:
    BuildAttempt.objects.filter(dispatched_job_id=row.id, outcome=BuildAttemptOutcome.RUNNING).update(
        outcome=outcome, failure_kind=kind, error=error[:10000], finished_at=now
    )


def fail_build(
    row: DispatchedJob, *, kind: str, error: str, now: datetime, missing_paths: Sequence[str] | None = None
) -> ReportOutcome:
    """The build of `row` failed (its assignment is closed): requeued, retried after a backoff, or ended
    for good (its dependents fail, its evaluations may finish), by scheduling.decisions.failures. A lost
    .drv waits for a DrvRecovery evaluation instead."""
    assert row.derivation_build_id is not None  # a build assignment always names its build
    build = DerivationBuild.objects.select_for_update(no_key=True).get(id=row.derivation_build_id)
    attempt_outcome = BuildAttemptOutcome.ABORTED if kind in REQUEUE_KINDS else BuildAttemptOutcome.FAILED
    _close_running_attempt(row, outcome=attempt_outcome, kind=kind, error=error, now=now)
    if build.status != BuildStatus.BUILDING:
        return ReportOutcome(True, f"build already {build.status}")
    if drv_recovery.is_lost_drv_failure(
        kind=kind,
        error=error,
        drv_path=build.drv_path,
        missing_paths=list(missing_paths) if missing_paths is not None else None,
    ):
        drv_recovery.build_mark_drv_lost(build=build, error=error, now=now)
        forget_sent(row.job_id)
        return ReportOutcome(True, "its .drv is lost: waiting for a DrvRecovery evaluation")
    # A worker's cancels of this build in a row count as failures past the free ones (failures.py).
    decision = failures.build_failure_decision(build=build, row=row, kind=kind, now=now)
    build.failure_kind = kind
    build.last_error = error[:10000]
    build.updated_at = now
    if decision.verdict == BuildVerdict.REQUEUE:
        build.status = BuildStatus.QUEUED
        build.queued_at = now
        build.attempts = max(0, build.attempts - 1)
        build.save()
        forget_sent(row.job_id)
        return ReportOutcome(True, "requeued without spending an attempt")
    if decision.verdict == BuildVerdict.RETRY:
        build.status = BuildStatus.FAILED_TRANSIENT
        build.retry_at = decision.retry_at
        build.save()
        return ReportOutcome(True, f"retry at {decision.retry_at:%H:%M:%S}")
    status = {
        BuildVerdict.PERMANENT: BuildStatus.FAILED_PERMANENT,
        BuildVerdict.TIMEOUT: BuildStatus.FAILED_TIMEOUT,
        BuildVerdict.ABORTED: BuildStatus.ABORTED,
    }[decision.verdict]
    failed = end_build(build_id=build.id, status=status, kind=kind, error=error, now=now)
    return ReportOutcome(True, f"{status}; {failed} dependents failed")


def end_build(
    *,
    build_id: uuid.UUID,
    status: BuildStatus,
    kind: str,
    error: str,
    now: datetime,
    row: DispatchedJob | None = None,
) -> int:
    """End a shared build for good, failed or aborted, while it can still be aborted: with `row`, its
    running attempt closes too; its dependents fail and its evaluations may finish. Returns how many
    dependents failed (0, changing nothing, when the build had ended already)."""
    if row is not None:
        outcome = BuildAttemptOutcome.ABORTED if status == BuildStatus.ABORTED else BuildAttemptOutcome.FAILED
        _close_running_attempt(row, outcome=outcome, kind=kind, error=error, now=now)
    changed = DerivationBuild.objects.filter(id=build_id, status__in=BUILD_ABORTABLE).update(
        status=status, failure_kind=kind, last_error=error[:10000], finished_at=now, updated_at=now
    )
    if not changed:
        return 0
    forget_scores(build_key(build_id))
    failed = graph.fail_dependents(build_ids=[build_id], now=now)
    graph.finish_evaluations(evaluation_ids=graph.evaluations_needing([build_id]), now=now)
    return failed


# --- Requeue and return to the pool ---------------------------------------------------------------------


def requeue_job(row: DispatchedJob, *, now: datetime, refund: bool, reason: str) -> None:
    """Give a job back to the pool after its assignment closed without a result (`refund`: the build's
    attempt is not spent)."""
    if row.kind == JobKind.BUILD and row.derivation_build_id is not None:
        BuildAttempt.objects.filter(dispatched_job_id=row.id, outcome=BuildAttemptOutcome.RUNNING).update(
            outcome=BuildAttemptOutcome.ABORTED, error=reason[:2000], finished_at=now
        )
        build = DerivationBuild.objects.get(id=row.derivation_build_id)
        DerivationBuild.objects.filter(id=build.id, status=BuildStatus.BUILDING).update(
            status=BuildStatus.QUEUED,
            attempts=max(0, build.attempts - 1) if refund else build.attempts,
            queued_at=now,
            updated_at=now,
        )
    elif row.evaluation_id is not None:
        history.evaluation_transition(
            evaluation_id=row.evaluation_id,
            to=EvaluationStatus.QUEUED,
            expect=EVAL_RUNNING,
            reason=reason,
            now=now,
        )
    forget_sent(row.job_id)


def assignment_return_to_pool(*, row: DispatchedJob, reason: str, lost: bool, now: datetime) -> bool:
    """Close an open single-job assignment as Abandoned and give its job back to the pool: declined
    (no attempt spent), or lost with its worker (the attempt is spent; an evaluation counts a lost
    dispatch and fails after 10). False, writing nothing, when it was closed already."""
    with transaction.atomic():
        if not assignment_close(row=row, outcome=DispatchOutcome.ABANDONED, reason=reason, now=now):
            return False
        if lost:
            history.reported(
                row=row, worker=str(row.worker_id), kind=ReportKind.LOST, summary=reason, now=now
            )
        if lost and row.evaluation_id is not None:
            Evaluation.objects.filter(id=row.evaluation_id).update(lost_dispatches=F("lost_dispatches") + 1)
            evaluation = _locked_evaluation(row)
            if evaluation.status not in EVALUATION_TERMINAL and (
                decide_eval_failure(kind="lost", lost_dispatches=evaluation.lost_dispatches)
                == EvalVerdict.FAIL
            ):
                fail_evaluation(
                    evaluation, now, f"{evaluation.lost_dispatches} evaluation dispatches were lost"
                )
                return True
        requeue_job(row, now=now, refund=not lost, reason=reason)
    return True


def dispatch_return_to_pool(*, dispatch_id: uuid.UUID, reason: str, lost: bool, now: datetime) -> bool:
    """assignment_return_to_pool by the assignment's id. False, with nothing written, when the
    assignment was closed already."""
    row = DispatchedJob.objects.filter(id=dispatch_id, finished_at__isnull=True).first()
    if row is None:
        return False
    return assignment_return_to_pool(row=row, reason=reason, lost=lost, now=now)


def worker_jobs_return_lost(*, worker_id: uuid.UUID, reason: str, now: datetime) -> int:
    """Hand every open single-job assignment of a worker back to the pool as lost. Cluster members are
    left to the cluster code: a lost member reports into its attempt's verdict, never requeues alone."""
    dispatch_ids = list(
        DispatchedJob.objects.filter(
            worker_id=worker_id, finished_at__isnull=True, cluster_attempt__isnull=True
        ).values_list("id", flat=True)
    )
    return sum(
        dispatch_return_to_pool(dispatch_id=d, reason=reason, lost=True, now=now) for d in dispatch_ids
    )


# --- After a restart (startup recovery, waiting-and-recovery.md) --------------------------------------


def abandon_assignment(
    row: DispatchedJob, *, reason: str, now: datetime, evaluation_reason: str | None = None
) -> tuple[bool, bool]:
    """Close an open single-job assignment whose worker no live server holds as Abandoned; its evaluation
    (if it is one) goes back to Queued in the same transaction (its record says `evaluation_reason`).
    Returns (closed, evaluation requeued)."""
    with transaction.atomic():
        if not assignment_close(row=row, outcome=DispatchOutcome.ABANDONED, reason=reason, now=now):
            return False, False
        requeued = row.evaluation_id is not None and requeue_evaluation(
            row.evaluation_id, reason=evaluation_reason or reason, now=now
        )
        forget_sent(row.job_id)
    return True, requeued


def requeue_evaluation(evaluation_id: uuid.UUID, *, reason: str, now: datetime) -> bool:
    """An evaluation being fetched or evaluated on a worker that is gone: back to Queued with its phase
    event. False, changing nothing, when it is not being evaluated."""
    changed = history.evaluation_transition(
        evaluation_id=evaluation_id,
        to=EvaluationStatus.QUEUED,
        expect=EVALUATION_EVALUATING,
        reason=reason,
        now=now,
    )
    if changed:
        forget_sent(eval_key(evaluation_id))
    return changed


def requeue_stranded_evaluations(*, reason: str, now: datetime) -> int:
    """Every evaluation being evaluated without an open assignment goes back to Queued."""
    open_row = DispatchedJob.objects.filter(evaluation_id=OuterRef("pk"), finished_at__isnull=True)
    stranded = (
        Evaluation.objects.filter(status__in=EVALUATION_EVALUATING)
        .exclude(Exists(open_row))
        .values_list("id", flat=True)
    )
    return sum(requeue_evaluation(evaluation_id, reason=reason, now=now) for evaluation_id in stranded)


@dataclass(frozen=True)
class StrandedBuilds:
    attempts_aborted: int
    requeued: int
    unpromoted: int


def requeue_stranded_builds(*, reason: str, now: datetime) -> StrandedBuilds:
    """Running build attempts without an open assignment turn Aborted; Building shared builds without
    one turn Queued, and those whose dependencies are not all done go back to Created."""
    open_attempt_row = DispatchedJob.objects.filter(
        derivation_build_id=OuterRef("build_id"), finished_at__isnull=True
    )
    attempts_aborted = (
        BuildAttempt.objects.filter(outcome=BuildAttemptOutcome.RUNNING)
        .exclude(Exists(open_attempt_row))
        .update(outcome=BuildAttemptOutcome.ABORTED, error=reason, finished_at=now)
    )
    open_build_row = DispatchedJob.objects.filter(
        derivation_build_id=OuterRef("pk"), finished_at__isnull=True
    )
    stranded = list(
        DerivationBuild.objects.filter(status=BuildStatus.BUILDING)
        .exclude(Exists(open_build_row))
        .values_list("id", flat=True)
    )
    requeued = DerivationBuild.objects.filter(id__in=stranded, status=BuildStatus.BUILDING).update(
        status=BuildStatus.QUEUED, queued_at=now, updated_at=now
    )
    ungated = DerivationBuildDependency.objects.filter(build_id=OuterRef("pk")).exclude(
        dependency__status__in=BUILD_SUCCESS
    )
    unpromoted = (
        DerivationBuild.objects.filter(id__in=stranded, status=BuildStatus.QUEUED)
        .filter(Exists(ungated))
        .update(status=BuildStatus.CREATED, queued_at=None, updated_at=now)
    )
    return StrandedBuilds(attempts_aborted, requeued, unpromoted)


# --- What a report shows, on the assignment row and the evaluation's record ------------------------------


def note_report(row: DispatchedJob, *, now: datetime) -> None:
    """The worker reported on this assignment (what the liveness of a job is judged by)."""
    note_reports([row.id], now=now)


def note_reports(assignment_ids: Sequence[uuid.UUID], *, now: datetime) -> None:
    """note_report for a whole batch, in one statement."""
    if assignment_ids:
        DispatchedJob.objects.filter(id__in=list(assignment_ids)).update(last_report_at=now)


def note_accepted(row: DispatchedJob, *, now: datetime) -> None:
    """The worker accepted the assignment (once: a repeated accept keeps the first time)."""
    note_accepted_all([row.id], now=now)


def note_accepted_all(assignment_ids: Sequence[uuid.UUID], *, now: datetime) -> None:
    """note_accepted for a whole batch, in one statement."""
    if assignment_ids:
        DispatchedJob.objects.filter(id__in=list(assignment_ids), accepted_at__isnull=True).update(
            accepted_at=now
        )


def note_phase(row: DispatchedJob, phase: str) -> None:
    """The last JobUpdate kind the worker reported for this assignment."""
    note_phase_all([row.id], phase)


def note_phase_all(assignment_ids: Sequence[uuid.UUID], phase: str) -> None:
    """note_phase for a whole batch of one phase, in one statement."""
    if assignment_ids:
        DispatchedJob.objects.filter(id__in=list(assignment_ids)).update(phase=phase)


def record_report(row: DispatchedJob, *, worker: str, kind: ReportKind, summary: str, now: datetime) -> None:
    """What the worker showed, as a fact on the evaluation's record (nothing for a build's assignment)."""
    history.reported(row=row, worker=worker, kind=kind, summary=summary, now=now)


# --- An operator's rebuild ------------------------------------------------------------------------------

BUILD_REBUILDABLE = (
    BuildStatus.COMPLETED,
    BuildStatus.SUBSTITUTED,
    BuildStatus.FAILED_PERMANENT,
    BuildStatus.FAILED_TIMEOUT,
    BuildStatus.FAILED_TRANSIENT,
    BuildStatus.ABORTED,
    BuildStatus.DEPENDENCY_FAILED,
)


def rebuild_build(*, build_id: uuid.UUID, now: datetime) -> bool:
    """A finished or failed shared build starts afresh: its attempts and error cleared, Created again
    (Queued at once when every dependency succeeded), and the dependents that failed only because of
    it back to Created, transitively. Evaluations that ended keep their outcome (restart them for a new
    verdict); active ones wait for it again. False, changing nothing, when the build is not finished."""
    with transaction.atomic():
        changed = DerivationBuild.objects.filter(id=build_id, status__in=BUILD_REBUILDABLE).update(
            status=BuildStatus.CREATED,
            attempts=0,
            retry_at=None,
            failure_kind=None,
            last_error="",
            finished_at=None,
            queued_at=None,
            updated_at=now,
        )
        if not changed:
            return False
        forget_scores(build_key(build_id))
        forget_sent(build_key(build_id))
        reopened = [build_id]
        frontier = [build_id]
        while frontier:
            dependents = list(
                DerivationBuild.objects.filter(
                    dependency_edges__dependency_id__in=frontier, status=BuildStatus.DEPENDENCY_FAILED
                ).values_list("id", flat=True)
            )
            DerivationBuild.objects.filter(id__in=dependents, status=BuildStatus.DEPENDENCY_FAILED).update(
                status=BuildStatus.CREATED, last_error="", finished_at=None, updated_at=now
            )
            reopened += dependents
            frontier = dependents
        graph.queue_ready_builds(build_ids=reopened, now=now)
    return True
