"""The job loop, one function per worker message after the handshake: the seam between the /proto
consumer (transport) and the domain.

Each function is synchronous (the consumer runs it on a lane thread, gradient.runtime.lanes), takes the
speaking session and the strictly decoded, typed message, makes one domain call, and returns the typed
messages to send back on this socket, possibly none. Whatever it returns is sent after it returned, and
every service called here has committed its transaction first, so an AssignJob only goes out once its
claim is committed. Messages for other workers leave through gradient.runtime.outbox on commit.

Reports and answers come to `reports` in batches from every session of the process (the consumer's
batcher); the single-report functions below are the same call with a batch of one. The heartbeat
touches no database: `worker_metrics` notes it in memory (gradient.workers.presence), flushed for every
session of the process together.

The consumer has already checked the message is allowed in the session's state and noted the worker
seen. Reports are fenced by the scheduler (gradient.scheduling.services.reports): a report whose
assignment_id is not the job's open assignment on this worker changes nothing.
"""

from __future__ import annotations

import logging

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
from gradient.scheduling.services import assignment, offers, reports
from gradient.scheduling.services.reports import Incoming
from gradient.workers import presence, services
from gradient.workers.services import SessionRef

log = logging.getLogger("gradient.workers")


def worker_capabilities(*, session: SessionRef, message: WorkerCapabilities) -> list[ServerMessage]:
    """Replace the stored capabilities; the consumer then triggers assignment (the offer delta, made
    with other sessions' by dispatcher.offers_batch on the offers lane: what the worker can run now;
    running jobs and earlier offers stay)."""
    services.worker_capabilities_replace(session=session, capabilities=message, now=timezone.now())
    assignment.forget_card(session.session_id)
    return []


def worker_metrics(*, session: SessionRef, message: WorkerMetrics) -> list[ServerMessage]:
    """The 10 s heartbeat: the latest metrics, kept in memory until the next flush (no database here)."""
    presence.note_metrics(
        session_id=session.session_id, worker_id=session.worker_id, metrics=message, now=timezone.now()
    )
    return []


def presence_flush() -> int:
    """Write every session's seen and metrics noted since the last flush; on failure they are kept
    for the next one."""
    entries = presence.take()
    try:
        return services.presence_flush(entries=entries)
    except Exception:
        presence.put_back(entries)
        raise


def draining(*, session: SessionRef, message: Draining) -> list[ServerMessage]:
    """The worker is stopping: assign it nothing more."""
    services.worker_session_drain(session=session, now=timezone.now())
    assignment.forget_card(session.session_id)
    return []


def request_job_list(*, session: SessionRef, message: RequestJobList) -> list[ServerMessage]:
    """The full candidate list in pages of 1 000, the last one is_final (one empty final page when
    there is nothing); the worker has then been offered exactly these."""
    return list(offers.job_list(worker_id=session.worker_id, now=timezone.now()))


def request_job_chunk(*, session: SessionRef, message: RequestJobChunk) -> list[ServerMessage]:
    """Store the worker's scores of offered candidates."""
    offers.candidate_scores_store(worker_id=session.worker_id, scores=message.scores, now=timezone.now())
    assignment.forget_card(session.session_id)
    return []


def request_job(*, session: SessionRef, message: RequestJob) -> list[ServerMessage]:
    """One free slot: the AssignJob of the best pending job of this kind for this worker (its claim has
    committed when this returns). Unanswered, the request is an idle slot for cluster placement and gets
    no reply."""
    handed = assignment.hand_out(
        worker_id=session.worker_id,
        protocol_kind=message.kind,
        now=timezone.now(),
        session_id=session.session_id,
    )
    return [handed] if handed is not None else []


def _report(session: SessionRef, message: Incoming) -> list[ServerMessage]:
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
    reports.worker_report(worker_id=session.worker_id, message=message, now=timezone.now())
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
