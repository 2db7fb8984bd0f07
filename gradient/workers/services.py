"""Writes of the workers app: registration, sessions, capabilities and metrics, idle slots and scores,
liveness, and handing a lost worker's jobs back to the pool.

Every close carries `closed_at IS NULL` / `finished_at IS NULL`, so a stale or repeated close changes
nothing; messages to workers go out on commit (gradient.runtime.outbox).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import Exists, OuterRef, Q

from gradient.clusters.services import cluster_worker_lost
from gradient.core.protocol import (
    CandidateScore as CandidateScoreMessage,
)
from gradient.core.protocol import (
    InitCapabilities,
    JobKindName,
    WorkerCapabilities,
    WorkerMetrics,
)
from gradient.recovery.models import ServerBoot
from gradient.runtime.outbox import (
    CLOSE_DEACTIVATED,
    CLOSE_SILENT,
    close_worker_session,
    close_worker_session_on_commit,
)
from gradient.scheduling.models import (
    DispatchedJob,
    EvaluationStatus,
    JobKind,
    Project,
)
from gradient.scheduling.services.reports import assignment_return_to_pool
from gradient.workers.models import CandidateScore, IdleSlot, SentCandidate, Worker, WorkerSession
from gradient.workers.selectors import parse_job_key, parse_uuid, worker_project_names
from gradient.workers.tokens import token_matches, token_new

log = logging.getLogger("gradient.workers")

# A boot that stopped, or whose heartbeat (every 10 s) is older than this, holds no live sockets: its
# sessions may be closed by a handshake that would otherwise be refused with 496.
DEAD_BOOT_SECS = 60
CLOSE_REASON_MAX = 200

# Evaluation statuses a lost eval job returns to Queued from (the job had not reported eval_result).
EVAL_RETURNABLE = (
    EvaluationStatus.QUEUED,
    EvaluationStatus.FETCHING,
    EvaluationStatus.EVALUATING_FLAKE,
    EvaluationStatus.EVALUATING_DERIVATION,
)


@dataclass(frozen=True)
class SessionRef:
    """Who is speaking on a socket: the open session and its worker."""

    session_id: uuid.UUID
    worker_id: uuid.UUID


@dataclass(frozen=True)
class HandshakeAccepted:
    session: SessionRef
    authorized_projects: list[str]


@dataclass(frozen=True)
class HandshakeRejected:
    code: int
    reason: str


def job_kind_of(kind: JobKindName) -> JobKind:
    """The protocol's RequestJob kind as the database's JobKind."""
    return JobKind.EVAL if kind == "flake" else JobKind.BUILD


# --- Registration ----------------------------------------------------------------------------------


def worker_register(*, name: str, projects: Iterable[Project]) -> tuple[Worker, str]:
    """Create a worker; returns it with its token, which is not stored and cannot be shown again."""
    token, hashed = token_new()
    with transaction.atomic():
        worker = Worker.objects.create(name=name, token_hash=hashed)
        worker.projects.set(list(projects))
    return worker, token


def worker_token_reset(*, worker_id: uuid.UUID) -> str | None:
    """Issue a new token; the session opened with the old one is closed (workers.revocation). None for
    an unknown id."""
    from gradient.workers.revocation import CLOSE_TOKEN_REVOKED, close_open_sessions

    token, hashed = token_new()
    with transaction.atomic():
        updated = Worker.objects.filter(id=worker_id).update(token_hash=hashed)
        if updated:
            close_open_sessions(worker_id=worker_id, reason="token rotated", code=CLOSE_TOKEN_REVOKED)
    return token if updated else None


def worker_deactivate(*, worker_id: uuid.UUID, now: datetime) -> bool:
    """Deactivate a worker and close its open session (its socket closes with 4403, its jobs go back
    to the pool). False for an unknown id; deactivating twice changes nothing more."""
    with transaction.atomic():
        if not Worker.objects.filter(id=worker_id).exists():
            return False
        Worker.objects.filter(id=worker_id, active=True).update(active=False, deactivated_at=now)
        for session_id in WorkerSession.objects.filter(
            worker_id=worker_id, closed_at__isnull=True
        ).values_list("id", flat=True):
            if _session_close(session_id=session_id, reason="worker deactivated", now=now) is not None:
                close_worker_session_on_commit(
                    worker_id, session_id=session_id, code=CLOSE_DEACTIVATED, reason="worker deactivated"
                )
    return True


def worker_activate(*, worker_id: uuid.UUID) -> bool:
    return bool(Worker.objects.filter(id=worker_id).update(active=True, deactivated_at=None))


def project_create(*, name: str) -> Project:
    return Project.objects.create(name=name)


def user_create(*, username: str, password: str, is_staff: bool, projects: Iterable[Project]) -> User:
    """A REST client (submitter) of the given projects, or an operator (is_staff)."""
    with transaction.atomic():
        user = User.objects.create_user(username=username, password=password, is_staff=is_staff)
        for project in projects:
            project.members.add(user)
    return user


# --- Sessions --------------------------------------------------------------------------------------


class _Deactivated(Exception):
    pass


def worker_session_open(
    *,
    worker_id: str,
    token: str,
    capabilities: InitCapabilities,
    channel_name: str,
    server_boot: uuid.UUID,
    now: datetime,
) -> HandshakeAccepted | HandshakeRejected:
    """The handshake's decision and its one write: a new open session (at most one per worker, by
    idx-worker_session-open, whichever server holds the other one)."""
    wid = parse_uuid(worker_id)
    worker = Worker.objects.filter(id=wid).first() if wid is not None else None
    if worker is None:
        return HandshakeRejected(403, "unknown worker")
    if not token_matches(token, worker.token_hash):
        return HandshakeRejected(401, "bad token")
    if not worker.active:
        return HandshakeRejected(403, "worker is deactivated")

    for _ in range(2):
        try:
            with transaction.atomic():
                session = WorkerSession.objects.create(
                    worker_id=worker.id,
                    channel_name=channel_name,
                    server_boot=server_boot,
                    opened_at=now,
                    last_seen=now,
                )
                updated = Worker.objects.filter(id=worker.id, active=True).update(
                    can_fetch=capabilities.fetch,
                    can_eval=capabilities.eval,
                    can_build=capabilities.build,
                    last_seen=now,
                )
                if not updated:
                    raise _Deactivated
                # A new session has been offered nothing and holds no idle slot yet.
                SentCandidate.objects.filter(worker_id=worker.id).delete()
                IdleSlot.objects.filter(worker_id=worker.id).delete()
                projects = worker_project_names(worker_id=worker.id)
            return HandshakeAccepted(SessionRef(session.id, worker.id), projects)
        except _Deactivated:
            return HandshakeRejected(403, "worker is deactivated")
        except IntegrityError:
            if not WorkerSession.objects.filter(worker_id=worker.id, closed_at__isnull=True).exists():
                raise
            if not _close_sessions_of_dead_boots(worker_id=worker.id, now=now):
                break
    return HandshakeRejected(496, "this worker already has an open session")


def _close_sessions_of_dead_boots(*, worker_id: uuid.UUID, now: datetime) -> bool:
    """Close the worker's open sessions held by a server that stopped or stopped heartbeating (a crash
    leaves them open). A boot this database does not know is left alone."""
    dead = ServerBoot.objects.filter(
        Q(stopped_at__isnull=False) | Q(last_heartbeat__lt=now - timedelta(seconds=DEAD_BOOT_SECS))
    ).values("id")
    closed = False
    for session_id in WorkerSession.objects.filter(
        worker_id=worker_id, closed_at__isnull=True, server_boot__in=dead
    ).values_list("id", flat=True):
        closed |= worker_session_close(session_id=session_id, reason="its server is gone", now=now)
    return closed


def worker_session_close(*, session_id: uuid.UUID, reason: str, now: datetime) -> bool:
    """Close a session and hand its worker's jobs back as lost. False (and nothing written) when it was
    closed already."""
    with transaction.atomic():
        return _session_close(session_id=session_id, reason=reason, now=now) is not None


def _session_close(*, session_id: uuid.UUID, reason: str, now: datetime) -> uuid.UUID | None:
    worker_id = (
        WorkerSession.objects.filter(id=session_id, closed_at__isnull=True)
        .values_list("worker_id", flat=True)
        .first()
    )
    if worker_id is None:
        return None
    closed = WorkerSession.objects.filter(id=session_id, closed_at__isnull=True).update(
        closed_at=now, close_reason=reason[:CLOSE_REASON_MAX]
    )
    if not closed:
        return None
    IdleSlot.objects.filter(worker_id=worker_id).delete()
    SentCandidate.objects.filter(worker_id=worker_id).delete()
    worker_jobs_return_lost(worker_id=worker_id, reason=f"worker lost: {reason}", now=now)
    cluster_worker_lost(worker_id=worker_id, now=now)
    return worker_id


def worker_seen(*, session: SessionRef, now: datetime) -> None:
    """Every message marks the worker seen."""
    WorkerSession.objects.filter(id=session.session_id, closed_at__isnull=True).update(last_seen=now)
    Worker.objects.filter(id=session.worker_id).update(last_seen=now)


def worker_capabilities_replace(
    *, session: SessionRef, capabilities: WorkerCapabilities, now: datetime
) -> None:
    """A WorkerCapabilities replaces the stored fields as a whole; running jobs and offers stay."""
    Worker.objects.filter(id=session.worker_id).update(
        architectures=list(capabilities.architectures),
        system_features=list(capabilities.system_features),
        max_concurrent_builds=capabilities.max_concurrent_builds,
        cpu_count=capabilities.cpu_count,
        ram_total_mb=capabilities.ram_total_mb,
        cpu_core_score=capabilities.cpu_core_score,
        zone=capabilities.zone,
        endpoint=capabilities.endpoint,
        capabilities_at=now,
        last_seen=now,
    )


def worker_metrics_record(*, session: SessionRef, metrics: WorkerMetrics, now: datetime) -> None:
    """The heartbeat: keep the latest metrics (null is "unknown" to scoring)."""
    Worker.objects.filter(id=session.worker_id).update(
        cpu_usage_pct=metrics.cpu_usage_pct,
        ram_free_mb=metrics.ram_free_mb,
        disk_speed_mbps=metrics.disk_speed_mbps,
        upload_speed_mbps=metrics.upload_speed_mbps,
        download_speed_mbps=metrics.download_speed_mbps,
        build_peak_ram_mb=metrics.build_peak_ram_mb,
        metrics_at=now,
        last_seen=now,
    )


def worker_session_drain(*, session: SessionRef, now: datetime) -> bool:
    """The worker said Draining: assign it nothing more (its idle slots go too)."""
    with transaction.atomic():
        changed = WorkerSession.objects.filter(
            id=session.session_id, closed_at__isnull=True, draining=False
        ).update(draining=True, last_seen=now)
        IdleSlot.objects.filter(worker_id=session.worker_id).delete()
    return bool(changed)


def sessions_of_boot_mark_draining(*, server_boot: uuid.UUID) -> int:
    """The server is draining: no session it holds gets a new assignment from any instance."""
    return WorkerSession.objects.filter(server_boot=server_boot, closed_at__isnull=True).update(draining=True)


def session_is_assignable(*, session: SessionRef) -> bool:
    return WorkerSession.objects.filter(
        id=session.session_id, closed_at__isnull=True, draining=False
    ).exists()


# --- Idle slots and scores -------------------------------------------------------------------------


def idle_slot_record(*, session: SessionRef, kind: JobKindName, now: datetime) -> bool:
    """An unanswered RequestJob: remember the free slot for cluster placement (one per worker and kind,
    refreshed). A draining session offers no slot."""
    if not session_is_assignable(session=session):
        return False
    IdleSlot.objects.bulk_create(
        [IdleSlot(worker_id=session.worker_id, kind=job_kind_of(kind), recorded_at=now)],
        update_conflicts=True,
        unique_fields=["worker", "kind"],
        update_fields=["recorded_at"],
    )
    return True


def idle_slot_clear(*, worker_id: uuid.UUID, kind: JobKindName | None = None) -> int:
    """An assignment, a full worker or a disconnect clears the slot."""
    slots = IdleSlot.objects.filter(worker_id=worker_id)
    if kind is not None:
        slots = slots.filter(kind=job_kind_of(kind))
    deleted, _ = slots.delete()
    return deleted


def candidate_scores_store(
    *, session: SessionRef, scores: Iterable[CandidateScoreMessage], now: datetime
) -> int:
    """Keep a worker's RequestJobChunk answer, one row per (worker, job); a later score replaces an
    earlier one. Scores for anything that is not a job key are ignored."""
    latest = {s.job_id: s for s in scores if parse_job_key(s.job_id) is not None}
    if not latest:
        return 0
    CandidateScore.objects.bulk_create(
        [
            CandidateScore(
                worker_id=session.worker_id,
                job_id=s.job_id,
                missing_count=s.missing_count,
                missing_nar_size=s.missing_nar_size,
                outputs_present=s.outputs_present,
                updated_at=now,
            )
            for s in latest.values()
        ],
        update_conflicts=True,
        unique_fields=["worker", "job_id"],
        update_fields=["missing_count", "missing_nar_size", "outputs_present", "updated_at"],
    )
    return len(latest)


# --- Assignments -----------------------------------------------------------------------------------


def dispatch_return_to_pool(*, dispatch_id: uuid.UUID, reason: str, lost: bool, now: datetime) -> bool:
    """Close an open single-job assignment as Abandoned and give its job back to the pool (the
    scheduler's assignment_return_to_pool, with its facts). False, with nothing written, when the
    assignment was closed already."""
    row = DispatchedJob.objects.filter(id=dispatch_id, finished_at__isnull=True).first()
    if row is None:
        return False
    return assignment_return_to_pool(row=row, reason=reason, lost=lost, now=now)


def worker_jobs_return_lost(*, worker_id: uuid.UUID, reason: str, now: datetime) -> int:
    """Hand every open single-job assignment of a worker back to the pool as lost. Cluster members are
    left to the cluster code: a lost member reports into its attempt's verdict, never requeues alone."""
    dispatch_ids = list(
        DispatchedJob.objects.filter(
            worker_id=worker_id, finished_at__isnull=True, cluster_attempt__isnull=True
        ).values_list("id", flat=True)
    )
    return sum(
        dispatch_return_to_pool(dispatch_id=d, reason=reason, lost=True, now=now) for d in dispatch_ids
    )


# --- Liveness --------------------------------------------------------------------------------------


def worker_liveness_step(*, now: datetime, timeout_secs: float) -> bool:
    """Drop one worker silent for longer than the timeout: close its session (and its socket, wherever
    it is held) and hand its jobs back as lost, in one transaction. Returns whether it found one."""
    cutoff = now - timedelta(seconds=timeout_secs)
    silent = (
        WorkerSession.objects.filter(closed_at__isnull=True, last_seen__lt=cutoff)
        .order_by("last_seen")
        .values_list("id", "worker_id")
        .first()
    )
    if silent is not None:
        session_id, worker_id = silent
        reason = f"silent for more than {timeout_secs:g} s"
        with transaction.atomic():
            closed = _session_close(session_id=session_id, reason=reason, now=now) is not None
        if closed:
            close_worker_session(worker_id, session_id=session_id, code=CLOSE_SILENT, reason=reason)
        return True
    # Jobs of a worker with no session at all (its server died with the socket): lost too.
    orphaned = (
        DispatchedJob.objects.filter(
            finished_at__isnull=True, cluster_attempt__isnull=True, dispatched_at__lt=cutoff
        )
        .exclude(Exists(WorkerSession.objects.filter(worker=OuterRef("worker"), closed_at__isnull=True)))
        .filter(Q(worker__last_seen__isnull=True) | Q(worker__last_seen__lt=cutoff))
        .values_list("worker_id", flat=True)
        .first()
    )
    if orphaned is None:
        return False
    with transaction.atomic():
        worker_jobs_return_lost(worker_id=orphaned, reason="worker lost: no session", now=now)
    return True


def workers_drop_silent(*, now: datetime, timeout_secs: float, limit: int = 10_000) -> int:
    """The liveness pass: drop every silent worker. 0 or less disables it."""
    if timeout_secs <= 0:
        return 0
    dropped = 0
    while dropped < limit and worker_liveness_step(now=now, timeout_secs=timeout_secs):
        dropped += 1
    return dropped


# --- Cluster signals -------------------------------------------------------------------------------
