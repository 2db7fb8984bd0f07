"""Project: a folded Job plus what the scheduler shows now, as the Status a caller reads."""

from __future__ import annotations

import enum
from datetime import datetime

import msgspec

from gradient.core.vocab import RecordKind
from gradient.records.decisions.discovery import Discovery, foreign_objects, unsettled_reasons
from gradient.records.decisions.fold import Job
from gradient.records.schemas import Desired, Outcome, RowStatus


class Phase(enum.StrEnum):
    QUEUED = "queued"  # waiting to be dispatched
    HELD = "held"  # an operator holds it back from new submissions
    DISPATCHED = "dispatched"  # claimed, not yet accepted (a cluster: not yet started)
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Status(msgspec.Struct, frozen=True, kw_only=True):
    job_key: str
    kind: RecordKind
    revision: int
    generation: int
    phase: Phase
    desired: Desired
    outcome: Outcome
    cause: str
    recorded_status: RowStatus
    row_status: RowStatus | None
    submissions: int
    attempt: int | None
    worker: str | None
    worker_connected: bool | None
    live: bool  # the current submission's row is open now
    holds: tuple[str, ...]
    escalations: tuple[str, ...]
    pending_requeue: bool
    pending_resubmit: bool
    cleanup_pending: bool
    foreign_objects: tuple[str, ...]
    settled: bool
    settleable: bool
    unsettled: tuple[str, ...]
    successor: str | None
    observed_at: datetime


def project(job: Job, discovery: Discovery, now: datetime) -> Status:
    del now  # the Status is a function of the Job and the discovery
    current = job.current
    observed = discovery.find(current.object) if current is not None else None
    if job.has_outcome:
        phase = Phase(job.outcome.value)
    elif current is not None and current.open:
        started = current.started_at is not None or (observed is not None and observed.started)
        phase = Phase.RUNNING if started else Phase.DISPATCHED
    elif job.desired is Desired.HOLD:
        phase = Phase.HELD
    else:
        phase = Phase.QUEUED
    reasons = unsettled_reasons(job, discovery)
    return Status(
        job_key=job.job_key,
        kind=job.kind,
        revision=job.revision,
        generation=job.generation,
        phase=phase,
        desired=job.desired,
        outcome=job.outcome,
        cause=job.cause,
        recorded_status=job.status,
        row_status=discovery.row_status,
        submissions=len(job.submissions),
        attempt=current.attempt if current is not None else None,
        worker=current.worker if current is not None else None,
        worker_connected=observed.worker_connected if observed is not None else None,
        live=observed is not None and observed.open,
        holds=tuple(h.reason or f"held by {h.actor}" for h in job.holds),
        escalations=tuple(f"{e.reason}: {e.cause}" if e.cause else e.reason for e in job.escalations),
        pending_requeue=job.pending_requeue is not None,
        pending_resubmit=job.pending_resubmit,
        cleanup_pending=job.cleanup_pending,
        foreign_objects=tuple(str(ref) for ref in foreign_objects(job, discovery)),
        settled=job.settled,
        settleable=not job.settled and not reasons,
        unsettled=() if job.settled else reasons,
        successor=job.successor,
        observed_at=discovery.observed_at,
    )
