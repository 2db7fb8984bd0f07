"""An evaluation's record, written by the scheduler: every status change, claim, close and report of an
evaluation appends its fact in the same transaction as the row change (records.record_append_facts
holds the record row until the caller commits).

`evaluation_transition` is the one way an evaluation's status changes: a conditional UPDATE on the
status it expects, and its fact, together.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any

from django.contrib.auth.models import User
from django.db import transaction

from gradient.core.vocab import EVALUATION_TERMINAL, DispatchOutcome, EvaluationStatus, RecordKind
from gradient.records.models import JobRecord
from gradient.records.schemas import (
    AssignmentClaimed,
    AssignmentClosed,
    Fact,
    Outcome,
    OutcomeCommitted,
    ReportKind,
    RowStatus,
    StatusChanged,
    WorkerReport,
    parse_job_key,
)
from gradient.records.services import (
    plan_default,
    record_append_facts,
    record_append_facts_many,
    record_by_idempotency_key,
    record_create,
)
from gradient.scheduling.models import DispatchedJob, Evaluation, eval_key

TERMINAL_OUTCOME: dict[str, Outcome] = {
    EvaluationStatus.COMPLETED.value: Outcome.SUCCEEDED,
    EvaluationStatus.FAILED.value: Outcome.FAILED,
    EvaluationStatus.ABORTED.value: Outcome.CANCELLED,
}


def evaluation_spec(evaluation: Evaluation) -> dict[str, Any]:
    """The submitted spec, as the record's header keeps it and as Idempotency-Key compares it."""
    return {
        "project": evaluation.project.name,
        "repository": evaluation.repository,
        "commit": evaluation.commit,
        "wildcards": list(evaluation.wildcards or []),
        "wait_for_workers": evaluation.wait_for_workers,
        "priority": evaluation.priority,
        "kind": evaluation.kind,
    }


def job_for_record(job_key: str) -> Evaluation | None:
    """The evaluation a record names (an idempotent repeat answers with it)."""
    _, evaluation_id = parse_job_key(job_key)
    return Evaluation.objects.select_related("project").filter(id=evaluation_id).first()


def evaluation_record_create(
    *,
    evaluation: Evaluation,
    created_by: User | None,
    idempotency_key: str | None,
    now: datetime,
    supersedes: str | None = None,
) -> tuple[str, bool]:
    """Write the evaluation's record header in the caller's transaction. Returns (job key of the record,
    created): with an Idempotency-Key that already names a submission, that submission's key. With
    `supersedes` (a restart), the header names the job it supersedes and is one generation later."""
    record, created = record_create(
        job_key=eval_key(evaluation.id),
        spec=evaluation_spec(evaluation),
        plan=plan_default(kind=RecordKind.EVALUATION),
        created_by=created_by,
        idempotency_key=idempotency_key,
        supersedes=supersedes,
        now=now,
    )
    return record.job_key, created


def existing_submission(*, idempotency_key: str, spec: dict[str, Any]) -> Evaluation | None:
    """The evaluation an Idempotency-Key already names with this spec (raises IdempotencyConflict for
    another spec). A tombstoned record still answers, so a late repeat cannot recreate the job."""
    record = record_by_idempotency_key(idempotency_key=idempotency_key, spec=spec)
    return job_for_record(record.job_key) if record is not None else None


def append(evaluation_id: uuid.UUID, facts: list[Fact], now: datetime, actor: str = "scheduler") -> None:
    """Append in the caller's transaction. An evaluation made outside the services (the admin's add form,
    SQL) gets its record on its first fact, so it is never a job without a history."""
    if not facts:
        return
    key = eval_key(evaluation_id)
    if not JobRecord.objects.filter(job_key=key).exists():
        evaluation = Evaluation.objects.select_related("project").get(id=evaluation_id)
        evaluation_record_create(evaluation=evaluation, created_by=None, idempotency_key=None, now=now)
    record_append_facts(job_key=key, facts=facts, now=now, actor=actor)


def append_many(facts: Mapping[uuid.UUID, Sequence[Fact]], now: datetime, actor: str = "scheduler") -> None:
    """append for many evaluations at once (a pass's claims), in the caller's transaction: one read of
    which records exist (one made outside the services gets its record first, as append does), then
    one set append of every record's facts."""
    wanted = {evaluation_id: bodies for evaluation_id, bodies in facts.items() if bodies}
    if not wanted:
        return
    keys = {evaluation_id: eval_key(evaluation_id) for evaluation_id in wanted}
    known = set(JobRecord.objects.filter(job_key__in=list(keys.values())).values_list("job_key", flat=True))
    for evaluation_id, key in keys.items():
        if key not in known:
            evaluation = Evaluation.objects.select_related("project").get(id=evaluation_id)
            evaluation_record_create(evaluation=evaluation, created_by=None, idempotency_key=None, now=now)
    record_append_facts_many(facts={keys[e]: bodies for e, bodies in wanted.items()}, now=now, actor=actor)


def status_facts(status: str, reason: str) -> list[Fact]:
    facts: list[Fact] = [StatusChanged(status=RowStatus(status), reason=reason[:500])]
    if status in TERMINAL_OUTCOME:
        facts.append(OutcomeCommitted(outcome=TERMINAL_OUTCOME[status], cause=reason[:500]))
    return facts


def evaluation_transition(
    *,
    evaluation_id: uuid.UUID,
    to: str,
    expect: Collection[str] | None,
    reason: str,
    now: datetime,
    **fields: Any,
) -> bool:
    """Move the evaluation to `to` if its status is one of `expect` (None: any active status), with its
    fact. Returns False, writing nothing, when the row was not in an expected status."""
    allowed = (
        [s.value for s in EvaluationStatus if s not in EVALUATION_TERMINAL]
        if expect is None
        else list(expect)
    )
    updates: dict[str, Any] = {"status": to, "updated_at": now, **fields}
    if to in EVALUATION_TERMINAL:
        updates.setdefault("finished_at", now)
        updates.setdefault("waiting_reason", None)
        updates.setdefault("waiting_since", None)
        updates.setdefault("followup_pending", False)
    with transaction.atomic():
        changed = Evaluation.objects.filter(id=evaluation_id, status__in=allowed).update(**updates)
        if changed:
            append(evaluation_id, status_facts(to, reason), now)
    return bool(changed)


def submission_number(evaluation_id: uuid.UUID) -> int:
    """Submissions are the evaluation's hand-outs, numbered from 1 in the order of their claims."""
    return DispatchedJob.objects.filter(evaluation_id=evaluation_id).count()


def claimed(
    *,
    row_id: uuid.UUID,
    evaluation_id: uuid.UUID,
    worker: str,
    now: datetime,
    cluster_attempt_id: uuid.UUID | None = None,
) -> None:
    """Call right after the claim won, in its transaction (the new row counts as the latest)."""
    number = submission_number(evaluation_id)
    append(
        evaluation_id,
        [
            AssignmentClaimed(
                submission=number,
                assignment_id=row_id,
                worker=worker,
                attempt=number,
                cluster_attempt_id=cluster_attempt_id,
            )
        ],
        now,
    )


def closed(*, row: DispatchedJob, outcome: str, reason: str, now: datetime) -> None:
    if row.evaluation_id is not None:
        append(
            row.evaluation_id,
            [AssignmentClosed(assignment_id=row.id, outcome=DispatchOutcome(outcome), reason=reason[:500])],
            now,
        )


def reported(*, row: DispatchedJob, worker: str, kind: ReportKind, summary: str, now: datetime) -> None:
    if row.evaluation_id is not None:
        append(
            row.evaluation_id,
            [WorkerReport(assignment_id=row.id, worker=worker, kind=kind, summary=summary[:500])],
            now,
        )
