"""Worker reports: JobUpdate, JobCompleted, JobFailed, BuildProgress, EvalProgress, AssignJobResponse.

Every report is fenced by its assignment_id: it acts only when that id is the job's open assignment on
this worker. Anything else (a stale id, another worker's id, a report after close, a malformed id) is
dropped: no state change, no error, no close. Each report is one transaction.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import F

from gradient.records.schemas import ReportKind
from gradient.scheduling import history, jobs
from gradient.scheduling.decisions.failures import (
    BuildVerdict,
    EvalVerdict,
    decide_build_failure,
    decide_eval_failure,
)
from gradient.scheduling.models import (
    EVALUATION_TERMINAL,
    BuildAttempt,
    BuildAttemptOutcome,
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    DispatchOutcome,
    Evaluation,
    EvaluationKind,
    EvaluationStatus,
    JobKind,
)
from gradient.scheduling.services import drv_recovery, eval_parts, graph
from gradient.scheduling.services.claims import assignment_close
from gradient.workers.models import CandidateScore, SentCandidate

log = logging.getLogger("gradient.reports")

REPORT_TYPES = frozenset({"JobUpdate", "JobCompleted", "JobFailed", "BuildProgress", "EvalProgress"})

EVAL_PHASES = {
    "fetching": EvaluationStatus.FETCHING,
    "evaluating_flake": EvaluationStatus.EVALUATING_FLAKE,
    "evaluating_derivations": EvaluationStatus.EVALUATING_DERIVATION,
}
EVAL_RUNNING = (
    EvaluationStatus.QUEUED,
    EvaluationStatus.FETCHING,
    EvaluationStatus.EVALUATING_FLAKE,
    EvaluationStatus.EVALUATING_DERIVATION,
)


@dataclass(frozen=True)
class ReportOutcome:
    accepted: bool
    detail: str = ""


DROPPED = ReportOutcome(False, "dropped: not the job's open assignment on this worker")
MEMBER = ReportOutcome(False, "a cluster member's report: the cluster code settles it")


def _parse_uuid(value: Any) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value))
    except (ValueError, TypeError, AttributeError):
        return None


def fenced_assignment(*, worker_id: uuid.UUID, job_key: str, assignment_id: str) -> DispatchedJob | None:
    """The open assignment the report names, locked, or None when the report must be dropped."""
    parsed = _parse_uuid(assignment_id)
    if parsed is None:
        return None
    return (
        DispatchedJob.objects.select_for_update(no_key=True)
        .filter(id=parsed, job_id=job_key, worker_id=worker_id, finished_at__isnull=True)
        .first()
    )


def forget_scores(job_key: str) -> None:
    """A finished job is nobody's candidate again: the workers' scores of it go, so that a RequestJob
    reads only scores of jobs that can still be handed out."""
    CandidateScore.objects.filter(job_id=job_key).delete()


def forget_sent(job_key: str) -> None:
    """Return a job to the pool: clear its sent flag for every worker, so the next offer includes it."""
    SentCandidate.objects.filter(job_id=job_key).delete()


def handle_report(*, worker_id: uuid.UUID, message: dict[str, Any], now: datetime) -> ReportOutcome:
    handler = _HANDLERS.get(message["type"])
    if handler is None:
        raise ValueError(f"not a report: {message['type']}")
    with transaction.atomic():
        row = fenced_assignment(
            worker_id=worker_id, job_key=message["job_id"], assignment_id=message["assignment_id"]
        )
        if row is None:
            return DROPPED
        if row.cluster_attempt_id is not None:
            return MEMBER
        DispatchedJob.objects.filter(id=row.id).update(last_report_at=now)
        outcome = handler(row, message, now)
        _evidence(row, message, outcome, now)
        return outcome


def _evidence(row: DispatchedJob, message: dict[str, Any], outcome: ReportOutcome, now: datetime) -> None:
    """What the worker showed goes onto the evaluation's record: answers, results and endings (not every
    progress tick)."""
    kind = message["type"]
    report: ReportKind | None = None
    if kind == "AssignJobResponse":
        report = ReportKind.ACCEPTED if message.get("accepted") else ReportKind.DECLINED
    elif kind == "JobCompleted":
        report = ReportKind.COMPLETED
    elif kind == "JobFailed":
        report = ReportKind.FAILED
    elif kind == "JobUpdate" and message["update"]["kind"] in ("fetch_result", "eval_result"):
        report = ReportKind.UPDATE
    if report is not None:
        history.reported(row=row, worker=str(row.worker_id), kind=report, summary=outcome.detail, now=now)


# --- AssignJobResponse --------------------------------------------------------------------------------


def _assign_job_response(row: DispatchedJob, message: dict[str, Any], now: datetime) -> ReportOutcome:
    if message.get("accepted"):
        DispatchedJob.objects.filter(id=row.id, accepted_at__isnull=True).update(accepted_at=now)
        return ReportOutcome(True, "accepted")
    reason = message.get("reason") or "declined"
    assignment_return_to_pool(row=row, reason=f"declined: {reason}", lost=False, now=now)
    return ReportOutcome(True, "declined; requeued")


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
                _fail_evaluation(
                    evaluation, now, f"{evaluation.lost_dispatches} evaluation dispatches were lost"
                )
                return True
        requeue_job(row, now=now, refund=not lost, reason=reason)
    return True


def requeue_job(row: DispatchedJob, *, now: datetime, refund: bool, reason: str) -> None:
    """Give a job back to the pool after its assignment closed without a result."""
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


# --- JobUpdate ----------------------------------------------------------------------------------------


def _job_update(row: DispatchedJob, message: dict[str, Any], now: datetime) -> ReportOutcome:
    update = message["update"]
    kind = update["kind"]
    if row.kind == JobKind.EVAL:
        return _eval_update(row, kind, update, now)
    return _build_update(row, kind, update, now)


def _eval_update(row: DispatchedJob, kind: str, update: dict[str, Any], now: datetime) -> ReportOutcome:
    evaluation_id = row.evaluation_id
    if evaluation_id is None or kind not in (*EVAL_PHASES, "fetch_result", "eval_result"):
        return ReportOutcome(False, f"{kind} does not belong to an evaluation job")
    DispatchedJob.objects.filter(id=row.id).update(phase=kind)
    if kind in EVAL_PHASES:
        target = EVAL_PHASES[kind]
        history.evaluation_transition(
            evaluation_id=evaluation_id,
            to=target,
            expect=[s for s in EVAL_RUNNING if s != target],
            reason=f"worker reports {kind}",
            now=now,
        )
        return ReportOutcome(True, kind)
    evaluation = Evaluation.objects.select_for_update(no_key=True).get(id=evaluation_id)
    if evaluation.status in EVALUATION_TERMINAL:
        return ReportOutcome(False, "evaluation already finished")
    if kind == "fetch_result":
        evaluation.flake_source = update["flake_source"]
        evaluation.save(update_fields=["flake_source", "updated_at"])
        return ReportOutcome(True, f"fetched {evaluation.flake_source}")
    return ReportOutcome(*eval_parts.eval_result_part(row=row, evaluation=evaluation, update=update, now=now))


def _build_update(row: DispatchedJob, kind: str, update: dict[str, Any], now: datetime) -> ReportOutcome:
    build_id = row.derivation_build_id
    if build_id is None or kind not in ("building", "build_output"):
        return ReportOutcome(False, f"{kind} does not belong to a build job")
    if str(update.get("build_id")) != str(build_id):
        return ReportOutcome(False, "build_id is not this job's build")
    DispatchedJob.objects.filter(id=row.id).update(phase=kind)
    if kind == "building":
        return ReportOutcome(True, "building")
    outputs = update.get("outputs") or []
    graph.cache_paths(paths=((o["path"], o.get("nar_size") or 0) for o in outputs))
    substituted = bool(update.get("substituted"))
    complete_build(row, now=now, substituted=substituted)
    return ReportOutcome(True, "build_output")


def complete_build(row: DispatchedJob, *, now: datetime, substituted: bool = False) -> None:
    build_id = row.derivation_build_id
    if build_id is None:
        return
    status = BuildStatus.SUBSTITUTED if substituted else BuildStatus.COMPLETED
    changed = DerivationBuild.objects.filter(id=build_id, status=BuildStatus.BUILDING).update(
        status=status, finished_at=now, updated_at=now, retry_at=None, failure_kind=None
    )
    BuildAttempt.objects.filter(dispatched_job_id=row.id, outcome=BuildAttemptOutcome.RUNNING).update(
        outcome=BuildAttemptOutcome.SUBSTITUTED if substituted else BuildAttemptOutcome.BUILT, finished_at=now
    )
    if changed:
        forget_scores(row.job_id)
        graph.queue_ready_builds(build_ids=graph.dependents_of(build_id), now=now)
        graph.finish_evaluations(evaluation_ids=graph.evaluations_needing([build_id]), now=now)


# --- JobCompleted -------------------------------------------------------------------------------------


def _job_completed(row: DispatchedJob, message: dict[str, Any], now: datetime) -> ReportOutcome:
    assignment_close(row=row, outcome=DispatchOutcome.COMPLETED, reason="completed", now=now)
    if row.kind == JobKind.BUILD:
        complete_build(row, now=now)
        return ReportOutcome(True, "build completed")
    return _eval_completed(row, now)


def _locked_evaluation(row: DispatchedJob) -> Evaluation:
    assert row.evaluation_id is not None  # an eval assignment always names its evaluation
    return Evaluation.objects.select_for_update(no_key=True).get(id=row.evaluation_id)


def _eval_completed(row: DispatchedJob, now: datetime) -> ReportOutcome:
    evaluation = _locked_evaluation(row)
    if evaluation.status in EVALUATION_TERMINAL:
        return ReportOutcome(True, "evaluation already finished")
    if (incomplete := eval_parts.incomplete_result(row=row, evaluation=evaluation, now=now)) is not None:
        return ReportOutcome(*incomplete)
    steps = tuple(row.job.get("steps") or ())
    if steps == jobs.FETCH_ONLY_STEPS:
        if not evaluation.flake_source:
            _fail_evaluation(evaluation, now, "the fetch completed without a flake_source")
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
        _fail_evaluation(evaluation, now, None)
        return ReportOutcome(True, "evaluation errors: failed")
    if row.phase != "eval_result" and not evaluation.build_links.exists():
        _fail_evaluation(evaluation, now, "the evaluation job completed without an eval_result")
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


def _fail_evaluation(evaluation: Evaluation, now: datetime, error: str | None) -> None:
    errors = [*evaluation.errors, error] if error else list(evaluation.errors)
    history.evaluation_transition(
        evaluation_id=evaluation.id,
        to=EvaluationStatus.FAILED,
        expect=None,
        reason=error or (errors[-1] if errors else "evaluation failed"),
        now=now,
        errors=errors,
    )


# --- JobFailed ----------------------------------------------------------------------------------------


def _job_failed(row: DispatchedJob, message: dict[str, Any], now: datetime) -> ReportOutcome:
    kind = message["kind"]
    error = str(message.get("error") or "")
    assignment_close(row=row, outcome=DispatchOutcome.FAILED, reason=f"{kind}: {error}", now=now)
    if row.kind == JobKind.BUILD:
        return _build_failed(row, kind, error, now, missing_paths=message.get("missing_paths"))
    evaluation = _locked_evaluation(row)
    if evaluation.status in EVALUATION_TERMINAL:
        return ReportOutcome(True, "evaluation already finished")
    if kind in ("canceled", "aborted"):
        requeue_job(row, now=now, refund=True, reason=kind)
        return ReportOutcome(True, f"{kind}: requeued")
    verdict = decide_eval_failure(kind=kind, lost_dispatches=evaluation.lost_dispatches)
    if verdict == EvalVerdict.FAIL:
        _fail_evaluation(evaluation, now, f"{kind}: {error}")
        return ReportOutcome(True, "evaluation failed")
    requeue_job(row, now=now, refund=False, reason=f"{kind}: {error}")
    return ReportOutcome(True, "evaluation requeued")


def _build_failed(
    row: DispatchedJob, kind: str, error: str, now: datetime, missing_paths: list[str] | None = None
) -> ReportOutcome:
    assert row.derivation_build_id is not None  # a build assignment always names its build
    build = DerivationBuild.objects.select_for_update(no_key=True).get(id=row.derivation_build_id)
    BuildAttempt.objects.filter(dispatched_job_id=row.id, outcome=BuildAttemptOutcome.RUNNING).update(
        outcome=BuildAttemptOutcome.ABORTED
        if kind in ("canceled", "aborted")
        else BuildAttemptOutcome.FAILED,
        failure_kind=kind,
        error=error[:10000],
        finished_at=now,
    )
    if build.status != BuildStatus.BUILDING:
        return ReportOutcome(True, f"build already {build.status}")
    if drv_recovery.is_lost_drv_failure(
        kind=kind, error=error, drv_path=build.drv_path, missing_paths=missing_paths
    ):
        drv_recovery.build_mark_drv_lost(build=build, error=error, now=now)
        forget_sent(row.job_id)
        return ReportOutcome(True, "its .drv is lost: waiting for a DrvRecovery evaluation")
    decision = decide_build_failure(
        kind=kind,
        attempts_spent=build.attempts,
        max_attempts=build.max_attempts,
        abort_requested=False,
        now=now,
    )
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
    build.status = {
        BuildVerdict.PERMANENT: BuildStatus.FAILED_PERMANENT,
        BuildVerdict.TIMEOUT: BuildStatus.FAILED_TIMEOUT,
        BuildVerdict.ABORTED: BuildStatus.ABORTED,
    }[decision.verdict]
    build.finished_at = now
    build.save()
    forget_scores(row.job_id)
    failed = graph.fail_dependents(build_ids=[build.id], now=now)
    graph.finish_evaluations(evaluation_ids=graph.evaluations_needing([build.id]), now=now)
    return ReportOutcome(True, f"{build.status}; {failed} dependents failed")


def _progress(row: DispatchedJob, message: dict[str, Any], now: datetime) -> ReportOutcome:
    return ReportOutcome(True, "progress")


_HANDLERS: dict[str, Callable[[DispatchedJob, dict[str, Any], datetime], ReportOutcome]] = {
    "AssignJobResponse": _assign_job_response,
    "JobUpdate": _job_update,
    "JobCompleted": _job_completed,
    "JobFailed": _job_failed,
    "BuildProgress": _progress,
    "EvalProgress": _progress,
}
