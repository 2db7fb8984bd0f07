"""The single-assignment claim: one conditional INSERT decides who gets a job.

    INSERT INTO dispatched_job (...) SELECT ... WHERE EXISTS (start condition)
    ON CONFLICT (job_id) WHERE finished_at IS NULL DO NOTHING RETURNING id

Won when a row came back. The partial unique index idx-dispatched_job-open-job arbitrates between
connections and server instances; the start condition (the shared build is Queued, the evaluation is
not terminal) is checked by the same statement. A lost claim raises nothing and writes nothing.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import connection

from gradient.core.vocab import EVALUATION_TERMINAL, BuildStatus, DispatchOutcome, JobKind
from gradient.scheduling import history
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
    sql = (
        f"INSERT INTO dispatched_job ({', '.join(_COLUMNS)}) "  # noqa: S608 (fixed column list)
        f"SELECT {select_list} WHERE EXISTS ({condition_sql}) "
        "ON CONFLICT (job_id) WHERE finished_at IS NULL DO NOTHING RETURNING id"
    )
    params = [_prep(c, values[c]) for c in _COLUMNS] + condition_params
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return assignment_id if row is not None else None


def assignment_close(*, row: DispatchedJob, outcome: DispatchOutcome, reason: str, now: datetime) -> bool:
    """Close an open assignment, with its fact on the evaluation's record. False (and nothing written)
    when it was closed already: every close carries WHERE finished_at IS NULL."""
    closed = DispatchedJob.objects.filter(id=row.id, finished_at__isnull=True).update(
        finished_at=now, outcome=outcome, reason=reason[:2000]
    )
    if closed == 1:
        history.closed(row=row, outcome=outcome, reason=reason, now=now)
    return closed == 1
