"""Worker reports of single jobs: JobUpdate, JobCompleted, JobFailed, BuildProgress, EvalProgress, and the
AssignJobResponse to an AssignJob. They arrive as the protocol's typed messages and are matched by type.

Every report is fenced by its assignment_id: it acts only when that id is the job's open assignment on
this worker. Anything else (a stale id, another worker's id, a report after close, a malformed id) is
dropped: no state change, no error, no close. Each report is one transaction; what it changes, it
changes through services.lifecycle. A cluster member's report is the cluster code's (the caller routes
it there; here it is refused as MEMBER).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime
from typing import TypeAlias

from django.db import transaction

from gradient.core.ids import parse_uuid
from gradient.core.protocol import (
    AssignJobResponse,
    BuildProgress,
    EvalProgress,
    EvalResult,
    FetchResult,
    JobCompleted,
    JobFailed,
    JobUpdate,
)
from gradient.core.vocab import DispatchOutcome, JobKind
from gradient.records.schemas import ReportKind
from gradient.scheduling.models import DispatchedJob
from gradient.scheduling.services import lifecycle
from gradient.scheduling.services.claims import assignment_close
from gradient.scheduling.services.lifecycle import ReportOutcome

Report: TypeAlias = JobUpdate | JobCompleted | JobFailed | BuildProgress | EvalProgress
"""A report echoes the assignment_id it is about."""
Answer: TypeAlias = AssignJobResponse
"""The worker's answer to an AssignJob."""

DROPPED = ReportOutcome(False, "dropped: not the job's open assignment on this worker")
MEMBER = ReportOutcome(False, "a cluster member's report: the cluster code settles it")

MemberHandler = Callable[..., ReportOutcome]
"""Called as handler(worker_id=, message=, now=) for a report or answer about a cluster member's
assignment (the cluster code's, registered from its AppConfig.ready)."""
_member_handler: MemberHandler | None = None


def register_member_handler(handler: MemberHandler) -> None:
    global _member_handler
    _member_handler = handler


def _is_member_assignment(assignment_id: str) -> bool:
    parsed = parse_uuid(assignment_id)
    return (
        parsed is not None and DispatchedJob.objects.filter(id=parsed, cluster_attempt__isnull=False).exists()
    )


def worker_report(*, worker_id: uuid.UUID, message: Report | Answer, now: datetime) -> ReportOutcome:
    """Any report or answer a worker sends: a cluster member's goes to the cluster code (its prepare,
    its verdict), every other to handle_report. Both fence it by its assignment_id."""
    if _member_handler is not None and _is_member_assignment(message.assignment_id):
        return _member_handler(worker_id=worker_id, message=message, now=now)
    return handle_report(worker_id=worker_id, message=message, now=now)


def fenced_assignment(*, worker_id: uuid.UUID, job_key: str, assignment_id: str) -> DispatchedJob | None:
    """The open assignment the report names, locked, or None when the report must be dropped."""
    parsed = parse_uuid(assignment_id)
    if parsed is None:
        return None
    return (
        DispatchedJob.objects.select_for_update(no_key=True)
        .filter(id=parsed, job_id=job_key, worker_id=worker_id, finished_at__isnull=True)
        .first()
    )


def handle_report(*, worker_id: uuid.UUID, message: Report | Answer, now: datetime) -> ReportOutcome:
    """Apply one report or answer of a single job, fenced by its assignment_id, in one transaction."""
    with transaction.atomic():
        row = fenced_assignment(
            worker_id=worker_id, job_key=message.job_id, assignment_id=message.assignment_id
        )
        if row is None:
            return DROPPED
        if row.cluster_attempt_id is not None:
            return MEMBER
        lifecycle.note_report(row, now=now)
        outcome = _apply(row, message, now)
        record_evidence(row, message, outcome, now)
        return outcome


def _apply(row: DispatchedJob, message: Report | Answer, now: datetime) -> ReportOutcome:
    match message:
        case AssignJobResponse(accepted=True):
            lifecycle.note_accepted(row, now=now)
            return ReportOutcome(True, "accepted")
        case AssignJobResponse(reason=reason):
            why = f"declined: {reason or 'declined'}"
            lifecycle.assignment_return_to_pool(row=row, reason=why, lost=False, now=now)
            return ReportOutcome(True, "declined; requeued")
        case JobUpdate(update=update):
            return lifecycle.apply_job_update(row, update, now)
        case JobCompleted():
            assignment_close(row=row, outcome=DispatchOutcome.COMPLETED, reason="completed", now=now)
            if row.kind == JobKind.BUILD:
                lifecycle.complete_build(row, now=now)
                return ReportOutcome(True, "build completed")
            return lifecycle.complete_evaluation(row, now)
        case JobFailed(kind=kind, error=error, missing_paths=missing_paths):
            reason = f"{kind.value}: {error}"
            assignment_close(row=row, outcome=DispatchOutcome.FAILED, reason=reason, now=now)
            if row.kind == JobKind.BUILD:
                return lifecycle.fail_build(
                    row, kind=kind.value, error=error, now=now, missing_paths=missing_paths
                )
            return lifecycle.fail_evaluation_job(row, kind=kind.value, error=error, now=now)
        case BuildProgress() | EvalProgress():
            return ReportOutcome(True, "progress")


def record_evidence(
    row: DispatchedJob, message: Report | Answer, outcome: ReportOutcome, now: datetime
) -> None:
    """What the worker showed goes onto the evaluation's record: answers, results and endings (not every
    progress tick)."""
    report: ReportKind | None = None
    match message:
        case AssignJobResponse(accepted=accepted):
            report = ReportKind.ACCEPTED if accepted else ReportKind.DECLINED
        case JobCompleted():
            report = ReportKind.COMPLETED
        case JobFailed():
            report = ReportKind.FAILED
        case JobUpdate(update=FetchResult() | EvalResult()):
            report = ReportKind.UPDATE
    if report is not None:
        lifecycle.record_report(row, worker=str(row.worker_id), kind=report, summary=outcome.detail, now=now)
