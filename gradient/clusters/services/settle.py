"""Settlement of a started attempt (cluster-jobs.md, Recovery): the first deciding report resolves the
attempt with settlement.resolve's verdict, and that verdict settles every member.

| verdict  | attempt   | cluster   | members |
|----------|-----------|-----------|---------|
| Complete | Succeeded | Completed | reported members settle; running ones get AbortJob and end Aborted |
| Retry    | Failed    | Queued    | every member job goes back to the assignment passes (through the book) |
| Fail     | Failed    | Failed    | own outcome, requeueing kinds made permanent; survivors end Aborted |
| Abort    | Aborted   | Aborted   | reported members settle, survivors end Aborted |

A member's JobCompleted or JobFailed releases its job (its assignment row closes) but holds back the
build's or evaluation's own transition until the verdict: the held-back transition is applied here, by
the verdict, through the same scheduling functions a single job's report would call.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

from gradient.clusters import history
from gradient.clusters.decisions import settlement
from gradient.clusters.decisions.settlement import (
    AttemptFacts,
    MemberDisposition,
    MemberOutcome,
    MemberResult,
    MemberSettlement,
    Resolution,
    Verdict,
)
from gradient.clusters.decisions.types import FailureKind, MemberAddress, SlotKind
from gradient.clusters.models import (
    ClusterAttempt,
    ClusterJob,
    ClusterMember,
    ClusterReservation,
    ClusterSeat,
)
from gradient.clusters.selectors import needed_outside_its_cluster
from gradient.clusters.services.attempts import close_cluster_attempt, member_rows, parse_member_key
from gradient.clusters.services.common import Push, abort_job_message, attempt_seats, push
from gradient.core.jobkey import build_key, eval_key
from gradient.core.vocab import EVALUATION_TERMINAL, BuildStatus, JobKeyKind
from gradient.scheduling.models import DerivationBuild, DispatchedJob, Evaluation
from gradient.scheduling.services import lifecycle
from gradient.scheduling.services.evaluations import evaluation_cancel

BUILD_CAN_START_AGAIN = (
    BuildStatus.CREATED,
    BuildStatus.QUEUED,
    BuildStatus.BUILDING,
    BuildStatus.FAILED_TRANSIENT,
)


def job_statuses(job_keys: Sequence[str]) -> dict[str, str]:
    """The status of each member job by its key (a missing job is absent)."""
    evals: list[uuid.UUID] = []
    builds: list[uuid.UUID] = []
    for key in job_keys:
        kind, job_id = parse_member_key(key)
        (evals if kind == SlotKind.EVAL else builds).append(job_id)
    out = {eval_key(i): s for i, s in Evaluation.objects.filter(id__in=evals).values_list("id", "status")}
    out.update(
        {
            build_key(i): s
            for i, s in DerivationBuild.objects.filter(id__in=builds).values_list("id", "status")
        }
    )
    return out


def member_is_dead(job_key: str, status: str | None) -> bool:
    """The member job can never start again: its evaluation ended, its shared build ended for good."""
    if status is None:
        return True
    if job_key.startswith(JobKeyKind.EVAL.prefix):
        return status in EVALUATION_TERMINAL
    return status not in BUILD_CAN_START_AGAIN


def failure_kind(value: str | None) -> FailureKind | None:
    if value is None:
        return None
    try:
        return FailureKind(value)
    except ValueError:
        return FailureKind.PERMANENT


def attempt_facts(
    cluster: ClusterJob, seats: Sequence[ClusterSeat], *, abort_requested: bool = False
) -> AttemptFacts:
    statuses = job_statuses([s.job_key for s in seats])
    primary = dict(ClusterMember.objects.filter(cluster_job_id=cluster.id).values_list("id", "primary"))
    return AttemptFacts(
        members=tuple(
            MemberResult(
                role=s.role,
                index=s.index,
                job_key=s.job_key,
                primary=bool(primary.get(s.member_id, False)),
                outcome=MemberOutcome(s.result),
                failure_kind=failure_kind(s.failure_kind),
                error=s.error,
                can_start=not member_is_dead(s.job_key, statuses.get(s.job_key)),
            )
            for s in seats
        ),
        attempts=cluster.attempts,
        retry_budget=cluster.retry_budget,
        abort_requested=abort_requested,
    )


def resolve_attempt(
    *, cluster: ClusterJob, attempt: ClusterAttempt, now: datetime, abort_requested: bool = False
) -> list[Push] | None:
    """Resolve a started, open attempt if what its members showed decides a verdict; None while nothing
    decides yet. The caller holds the cluster lock."""
    seats = attempt_seats(attempt.id)
    resolution = settlement.resolve(attempt_facts(cluster, seats, abort_requested=abort_requested))
    if resolution is None:
        return None
    return apply_resolution(cluster=cluster, attempt=attempt, seats=seats, resolution=resolution, now=now)


def _verdict_reason(resolution: Resolution, seats: Sequence[ClusterSeat]) -> str:
    shown = [f"{s.role}[{s.index}] {s.result}" for s in seats if s.result != MemberOutcome.RUNNING]
    return f"{resolution.verdict.value}: " + (", ".join(shown) or "abort requested")


def apply_resolution(
    *,
    cluster: ClusterJob,
    attempt: ClusterAttempt,
    seats: Sequence[ClusterSeat],
    resolution: Resolution,
    now: datetime,
) -> list[Push]:
    """Close the attempt with the verdict's outcome, settle every member by it, and move the cluster."""
    reason = _verdict_reason(resolution, seats)
    rows = {r.id: r for r in member_rows(attempt.id)}
    by_key = {d.job_key: d for d in resolution.members}
    pushes: list[Push] = []
    for seat in seats:
        row = rows.get(seat.assignment_id) if seat.assignment_id is not None else None
        if row is not None and row.finished_at is None and by_key[seat.job_key].abort_running:
            pushes.append(push(row.worker_id, abort_job_message(row.job_id, row.id, reason)))
    close_cluster_attempt(
        attempt_id=attempt.id,
        outcome=resolution.attempt_outcome.value,
        reason=reason,
        now=now,
        verdict=resolution.verdict.value,
    )
    for seat in seats:
        row = rows.get(seat.assignment_id) if seat.assignment_id is not None else None
        settle_member_job(
            cluster_id=cluster.id, seat=seat, row=row, disposition=by_key[seat.job_key], now=now, why=reason
        )
    set_cluster_status(cluster=cluster, verdict=resolution.verdict, reason=reason, now=now)
    return pushes


def set_cluster_status(*, cluster: ClusterJob, verdict: Verdict, reason: str, now: datetime) -> None:
    status = settlement.cluster_status(verdict).value
    if verdict == Verdict.RETRY:
        ClusterJob.objects.filter(id=cluster.id).update(
            status=status,
            queued_at=now,
            retry_at=None,
            waiting_reason=None,
            waiting_since=None,
            updated_at=now,
        )
    else:
        ClusterJob.objects.filter(id=cluster.id).update(
            status=status,
            finished_at=now,
            retry_at=None,
            waiting_reason=None,
            waiting_since=None,
            updated_at=now,
        )
        ClusterReservation.objects.filter(cluster_job_id=cluster.id).delete()
    history.append(cluster.id, history.status_facts(status, reason), now)


def settle_member_job(
    *,
    cluster_id: uuid.UUID,
    seat: ClusterSeat,
    row: DispatchedJob | None,
    disposition: MemberDisposition,
    now: datetime,
    why: str,
) -> None:
    """Apply one member's settlement to its job (an evaluation or a shared build) and note it on the seat."""
    kind, job_id = parse_member_key(seat.job_key)
    note = f"cluster {cluster_id} {why}"
    if disposition.settlement == MemberSettlement.REQUEUED:
        if row is not None:
            lifecycle.requeue_job(row, now=now, refund=True, reason=note)
    elif kind == SlotKind.EVAL:
        _settle_evaluation(job_id, row, disposition, now, note)
    else:
        _settle_build(job_id, row, disposition, seat, now, note)
    ClusterSeat.objects.filter(id=seat.id).update(settlement=disposition.settlement.value, settled_at=now)


def _settle_evaluation(
    evaluation_id: uuid.UUID,
    row: DispatchedJob | None,
    disposition: MemberDisposition,
    now: datetime,
    note: str,
) -> None:
    if disposition.settlement == MemberSettlement.COMPLETED and row is not None:
        # the evaluation job's own success transition, held back until the verdict
        lifecycle.complete_evaluation(row, now)
    elif disposition.settlement == MemberSettlement.FAILED:
        evaluation = Evaluation.objects.filter(id=evaluation_id).first()
        if evaluation is None:
            return
        kind = disposition.failure_kind.value if disposition.failure_kind else "permanent"
        error = f"{kind}: {disposition.error}" if disposition.error else kind
        lifecycle.fail_evaluation(evaluation, now, error, reason=f"{error} ({note})")
    else:
        evaluation_cancel(evaluation_id=evaluation_id, reason=disposition.error or note, now=now)


_BUILD_FAILURE_STATUS = {
    FailureKind.PERMANENT: BuildStatus.FAILED_PERMANENT,
    FailureKind.TIMEOUT: BuildStatus.FAILED_TIMEOUT,
    FailureKind.ABORTED: BuildStatus.ABORTED,
}


def _settle_build(
    build_id: uuid.UUID,
    row: DispatchedJob | None,
    disposition: MemberDisposition,
    seat: ClusterSeat | None,
    now: datetime,
    note: str,
) -> None:
    if disposition.settlement == MemberSettlement.COMPLETED and row is not None:
        lifecycle.complete_build(row, now=now, substituted=seat.substituted if seat is not None else False)
        return
    if disposition.settlement == MemberSettlement.FAILED:
        kind = disposition.failure_kind or FailureKind.PERMANENT
        status = _BUILD_FAILURE_STATUS.get(kind, BuildStatus.FAILED_PERMANENT)
        error = disposition.error or note
    else:
        if needed_outside_its_cluster(build_id):
            # Spared, as an evaluation's cancel spares a shared build another evaluation needs: it goes
            # back to the queue (its running try closes Aborted, unspent) and, its cluster ended, is
            # handed out as a single job; aborting it would leave those evaluations waiting on it.
            if row is not None:
                lifecycle.requeue_job(row, now=now, refund=True, reason=disposition.error or note)
            return
        kind, status, error = FailureKind.ABORTED, BuildStatus.ABORTED, disposition.error or note
    lifecycle.end_build(build_id=build_id, status=status, kind=kind.value, error=error, now=now, row=row)


def abort_member_job(*, job_key: str, row: DispatchedJob | None, reason: str, now: datetime) -> None:
    """End a member job Aborted outside any verdict (the cluster was aborted or recovered as Aborted
    while the member was not running): an active evaluation is cancelled, an abortable build aborted."""
    kind, job_id = parse_member_key(job_key)
    disposition = MemberDisposition(
        address=MemberAddress("", 0), job_key=job_key, settlement=MemberSettlement.ABORTED, error=reason
    )
    if kind == SlotKind.EVAL:
        _settle_evaluation(job_id, row, disposition, now, reason)
    else:
        _settle_build(job_id, row, disposition, None, now, reason)
