"""What a failed build or evaluation job does next, read from its rows: scheduling.decisions.failures
with what the pure decision cannot see, namely how many times in a row the reporting worker canceled
this build or evaluation (issue 34, item 9: a worker that keeps answering `canceled` for one job must
not hold it forever).

lifecycle.fail_build calls `build_failure_decision` in place of `decide_build_failure`; it runs inside
fail_build's transaction, with the build row locked and the failed try already closed with its failure
kind. lifecycle.fail_evaluation_job calls `evaluation_cancel_decision` for a `canceled` or `aborted`
evaluation job, in its transaction, with the evaluation row locked and the assignment already closed
(its reason `<kind>: <error>`)."""

from __future__ import annotations

import uuid
from datetime import datetime

from django.conf import settings
from django.db.models import F

from gradient.core.vocab import DispatchOutcome, FailureKind, JobKind
from gradient.scheduling.decisions.failures import (
    MAX_LOST_EVAL_DISPATCHES,
    BuildFailureDecision,
    BuildVerdict,
    cancels_in_a_row,
    decide_build_failure,
)
from gradient.scheduling.models import BuildAttempt, DerivationBuild, DispatchedJob, Evaluation

# How far back a run of cancels is looked for: a run longer than this is long enough to count anyway.
_TRIES_LOOKED_AT = 64


def worker_cancels_in_a_row(*, build_id: uuid.UUID, worker_id: uuid.UUID | None) -> int:
    """The tries of the build that `worker_id` ended `canceled` one after another, newest first until
    its latest try that ended otherwise (other workers' tries in between do not count; see
    decisions.failures.cancels_in_a_row)."""
    if worker_id is None:
        return 0
    # Newest first by start: a refunded try's number is given again to the next one.
    tries = BuildAttempt.objects.filter(build_id=build_id).order_by("-started_at", "-number")
    pairs = [
        (str(worker) if worker is not None else None, kind)
        for worker, kind in tries.values_list("worker_id", "failure_kind")[:_TRIES_LOOKED_AT]
    ]
    return cancels_in_a_row(pairs, str(worker_id))


def build_failure_decision(
    *, build: DerivationBuild, row: DispatchedJob, kind: str, now: datetime
) -> BuildFailureDecision:
    """decide_build_failure for the build of `row` (the assignment whose try just failed `kind`), with
    the reporting worker's cancels in a row counted from the build's tries and the free cancels of
    GRADIENT_BUILD_FREE_CANCELS."""
    # Only a cancel reads the tries: every other failure is decided as before, with no query more.
    in_a_row = (
        worker_cancels_in_a_row(build_id=build.id, worker_id=row.worker_id)
        if kind == FailureKind.CANCELED
        else 0
    )
    return decide_build_failure(
        kind=kind,
        attempts_spent=build.attempts,
        max_attempts=build.max_attempts,
        abort_requested=False,
        now=now,
        cancels_in_a_row=in_a_row,
        free_cancels=settings.GRADIENT_BUILD_FREE_CANCELS,
    )


def _assignment_failure_kind(outcome: str | None, reason: str) -> str | None:
    """The failure kind of a closed evaluation assignment: a Failed one's reason is `<kind>: <error>`
    (reports: JobFailed); any other close (Completed, Abandoned: declined or lost) or an open one has
    none, and so breaks a run of cancels."""
    if outcome != DispatchOutcome.FAILED:
        return None
    return reason.split(":", 1)[0]


def worker_eval_cancels_in_a_row(*, evaluation_id: uuid.UUID, worker_id: uuid.UUID | None) -> int:
    """The evaluation's job assignments that `worker_id` ended `canceled` one after another, newest
    first until its latest one that ended otherwise: the evaluation's counterpart of
    worker_cancels_in_a_row, counted by the same decisions.failures.cancels_in_a_row."""
    if worker_id is None:
        return 0
    rows = DispatchedJob.objects.filter(evaluation_id=evaluation_id, kind=JobKind.EVAL).order_by(
        "-dispatched_at", "-id"
    )
    pairs = [
        (str(worker), _assignment_failure_kind(outcome, reason))
        for worker, outcome, reason in rows.values_list("worker_id", "outcome", "reason")[:_TRIES_LOOKED_AT]
    ]
    return cancels_in_a_row(pairs, str(worker_id))


def evaluation_cancel_decision(
    *, evaluation: Evaluation, row: DispatchedJob, kind: str, now: datetime
) -> BuildFailureDecision:
    """What a `canceled` (or `aborted`) evaluation job does next, by the builds' rule
    (decide_build_failure with GRADIENT_BUILD_FREE_CANCELS): a free cancel requeues it (REQUEUE);
    past the free ones in a row by one worker each cancel is a failed attempt, counted in the
    evaluation's `lost_dispatches` here (RETRY: requeue it), and the one that reaches
    MAX_LOST_EVAL_DISPATCHES fails the evaluation (PERMANENT), as lost dispatches do. An evaluation
    has no backoff: `retry_at` is not used."""
    in_a_row = (
        worker_eval_cancels_in_a_row(evaluation_id=evaluation.id, worker_id=row.worker_id)
        if kind == FailureKind.CANCELED
        else 0
    )
    decision = decide_build_failure(
        kind=kind,
        attempts_spent=evaluation.lost_dispatches + 1,
        max_attempts=MAX_LOST_EVAL_DISPATCHES,
        abort_requested=False,
        now=now,
        cancels_in_a_row=in_a_row,
        free_cancels=settings.GRADIENT_BUILD_FREE_CANCELS,
    )
    if decision.verdict != BuildVerdict.REQUEUE:
        Evaluation.objects.filter(id=evaluation.id).update(lost_dispatches=F("lost_dispatches") + 1)
        evaluation.lost_dispatches += 1
    return decision
