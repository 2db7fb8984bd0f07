"""Submitting and cancelling evaluations."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.db.models import Exists, OuterRef

from gradient.scheduling.effects import send_to_worker_on_commit
from gradient.scheduling.models import (
    BUILD_ABORTABLE,
    EVALUATION_ACTIVE,
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    Evaluation,
    EvaluationBuild,
    EvaluationStatus,
    FlakeSourceKind,
    Project,
)
from gradient.scheduling.services.reports import forget_sent

STORE_PREFIX = "/nix/store/"


def evaluation_create(
    *,
    project: Project,
    repository: str,
    commit: str,
    wildcards: list[str] | None = None,
    wait_for_workers: bool = False,
    priority: bool = False,
    created_by_id: int | None = None,
    now: datetime,
) -> Evaluation:
    """A new Queued evaluation. A /nix/store/... repository (an uploaded source) is a cached source."""
    source_kind = (
        FlakeSourceKind.CACHED if repository.startswith(STORE_PREFIX) else FlakeSourceKind.REPOSITORY
    )
    evaluation = Evaluation.objects.create(
        project=project,
        repository=repository,
        commit=commit,
        wildcards=list(wildcards or []),
        wait_for_workers=wait_for_workers,
        priority=priority,
        source_kind=source_kind,
        created_by_id=created_by_id,
    )
    forget_sent(evaluation.job_key)
    return evaluation


@dataclass(frozen=True)
class CancelResult:
    cancelled: bool
    aborted_builds: int
    abort_jobs: int


def evaluation_cancel(*, evaluation_id: uuid.UUID, reason: str, now: datetime) -> CancelResult:
    """End an active evaluation Aborted. Its running eval job gets AbortJob; its shared builds that no
    other active evaluation needs are aborted (running ones get AbortJob); a shared build that another
    evaluation still needs keeps running."""
    with transaction.atomic():
        changed = Evaluation.objects.filter(id=evaluation_id, status__in=EVALUATION_ACTIVE).update(
            status=EvaluationStatus.ABORTED,
            finished_at=now,
            updated_at=now,
            waiting_reason=None,
            waiting_since=None,
            followup_pending=False,
        )
        if not changed:
            return CancelResult(False, 0, 0)
        abort_jobs = 0
        for row in DispatchedJob.objects.filter(evaluation_id=evaluation_id, finished_at__isnull=True):
            send_to_worker_on_commit(row.worker_id, _abort_job(row, reason))
            abort_jobs += 1

        other_needs = EvaluationBuild.objects.filter(
            build_id=OuterRef("pk"), blocks_evaluation=True, evaluation__status__in=EVALUATION_ACTIVE
        ).exclude(evaluation_id=evaluation_id)
        orphaned = list(
            DerivationBuild.objects.filter(
                evaluation_links__evaluation_id=evaluation_id, status__in=BUILD_ABORTABLE
            )
            .exclude(Exists(other_needs))
            .values_list("id", flat=True)
        )
        aborted = DerivationBuild.objects.filter(id__in=orphaned, status__in=BUILD_ABORTABLE).update(
            status=BuildStatus.ABORTED, finished_at=now, updated_at=now, last_error=reason[:2000]
        )
        for row in DispatchedJob.objects.filter(derivation_build_id__in=orphaned, finished_at__isnull=True):
            send_to_worker_on_commit(row.worker_id, _abort_job(row, reason))
            abort_jobs += 1
        return CancelResult(True, aborted, abort_jobs)


def _abort_job(row: DispatchedJob, reason: str) -> dict[str, str]:
    return {"type": "AbortJob", "job_id": row.job_id, "assignment_id": str(row.id), "reason": reason}
