"""The job loop, one function per worker message after the handshake: the seam between the /proto
consumer (transport) and the domain.

Each function is synchronous (the consumer calls it through database_sync_to_async), takes the
speaking session and the strictly decoded, typed message, makes one domain call, and returns the typed
messages to send back on this socket, possibly none. Whatever it returns is sent after it returned, and
every service called here commits its own transaction first, so an AssignJob only goes out once its
claim is committed. Messages for other workers leave through gradient.runtime.outbox on commit.

The consumer has already checked the message is allowed in the session's state and marked the worker
seen. Reports are fenced by the scheduler (gradient.scheduling.services.reports): a report whose
assignment_id is not the job's open assignment on this worker changes nothing.
"""

from __future__ import annotations

import logging

from django.db import connection
from django.utils import timezone

from gradient.clusters.services import cluster_signal_forward
from gradient.core.protocol import (
    AssignJobResponse,
    BuildLog,
    BuildProgress,
    ClusterSignal,
    Draining,
    EvalProgress,
    JobCompleted,
    JobFailed,
    JobUpdate,
    RequestJob,
    RequestJobChunk,
    RequestJobList,
    ServerMessage,
    WorkerCapabilities,
    WorkerMetrics,
)
from gradient.scheduling.services import assignment, logs, offers, reports
from gradient.workers import services
from gradient.workers.services import SessionRef

log = logging.getLogger("gradient.workers")


def drop_connection() -> None:
    """Forget this thread's database connection after it died; the next query opens a new one."""
    try:
        connection.close()
    except Exception:  # it is dead already
        log.debug("closing a dead database connection failed", exc_info=True)


def worker_capabilities(*, session: SessionRef, message: WorkerCapabilities) -> list[ServerMessage]:
    """Replace the stored capabilities and trigger assignment: offer the worker what it can run now
    (running jobs and earlier offers stay)."""
    now = timezone.now()
    services.worker_capabilities_replace(session=session, capabilities=message, now=now)
    return list(offers.job_offers(worker_id=session.worker_id, now=now))


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
    return list(offers.job_list(worker_id=session.worker_id, now=timezone.now()))


def request_job_chunk(*, session: SessionRef, message: RequestJobChunk) -> list[ServerMessage]:
    """Store the worker's scores of offered candidates."""
    offers.candidate_scores_store(worker_id=session.worker_id, scores=message.scores, now=timezone.now())
    return []


def request_job(*, session: SessionRef, message: RequestJob) -> list[ServerMessage]:
    """One free slot: the AssignJob of the best pending job of this kind for this worker (its claim has
    committed when this returns). Unanswered, the request is an idle slot for cluster placement and gets
    no reply."""
    handed = assignment.hand_out(worker_id=session.worker_id, protocol_kind=message.kind, now=timezone.now())
    return [handed] if handed is not None else []


def _report(
    session: SessionRef,
    message: AssignJobResponse | JobUpdate | JobCompleted | JobFailed | BuildProgress | EvalProgress,
) -> list[ServerMessage]:
    reports.worker_report(worker_id=session.worker_id, message=message, now=timezone.now())
    return []


def assign_job_response(*, session: SessionRef, message: AssignJobResponse) -> list[ServerMessage]:
    """Accepted: note it. Declined (draining or full): the job goes back to the pool and is offered
    again. A cluster member's answer goes to its attempt's prepare instead. A response naming anything
    but the job's open assignment on this worker is dropped."""
    return _report(session, message)


def job_update(*, session: SessionRef, message: JobUpdate) -> list[ServerMessage]:
    return _report(session, message)


def job_completed(*, session: SessionRef, message: JobCompleted) -> list[ServerMessage]:
    return _report(session, message)


def job_failed(*, session: SessionRef, message: JobFailed) -> list[ServerMessage]:
    return _report(session, message)


def build_progress(*, session: SessionRef, message: BuildProgress) -> list[ServerMessage]:
    return _report(session, message)


def eval_progress(*, session: SessionRef, message: EvalProgress) -> list[ServerMessage]:
    return _report(session, message)


def build_log(*, session: SessionRef, message: BuildLog) -> list[ServerMessage]:
    """The next piece of a build's log: stored (a repeat's new tail only, a gap marked), fenced like
    every report, cluster members' included; never answered."""
    logs.build_log_append(worker_id=session.worker_id, message=message, now=timezone.now())
    return []


def cluster_signal(*, session: SessionRef, message: ClusterSignal) -> list[ServerMessage]:
    """Forward within a started attempt, from one of its members; anything else is dropped."""
    cluster_signal_forward(
        worker_id=session.worker_id,
        attempt_id=message.attempt,
        to=message.to,
        payload=message.payload,
        now=timezone.now(),
    )
    return []
