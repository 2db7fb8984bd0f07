"""The job loop, one function per worker message after the handshake: the seam between the /proto
consumer (transport) and the scheduler.

Each function is synchronous (the consumer calls it through database_sync_to_async), takes the
speaking session and the strictly decoded message as keyword arguments, and returns the messages to
send back on this socket, possibly none. Whatever it returns is sent after it returned, so a message
about a row (AssignJob) must only be returned once the row's transaction committed. Messages for
other workers go through gradient.workers.push on commit.

The consumer has already checked the message is allowed in the session's state and marked the worker
seen. What is here now is what the workers app owns: storing capabilities, metrics, scores and idle
slots, answering RequestJobList from `candidates_for_worker`, fencing reports, forwarding cluster
signals. Scoring, claims and the effect of reports on builds and evaluations belong to the scheduler,
which fills in the bodies marked below.
"""

from __future__ import annotations

from django.utils import timezone

from gradient.workers import services
from gradient.workers.protocol import (
    MAX_CANDIDATES_PER_FRAME,
    AssignJobResponse,
    BuildProgress,
    ClusterSignal,
    Draining,
    EvalProgress,
    JobCompleted,
    JobFailed,
    JobListChunk,
    JobUpdate,
    ReportMessage,
    RequestJob,
    RequestJobChunk,
    RequestJobList,
    ServerMessage,
    WorkerCapabilities,
    WorkerMetrics,
    tag_of,
)
from gradient.workers.selectors import candidates_for_worker, dispatch_open_for_report
from gradient.workers.services import SessionRef

NO_REPLY: list[ServerMessage] = []


def worker_capabilities(*, session: SessionRef, message: WorkerCapabilities) -> list[ServerMessage]:
    """Replace the stored capabilities. (Scheduler: kick build assignment here.)"""
    services.worker_capabilities_replace(session=session, capabilities=message, now=timezone.now())
    return []


def worker_metrics(*, session: SessionRef, message: WorkerMetrics) -> list[ServerMessage]:
    """The 10 s heartbeat: keep the latest metrics."""
    services.worker_metrics_record(session=session, metrics=message, now=timezone.now())
    return []


def draining(*, session: SessionRef, message: Draining) -> list[ServerMessage]:
    """The worker is stopping: assign it nothing more."""
    services.worker_session_drain(session=session, now=timezone.now())
    return []


def request_job_list(*, session: SessionRef, message: RequestJobList) -> list[ServerMessage]:
    """The full candidate list in pages of 1 000, the last one is_final (one empty final page when
    there is nothing); the worker has then been offered exactly these."""
    candidates = candidates_for_worker(worker_id=session.worker_id, now=timezone.now())
    services.sent_candidates_reset(worker_id=session.worker_id, job_ids=(c.job_id for c in candidates))
    pages: list[ServerMessage] = []
    for start in range(0, max(len(candidates), 1), MAX_CANDIDATES_PER_FRAME):
        page = candidates[start : start + MAX_CANDIDATES_PER_FRAME]
        pages.append(
            JobListChunk(candidates=page, is_final=start + MAX_CANDIDATES_PER_FRAME >= len(candidates))
        )
    return pages


def request_job_chunk(*, session: SessionRef, message: RequestJobChunk) -> list[ServerMessage]:
    """Store the worker's scores of offered candidates."""
    services.candidate_scores_store(session=session, scores=message.scores, now=timezone.now())
    return []


def request_job(*, session: SessionRef, message: RequestJob) -> list[ServerMessage]:
    """One free slot. (Scheduler: score the pending jobs of this kind, claim the best, return its
    AssignJob after the claim committed.) Unanswered, it becomes an idle slot and gets no reply."""
    services.idle_slot_record(session=session, kind=message.kind, now=timezone.now())
    return []


def assign_job_response(*, session: SessionRef, message: AssignJobResponse) -> list[ServerMessage]:
    """Accepted: note it. Declined (draining or full): the job goes back to the pool and is offered
    again. A response naming anything but the job's open assignment on this worker is dropped."""
    dispatch = dispatch_open_for_report(
        worker_id=session.worker_id, job_id=message.job_id, assignment_id=message.assignment_id
    )
    if dispatch is None:
        return []
    now = timezone.now()
    if message.accepted:
        services.dispatch_accept(dispatch_id=dispatch.id, now=now)
    elif dispatch.cluster_attempt_id is None:  # a declined member fails its cluster's prepare instead
        reason = f"declined by the worker: {message.reason}" if message.reason else "declined by the worker"
        services.dispatch_return_to_pool(dispatch_id=dispatch.id, reason=reason, lost=False, now=now)
    return []


def _fenced_report(*, session: SessionRef, message: ReportMessage, phase: str | None = None) -> bool:
    """True when the report names the job's open assignment on this worker (and records it); a stale,
    foreign or garbage assignment_id is dropped with no state change, no error and no close."""
    dispatch = dispatch_open_for_report(
        worker_id=session.worker_id, job_id=message.job_id, assignment_id=message.assignment_id
    )
    if dispatch is None:
        return False
    return services.dispatch_report_record(dispatch_id=dispatch.id, phase=phase, now=timezone.now())


def job_update(*, session: SessionRef, message: JobUpdate) -> list[ServerMessage]:
    """(Scheduler: fetch_result, eval_result, building and build_output move the job on.)"""
    _fenced_report(session=session, message=message, phase=tag_of(type(message.update)))
    return []


def job_completed(*, session: SessionRef, message: JobCompleted) -> list[ServerMessage]:
    """(Scheduler: close the assignment Completed and settle the job.)"""
    _fenced_report(session=session, message=message)
    return []


def job_failed(*, session: SessionRef, message: JobFailed) -> list[ServerMessage]:
    """(Scheduler: close the assignment Failed and apply the failure kind.)"""
    _fenced_report(session=session, message=message)
    return []


def build_progress(*, session: SessionRef, message: BuildProgress) -> list[ServerMessage]:
    _fenced_report(session=session, message=message)
    return []


def eval_progress(*, session: SessionRef, message: EvalProgress) -> list[ServerMessage]:
    _fenced_report(session=session, message=message)
    return []


def cluster_signal(*, session: SessionRef, message: ClusterSignal) -> list[ServerMessage]:
    """Forward within a started attempt, from one of its members; anything else is dropped."""
    services.cluster_signal_route(session=session, signal=message)
    return []
