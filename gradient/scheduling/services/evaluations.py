"""Submitting and cancelling evaluations."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from gradient.core.protocol import AbortJob
from gradient.core.vocab import (
    BUILD_ABORTABLE,
    EVALUATION_ACTIVE,
    BuildStatus,
    EvaluationKind,
    EvaluationStatus,
    FlakeSourceKind,
)
from gradient.records.errors import UnknownRecord
from gradient.records.schemas import Cancel, parse_job_key
from gradient.records.services import Receipt, commit_control
from gradient.runtime.outbox import push_to_worker_on_commit
from gradient.scheduling import history
from gradient.scheduling.models import (
    DerivationBuild,
    DispatchedJob,
    Evaluation,
    Project,
    eval_key,
)
from gradient.scheduling.services import graph
from gradient.scheduling.services.offers import forget_sent

STORE_PREFIX = "/nix/store/"


class SubmissionGone(Exception):
    """The Idempotency-Key names a submission whose evaluation was since deleted."""


def evaluation_create(
    *,
    project: Project,
    repository: str,
    commit: str,
    wildcards: list[str] | None = None,
    wait_for_workers: bool = False,
    priority: bool = False,
    created_by: User | None = None,
    idempotency_key: str | None = None,
    kind: str = EvaluationKind.NORMAL,
    recovery_of_id: uuid.UUID | None = None,
    supersedes: str | None = None,
    now: datetime,
) -> tuple[Evaluation, bool]:
    """A new Queued evaluation and its record, in one transaction. With an Idempotency-Key that already
    names a submission with the same spec, that evaluation and False; another spec raises
    IdempotencyConflict. A /nix/store/... repository (an uploaded source) is a cached source."""
    source_kind = (
        FlakeSourceKind.CACHED if repository.startswith(STORE_PREFIX) else FlakeSourceKind.REPOSITORY
    )
    evaluation = Evaluation(
        project=project,
        repository=repository,
        commit=commit,
        wildcards=list(wildcards or []),
        wait_for_workers=wait_for_workers,
        priority=priority,
        source_kind=source_kind,
        kind=kind,
        recovery_of_id=recovery_of_id,
        created_by=created_by,
    )
    if idempotency_key is not None:
        existing = history.existing_submission(
            idempotency_key=idempotency_key, spec=history.evaluation_spec(evaluation)
        )
        if existing is not None:
            return existing, False
    try:
        with transaction.atomic():
            evaluation.save()
            job_key, created = history.evaluation_record_create(
                evaluation=evaluation,
                created_by=created_by,
                idempotency_key=idempotency_key,
                now=now,
                supersedes=supersedes,
            )
            if not created:
                raise _Duplicate(job_key)
            history.append(evaluation.id, history.status_facts(EvaluationStatus.QUEUED, "submitted"), now)
    except _Duplicate as duplicate:  # a concurrent submit with the same key won
        winner = history.job_for_record(duplicate.job_key)
        if winner is None:
            raise SubmissionGone(duplicate.job_key) from None
        return winner, False
    forget_sent(evaluation.job_key)
    return evaluation, True


class _Duplicate(Exception):
    def __init__(self, job_key: str) -> None:
        super().__init__(job_key)
        self.job_key = job_key


def evaluation_request_cancel(*, evaluation_id: uuid.UUID, actor: str, now: datetime) -> Receipt | None:
    """Cancel as a control intent on the evaluation's record; the control hook carries it out once the
    intent committed. An evaluation without a record (made outside the services) is cancelled directly."""
    try:
        return commit_control(
            job_key=eval_key(evaluation_id),
            intent=Cancel(reason=f"cancelled by {actor}"),
            actor=actor,
            now=now,
        )
    except UnknownRecord:
        evaluation_cancel(evaluation_id=evaluation_id, reason=f"cancelled by {actor}", now=now)
        return None


def on_control(receipt: Receipt) -> None:
    """Carry out an operator's intent on an evaluation (registered in SchedulingConfig.ready)."""
    _, evaluation_id = parse_job_key(receipt.job_key)
    now = timezone.now()
    if receipt.intent in ("cancel", "abandon"):
        evaluation_cancel(evaluation_id=evaluation_id, reason=f"{receipt.intent} by {receipt.actor}", now=now)
    elif receipt.intent == "give_up":
        evaluation_cancel(
            evaluation_id=evaluation_id,
            reason=f"given up by {receipt.actor}",
            now=now,
            status=EvaluationStatus.FAILED,
        )


@dataclass(frozen=True)
class CancelResult:
    cancelled: bool
    aborted_builds: int
    abort_jobs: int


def evaluation_cancel(
    *, evaluation_id: uuid.UUID, reason: str, now: datetime, status: str = EvaluationStatus.ABORTED
) -> CancelResult:
    """End an active evaluation Aborted (or Failed, for give up). Its running eval job gets AbortJob;
    its shared builds that no other active evaluation needs are aborted (running ones get AbortJob); a
    shared build that another evaluation still needs keeps running."""
    with transaction.atomic():
        changed = history.evaluation_transition(
            evaluation_id=evaluation_id,
            to=status,
            expect=EVALUATION_ACTIVE,
            reason=reason,
            now=now,
        )
        if not changed:
            return CancelResult(False, 0, 0)
        abort_jobs = 0
        for row in DispatchedJob.objects.filter(evaluation_id=evaluation_id, finished_at__isnull=True):
            push_to_worker_on_commit(row.worker_id, abort_job_message(row, reason))
            abort_jobs += 1
        aborted, build_jobs = abort_orphaned_builds(evaluation_id=evaluation_id, reason=reason, now=now)
        return CancelResult(True, aborted, abort_jobs + build_jobs)


def abort_orphaned_builds(*, evaluation_id: uuid.UUID, reason: str, now: datetime) -> tuple[int, int]:
    """The shared builds of an evaluation that has ended which no other active evaluation needs are
    aborted (running ones get AbortJob); returns (builds aborted, AbortJobs sent). Call inside the
    transaction that ended the evaluation."""
    orphaned = graph.abort_unneeded_builds(
        evaluation_id=evaluation_id, statuses=BUILD_ABORTABLE, reason=reason, now=now
    )
    aborted = DerivationBuild.objects.filter(id__in=orphaned, status=BuildStatus.ABORTED).count()
    abort_jobs = 0
    for row in DispatchedJob.objects.filter(derivation_build_id__in=orphaned, finished_at__isnull=True):
        push_to_worker_on_commit(row.worker_id, abort_job_message(row, reason))
        abort_jobs += 1
    return aborted, abort_jobs


def abort_job_message(row: DispatchedJob, reason: str) -> AbortJob:
    """AbortJob for the worker running `row`'s job."""
    return AbortJob(job_id=row.job_id, assignment_id=str(row.id), reason=reason[:2000])
