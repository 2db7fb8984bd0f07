"""The job loop, one function per worker message after the handshake: the seam between the /proto
consumer (transport) and the scheduler.

Each function is synchronous (the consumer calls it through database_sync_to_async), takes the
speaking session and the strictly decoded message as keyword arguments, and returns the messages to
send back on this socket, possibly none. Whatever it returns is sent after it returned, and every
service called here commits its own transaction first, so an AssignJob only goes out once its claim
is committed. Messages for other workers go through gradient.runtime.outbox on commit.

The consumer has already checked the message is allowed in the session's state and marked the worker
seen. Reports are fenced by the scheduler (gradient.scheduling.services.reports): a report whose
assignment_id is not the job's open assignment on this worker changes nothing.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import msgspec
from django.db import InterfaceError, OperationalError, connection
from django.utils import timezone

from gradient.clusters.selectors import clusters_wait_for_placement, is_cluster_assignment
from gradient.clusters.services import (
    cluster_dispatch_kick,
    cluster_member_answer,
    cluster_member_report,
    cluster_signal_forward,
)
from gradient.core.protocol import (
    AssignJobResponse,
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
from gradient.scheduling.effects import to_server_message
from gradient.scheduling.selectors import unheard_assignment
from gradient.scheduling.services import assignment, offers, reports
from gradient.workers import services
from gradient.workers.services import SessionRef

log = logging.getLogger("gradient.workers")


def server_messages(messages: list[dict[str, Any]]) -> list[ServerMessage]:
    return [to_server_message(m) for m in messages]


NO_REPLY: list[ServerMessage] = []


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
    return server_messages(offers.job_offers(worker_id=session.worker_id, now=now))


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
    return server_messages(offers.job_list(worker_id=session.worker_id, now=timezone.now()))


def request_job_chunk(*, session: SessionRef, message: RequestJobChunk) -> list[ServerMessage]:
    """Store the worker's scores of offered candidates."""
    services.candidate_scores_store(session=session, scores=message.scores, now=timezone.now())
    return []


def request_job(*, session: SessionRef, message: RequestJob) -> list[ServerMessage]:
    """One free slot: score the pending jobs of this kind for this worker, claim the best and answer
    with its AssignJob (the claim has committed when this returns). Unanswered, the request is an idle
    slot for cluster placement and gets no reply."""
    now = timezone.now()
    try:
        handed = assignment.request_job(worker_id=session.worker_id, protocol_kind=message.kind, now=now)
    except (OperationalError, InterfaceError):
        # The connection died while claiming. Dying at COMMIT, the claim may have won without this call
        # hearing so: that job is this worker's now and must go out, or it would stay open on a worker
        # that never heard of it. Otherwise it rolled back, and the consumer asks again.
        drop_connection()
        unheard = unheard_assignment(session.worker_id, now)
        if unheard is None:
            raise
        log.warning("a claim for worker %s committed unheard; handing it out", session.worker_id)
        return server_messages([unheard])
    if handed is None:
        _kick_cluster_dispatch(now)
        return []
    return server_messages([handed.message()])


def _kick_cluster_dispatch(now: datetime) -> None:
    """An unanswered RequestJob is a new idle slot: run the cluster-dispatch pass at once (under its
    lease; skipped when another runner holds it, or when no cluster waits to be placed). Its AssignJobs
    leave through the channel layer on commit. A failing pass must not cost this worker its session:
    the periodic pass tries again."""
    try:
        if clusters_wait_for_placement(now=now):
            cluster_dispatch_kick(timezone.now())
    except Exception:
        log.exception("the cluster-dispatch kick failed")


def assign_job_response(*, session: SessionRef, message: AssignJobResponse) -> list[ServerMessage]:
    """Accepted: note it. Declined (draining or full): the job goes back to the pool and is offered
    again. A cluster member's answer goes to its attempt's prepare instead. A response naming anything
    but the job's open assignment on this worker is dropped."""
    return _report(session, message)


def _report(session: SessionRef, message: Any) -> list[ServerMessage]:
    """A report or an answer to an AssignJob. A cluster member's goes to the cluster code (its prepare,
    its verdict), everything else to the scheduler; both fence it by its assignment_id."""
    raw: dict[str, Any] = msgspec.to_builtins(message)
    now = timezone.now()
    if is_cluster_assignment(raw.get("assignment_id", "")):
        if raw["type"] == "AssignJobResponse":
            cluster_member_answer(
                worker_id=session.worker_id,
                assignment_id=raw["assignment_id"],
                accepted=bool(raw.get("accepted")),
                reason=raw.get("reason"),
                now=now,
            )
        else:
            cluster_member_report(worker_id=session.worker_id, message=raw, now=now)
        return []
    reports.handle_report(worker_id=session.worker_id, message=raw, now=now)
    return []


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


def cluster_signal(*, session: SessionRef, message: ClusterSignal) -> list[ServerMessage]:
    """Forward within a started attempt, from one of its members; anything else is dropped."""
    to = msgspec.to_builtins(message.to) if message.to is not None else None
    cluster_signal_forward(
        worker_id=session.worker_id,
        attempt_id=message.attempt,
        to=to,
        payload=message.payload,
        now=timezone.now(),
    )
    return []
