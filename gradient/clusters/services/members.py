"""What a member's worker says, and what happens when it goes away: the service functions the worker
session's job loop calls for cluster members (route with selectors.is_cluster_assignment).

- cluster_member_answer: the AssignJobResponse to a member's AssignJob. An accept counts toward the
  start; a reject closes the attempt PrepareFailed, AbortCluster to every member.
- cluster_member_report: JobUpdate, JobCompleted, JobFailed, BuildProgress, EvalProgress of a member's
  assignment, fenced by assignment_id exactly like a single job's report. Before the start only a held
  member's JobFailed counts (a failed prepare); after it, progress is applied like a single job's and
  the first deciding JobCompleted/JobFailed resolves the attempt.
- cluster_signal_forward: ClusterSignal, only within a started attempt and only from one of its members.
- cluster_worker_lost: a disconnected or dropped worker; its members are lost into their attempt's
  verdict, never requeued as single jobs.

Each call is one transaction that first locks the member's cluster row. Every message (StartCluster,
AbortCluster, AbortJob, ClusterSignal) is pushed through the channel layer once it committed; the list
returned says what was pushed.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.db import transaction

from gradient.clusters.decisions import coordinator
from gradient.clusters.decisions.coordinator import (
    HeldMemberFailed,
    MemberAccepted,
    MemberRejected,
)
from gradient.clusters.decisions.settlement import MemberOutcome, classify_failure
from gradient.clusters.decisions.types import FailureKind, MemberAddress
from gradient.clusters.models import ClusterAttempt, ClusterJob, ClusterReservation, ClusterSeat
from gradient.clusters.services.attempts import attempt_event
from gradient.clusters.services.common import (
    Push,
    attempt_seats,
    attempt_state,
    cluster_signal_message,
    lock_cluster,
    push,
)
from gradient.clusters.services.settle import failure_kind, job_statuses, resolve_attempt
from gradient.core.ids import parse_uuid
from gradient.core.protocol import (
    AssignJobResponse,
    BuildOutput,
    ClusterAddress,
    JobCompleted,
    JobFailed,
    JobUpdate,
    tag_of,
)
from gradient.core.vocab import BuildStatus, DispatchOutcome, EvaluationStatus, JobKind
from gradient.records.schemas import ReportKind
from gradient.scheduling.models import DispatchedJob
from gradient.scheduling.services import graph, lifecycle
from gradient.scheduling.services.claims import assignment_close
from gradient.scheduling.services.lifecycle import ReportOutcome
from gradient.scheduling.services.reports import (
    DROPPED,
    Answer,
    Report,
    fenced_assignment,
    record_evidence,
)
from gradient.workers.models import IdleSlot

log = logging.getLogger("gradient.clusters")

MAX_SIGNAL_PAYLOAD = 64 * 1024
HOLD_EXPIRED_ERROR = "cluster start timed out"


def _member_ref(assignment_id: uuid.UUID) -> tuple[uuid.UUID, uuid.UUID] | None:
    """(attempt id, cluster id) of a member's assignment row, read without a lock."""
    row = (
        DispatchedJob.objects.filter(id=assignment_id, cluster_attempt__isnull=False)
        .values_list("cluster_attempt_id", "cluster_attempt__cluster_job_id")
        .first()
    )
    if row is None or row[0] is None:
        return None
    return row[0], row[1]


def _locked(assignment_id: uuid.UUID) -> tuple[ClusterJob, ClusterAttempt] | None:
    ref = _member_ref(assignment_id)
    if ref is None:
        return None
    attempt_id, cluster_id = ref
    cluster = lock_cluster(cluster_id)
    attempt = ClusterAttempt.objects.filter(id=attempt_id).first()
    if cluster is None or attempt is None:
        return None
    return cluster, attempt


# --- AssignJobResponse ----------------------------------------------------------------------------------


def cluster_member_answer(
    *, worker_id: uuid.UUID, assignment_id: str | uuid.UUID, accepted: bool, reason: str | None, now: datetime
) -> list[Push]:
    """A worker's answer to a member's AssignJob. The last accept starts the attempt (StartCluster with
    the roster to every member); a reject closes it PrepareFailed (AbortCluster to every member, the
    cluster backs off, the worker is down-ranked for a while). An answer for anything but an open member
    assignment on this worker is dropped."""
    parsed = parse_uuid(assignment_id)
    if parsed is None:
        return []
    with transaction.atomic():
        locked = _locked(parsed)
        if locked is None:
            return []
        cluster, attempt = locked
        row = (
            DispatchedJob.objects.select_for_update(no_key=True)
            .filter(id=parsed, worker_id=worker_id, finished_at__isnull=True, cluster_attempt_id=attempt.id)
            .first()
        )
        if row is None or attempt.finished_at is not None:
            return []
        worker = str(worker_id)
        if accepted:
            # the coordinator decides on the seats as they were before this answer
            pushes = attempt_event(
                cluster=cluster, attempt=attempt, event=MemberAccepted(row.job_id, worker), now=now
            )
            lifecycle.note_report(row, now=now)
            lifecycle.note_accepted(row, now=now)
            ClusterSeat.objects.filter(
                attempt_id=attempt.id, assignment_id=row.id, accepted_at__isnull=True
            ).update(accepted_at=now)
            lifecycle.record_report(
                row,
                worker=worker,
                kind=ReportKind.ACCEPTED,
                summary="holding for the cluster start",
                now=now,
            )
            return pushes
        why = reason or "declined"
        lifecycle.record_report(
            row, worker=worker, kind=ReportKind.DECLINED, summary=f"cluster prepare: {why}", now=now
        )
        return attempt_event(
            cluster=cluster, attempt=attempt, event=MemberRejected(row.job_id, worker, why), now=now
        )


# --- Reports --------------------------------------------------------------------------------------------


def cluster_member_message(*, worker_id: uuid.UUID, message: Report | Answer, now: datetime) -> ReportOutcome:
    """A message about a member's assignment: its answer to AssignJob or a report (the scheduling
    reports' member handler, registered from this app's AppConfig.ready)."""
    if isinstance(message, AssignJobResponse):
        cluster_member_answer(
            worker_id=worker_id,
            assignment_id=message.assignment_id,
            accepted=message.accepted,
            reason=message.reason,
            now=now,
        )
        return ReportOutcome(True, "a cluster member's answer")
    return cluster_member_report(worker_id=worker_id, message=message, now=now)


def cluster_member_report(*, worker_id: uuid.UUID, message: Report, now: datetime) -> ReportOutcome:
    """A member's report, fenced by its assignment_id like a single job's (anything else is dropped)."""
    parsed = parse_uuid(message.assignment_id)
    if parsed is None:
        return DROPPED
    with transaction.atomic():
        locked = _locked(parsed)
        if locked is None:
            return DROPPED
        cluster, attempt = locked
        row = fenced_assignment(worker_id=worker_id, job_key=message.job_id, assignment_id=str(parsed))
        if row is None or row.cluster_attempt_id != attempt.id or attempt.finished_at is not None:
            return DROPPED
        lifecycle.note_report(row, now=now)
        if attempt.started_at is None:
            return _before_start(cluster, attempt, row, message, now)
        if isinstance(message, JobCompleted | JobFailed):
            return _member_finished(cluster, attempt, row, message, now)
        return _progress(row, message, now)


def _before_start(
    cluster: ClusterJob, attempt: ClusterAttempt, row: DispatchedJob, message: Report, now: datetime
) -> ReportOutcome:
    """A held member runs nothing before StartCluster. Its JobFailed (hold expired, drain, AbortJob) is a
    failed prepare, and never reaches the build or evaluation."""
    if not isinstance(message, JobFailed):
        return ReportOutcome(False, "held member: nothing runs before StartCluster")
    event = HeldMemberFailed(
        row.job_id,
        str(row.worker_id),
        f"{message.kind.value}: {message.error}",
        hold_expired=HOLD_EXPIRED_ERROR in message.error,
    )
    attempt_event(cluster=cluster, attempt=attempt, event=event, now=now)
    return ReportOutcome(True, "held member failed: the prepare failed")


def _progress(row: DispatchedJob, message: Report, now: datetime) -> ReportOutcome:
    """Progress of a started member is applied like a single job's (the scheduling lifecycle's JobUpdate,
    and its evidence on the evaluation's record), except a build's result: its build_output is kept on
    the seat and the build completes only by the verdict."""
    if not isinstance(message, JobUpdate):
        return ReportOutcome(True, "progress")
    update = message.update
    if row.kind == JobKind.BUILD and isinstance(update, BuildOutput):
        if update.build_id != str(row.derivation_build_id):
            return ReportOutcome(False, "build_id is not this job's build")
        lifecycle.note_phase(row, "build_output")
        graph.cache_paths(paths=((o.path, o.nar_size) for o in update.outputs))
        ClusterSeat.objects.filter(assignment_id=row.id).update(substituted=update.substituted)
        return ReportOutcome(True, "build_output: held until the cluster attempt is decided")
    outcome = lifecycle.apply_job_update(row, update, now)
    record_evidence(row, message, outcome, now)
    return outcome


def _job_aborted(row: DispatchedJob) -> bool:
    """The member's own job was aborted from outside (its evaluation cancelled, its build aborted)."""
    status = job_statuses([row.job_id]).get(row.job_id)
    if row.kind == JobKind.EVAL:
        return status in (EvaluationStatus.ABORTED, EvaluationStatus.FAILED)
    return status == BuildStatus.ABORTED


def _member_finished(
    cluster: ClusterJob,
    attempt: ClusterAttempt,
    row: DispatchedJob,
    message: JobCompleted | JobFailed,
    now: datetime,
) -> ReportOutcome:
    """JobCompleted/JobFailed: the job is released (its row closes) and its result held on the seat; the
    first deciding report resolves the attempt and the verdict settles every member."""
    worker = str(row.worker_id)
    if isinstance(message, JobCompleted):
        assignment_close(row=row, outcome=DispatchOutcome.COMPLETED, reason="completed", now=now)
        ClusterSeat.objects.filter(assignment_id=row.id).update(
            result=MemberOutcome.SUCCEEDED, reported_at=now
        )
        lifecycle.record_report(
            row, worker=worker, kind=ReportKind.COMPLETED, summary="held for the cluster verdict", now=now
        )
    else:
        raw_kind = message.kind.value
        kind = failure_kind(raw_kind) or FailureKind.PERMANENT
        error = message.error
        outcome = classify_failure(kind, evaluation_aborted=_job_aborted(row))
        assignment_close(row=row, outcome=DispatchOutcome.FAILED, reason=f"{raw_kind}: {error}", now=now)
        ClusterSeat.objects.filter(assignment_id=row.id).update(
            result=outcome, failure_kind=kind.value, error=error[:10000], reported_at=now
        )
        lifecycle.record_report(
            row, worker=worker, kind=ReportKind.FAILED, summary=f"{raw_kind}: {error}", now=now
        )
    pushes = resolve_attempt(cluster=cluster, attempt=attempt, now=now)
    what = tag_of(type(message))
    if pushes is None:
        return ReportOutcome(True, f"{what}: held until the cluster attempt is decided")
    attempt.refresh_from_db(fields=["verdict"])
    return ReportOutcome(True, f"{what}: the cluster attempt is decided: {attempt.verdict}")


# --- Signals --------------------------------------------------------------------------------------------


class _Malformed(Exception):
    pass


def _address(to: ClusterAddress | Mapping[str, Any] | None) -> MemberAddress | None:
    """The `to` of a ClusterSignal as an address, None when absent; raises _Malformed otherwise."""
    if to is None:
        return None
    if isinstance(to, ClusterAddress):
        return MemberAddress(to.role, to.index)
    if not isinstance(to, Mapping):
        raise _Malformed
    role, index = to.get("role"), to.get("index")
    if not isinstance(role, str) or not isinstance(index, int) or isinstance(index, bool):
        raise _Malformed
    return MemberAddress(role, index)


def cluster_signal_forward(
    *,
    worker_id: uuid.UUID,
    attempt_id: str | uuid.UUID,
    to: ClusterAddress | Mapping[str, Any] | None,
    payload: str,
    now: datetime,
) -> list[Push]:
    """Forward a ClusterSignal from a member of a started, open attempt: to the member `to` names (role
    and index), or to every other member when `to` is absent. Anything else is dropped (empty list)."""
    parsed = parse_uuid(attempt_id)
    try:
        address = _address(to)
    except _Malformed:
        return []
    if parsed is None or not isinstance(payload, str):
        return []
    if len(payload.encode()) > MAX_SIGNAL_PAYLOAD:
        return []
    with transaction.atomic():
        attempt = ClusterAttempt.objects.filter(id=parsed).select_related("cluster_job").first()
        if attempt is None:
            return []
        state = attempt_state(attempt.cluster_job, attempt, attempt_seats(attempt.id))
        route = coordinator.route_signal(state, str(worker_id), address)
        if route is None:
            return []
        message = cluster_signal_message(str(attempt.id), route.sender, payload)
        return [push(w, message) for w in route.recipients]


# --- A worker lost --------------------------------------------------------------------------------------


def cluster_worker_lost(*, worker_id: uuid.UUID, now: datetime) -> list[Push]:
    """The worker disconnected or missed its heartbeats. Each member it held or ran is lost into its
    attempt: before the start that is a failed prepare, after it the member is lost into the verdict
    (Retry, Fail, ...); never a requeue as a single job. Its idle slots go, and so does a reservation
    that counted on it."""
    IdleSlot.objects.filter(worker_id=worker_id).delete()
    for reservation in ClusterReservation.objects.all():
        if any(s.get("worker_id") == str(worker_id) for s in reservation.seats or []):
            ClusterReservation.objects.filter(id=reservation.id).delete()
    pushes: list[Push] = []
    rows = list(
        DispatchedJob.objects.filter(
            worker_id=worker_id, finished_at__isnull=True, cluster_attempt__isnull=False
        )
        .order_by("cluster_attempt__cluster_job_id", "job_id")
        .values_list("id", flat=True)
    )
    for assignment_id in rows:
        with transaction.atomic():
            locked = _locked(assignment_id)
            if locked is None:
                continue
            cluster, attempt = locked
            row = (
                DispatchedJob.objects.select_for_update(no_key=True)
                .filter(id=assignment_id, finished_at__isnull=True)
                .first()
            )
            if row is None or attempt.finished_at is not None:
                continue
            lifecycle.record_report(
                row, worker=str(worker_id), kind=ReportKind.LOST, summary="worker lost", now=now
            )
            if attempt.started_at is None:
                event = HeldMemberFailed(row.job_id, str(worker_id), "worker lost")
                pushes += attempt_event(cluster=cluster, attempt=attempt, event=event, now=now)
                continue
            assignment_close(row=row, outcome=DispatchOutcome.ABANDONED, reason="worker lost", now=now)
            ClusterSeat.objects.filter(assignment_id=row.id).update(
                result=MemberOutcome.LOST, error="worker lost", reported_at=now
            )
            pushes += resolve_attempt(cluster=cluster, attempt=attempt, now=now) or []
    return pushes
