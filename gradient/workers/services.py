"""Writes of the workers app: registration, sessions, capabilities and metrics, and liveness.

What a session's end means for the jobs the worker held is not decided here: the apps that own those
jobs register session hooks (register_session_hooks, from their AppConfig.ready) and are called in the
transaction that closes the session.

Every close carries `closed_at IS NULL` / `finished_at IS NULL`, so a stale or repeated close changes
nothing; messages to workers go out on commit (gradient.runtime.outbox).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from gradient.core.ids import parse_uuid
from gradient.core.protocol import (
    InitCapabilities,
    WorkerCapabilities,
)
from gradient.recovery.models import ServerBoot
from gradient.runtime.outbox import (
    CLOSE_DEACTIVATED,
    CLOSE_SILENT,
    close_worker_session,
    close_worker_session_on_commit,
)
from gradient.runtime.setsql import fixed_cursor
from gradient.scheduling.models import DispatchedJob, Project
from gradient.workers.models import METRIC_FIELDS, IdleSlot, Worker, WorkerSession
from gradient.workers.presence import Presence
from gradient.workers.selectors import worker_project_names
from gradient.workers.tokens import token_matches, token_new

log = logging.getLogger("gradient.workers")

CLOSE_TOKEN_REVOKED = 4401  # as a Reject{401}: the token it connected with is no longer good

# A boot that stopped, or whose heartbeat (every 10 s) is older than this, holds no live sockets: its
# sessions may be closed by a handshake that would otherwise be refused with 496.
DEAD_BOOT_SECS = 60
CLOSE_REASON_MAX = 200


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


SessionOpened = Callable[[Sequence[uuid.UUID]], object]
"""Called with the workers' ids in the transaction that opens their sessions (each has been offered
nothing): one call for a batch of handshakes."""
WorkerLost = Callable[[uuid.UUID, str, datetime], object]
"""Called with (worker id, reason, now) in the transaction that closes a worker's session: the jobs it
held are lost."""


@dataclass(frozen=True)
class _SessionHooks:
    opened: SessionOpened | None
    lost: WorkerLost | None
    without_session: bool


_session_hooks: list[_SessionHooks] = []


def register_session_hooks(
    *, opened: SessionOpened | None = None, lost: WorkerLost | None = None, without_session: bool = False
) -> None:
    """What an app does when a worker's session opens or ends (called in registration order, which is
    INSTALLED_APPS order). With `without_session`, `lost` is also called for a worker whose server died
    with its socket: it holds jobs but no session."""
    hooks = _SessionHooks(opened, lost, without_session)
    if hooks not in _session_hooks:
        _session_hooks.append(hooks)


def _sessions_opened(worker_ids: Sequence[uuid.UUID]) -> None:
    for hooks in _session_hooks:
        if hooks.opened is not None:
            hooks.opened(worker_ids)


def _worker_lost(worker_id: uuid.UUID, reason: str, now: datetime, *, has_session: bool) -> None:
    for hooks in _session_hooks:
        if hooks.lost is not None and (has_session or hooks.without_session):
            hooks.lost(worker_id, reason, now)


# --- Registration ----------------------------------------------------------------------------------


def worker_register(*, name: str, projects: Iterable[Project]) -> tuple[Worker, str]:
    """Create a worker; returns it with its token, which is not stored and cannot be shown again."""
    token, hashed = token_new()
    with transaction.atomic():
        worker = Worker.objects.create(name=name, token_hash=hashed)
        worker.projects.set(list(projects))
    return worker, token


def worker_token_reset(*, worker_id: uuid.UUID) -> str | None:
    """Issue a new token; the session opened with the old one is closed at once (socket 4401, its jobs
    back to the pool), so the old token stops working now, not at the next handshake. None for an
    unknown id."""
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
        close_open_sessions(worker_id=worker_id, reason="worker deactivated", code=CLOSE_DEACTIVATED, now=now)
    return True


def close_open_sessions(*, worker_id: uuid.UUID, reason: str, code: int, now: datetime | None = None) -> int:
    """Close the worker's open sessions in the database (its jobs go back to the pool, by the session
    hooks) and order their consumers to close the sockets, on whatever process holds them, once this
    commits. Returns how many were closed."""
    now = now or timezone.now()
    closed = 0
    with transaction.atomic():
        for session_id in WorkerSession.objects.filter(
            worker_id=worker_id, closed_at__isnull=True
        ).values_list("id", flat=True):
            if _session_close(session_id=session_id, reason=reason, now=now) is not None:
                closed += 1
                close_worker_session_on_commit(worker_id, session_id=session_id, code=code, reason=reason)
    return closed


def worker_set_projects(*, worker_id: uuid.UUID, projects: Iterable[Project]) -> bool:
    """Replace the projects whose jobs the worker may take (scheduling.decisions.access). Its running
    jobs keep running; from its next RequestJob it is offered and given only the new projects' work.
    False for an unknown id."""
    with transaction.atomic():
        worker = Worker.objects.select_for_update(no_key=True).filter(id=worker_id).first()
        if worker is None:
            return False
        worker.projects.set(list(projects))
    log.info("worker %s now serves: %s", worker_id, ", ".join(sorted(p.name for p in projects)) or "nothing")
    return True


def worker_activate(*, worker_id: uuid.UUID) -> bool:
    return bool(Worker.objects.filter(id=worker_id).update(active=True, deactivated_at=None))


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
    session_id: uuid.UUID | None = None,
) -> HandshakeAccepted | HandshakeRejected:
    """The handshake's decision and its one write: a new open session (at most one per worker, by
    idx-worker_session-open, whichever server holds the other one), with `session_id` if given."""
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
                    id=session_id or uuid.uuid4(),
                    worker_id=worker.id,
                    channel_name=channel_name,
                    server_boot=server_boot,
                    opened_at=now,
                    last_seen=now,
                )
                # Metrics belong to the session that sent them: a new one starts with none, so a
                # reconnecting worker is not scored (or held back) by the load of its last session.
                updated = Worker.objects.filter(id=worker.id, active=True).update(
                    can_fetch=capabilities.fetch,
                    can_eval=capabilities.eval,
                    can_build=capabilities.build,
                    last_seen=now,
                    metrics_at=None,
                    **dict.fromkeys(METRIC_FIELDS),
                )
                if not updated:
                    raise _Deactivated
                # A new session has been offered nothing and holds no idle slot yet.
                IdleSlot.objects.filter(worker_id=worker.id).delete()
                _sessions_opened([worker.id])
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


@dataclass(frozen=True, slots=True)
class SessionOpen:
    """One handshake for worker_sessions_open: the InitConnection's claims and the socket's channel.
    `session_id` is chosen by the caller, so that a batch applied again after a commit it did not hear
    finds its own sessions open (and accepts them) rather than refusing them as another's."""

    worker_id: str
    token: str
    capabilities: InitCapabilities
    channel_name: str
    session_id: uuid.UUID


_OPEN_SESSIONS = """
INSERT INTO worker_session
    (id, worker_id, channel_name, server_boot, draining, opened_at, last_seen, closed_at, close_reason)
SELECT v.id, v.worker_id, v.channel_name, %(boot)s, false, %(now)s, %(now)s, NULL, ''
FROM unnest(%(ids)s::uuid[], %(workers)s::uuid[], %(channels)s::text[]) AS v(id, worker_id, channel_name)
ON CONFLICT (worker_id) WHERE closed_at IS NULL DO NOTHING
RETURNING id, worker_id
"""

# The worker row locked by its UPDATE, as the single handshake does: a deactivation that committed
# first leaves it out (and its new session is deleted again); one that comes after waits for this commit
# and then sees the session, which it closes.
_OPENED_WORKERS = """
UPDATE worker w SET can_fetch = v.can_fetch, can_eval = v.can_eval, can_build = v.can_build,
    last_seen = %(now)s, metrics_at = NULL, {metrics}
FROM unnest(%(workers)s::uuid[], %(fetch)s::bool[], %(eval)s::bool[], %(build)s::bool[])
    AS v(worker_id, can_fetch, can_eval, can_build)
WHERE w.id = v.worker_id AND w.active
RETURNING w.id
""".format(metrics=", ".join(f"{name} = NULL" for name in METRIC_FIELDS))


def worker_sessions_open(
    *, requests: Sequence[SessionOpen], server_boot: uuid.UUID, now: datetime
) -> list[HandshakeAccepted | HandshakeRejected]:
    """A batch of handshakes (every InitConnection of this process in a few milliseconds), decided as
    worker_session_open decides one, in one read and one transaction of set statements on PostgreSQL:
    the workers and their projects read together, the new sessions inserted together (one per worker,
    by idx-worker_session-open), the workers' capabilities and idle slots written together. A handshake
    whose worker already has an open session (or is named twice in the batch) goes through
    worker_session_open alone afterwards, which closes the sessions of a dead server or refuses with 496.
    One result per request, in order. Elsewhere (SQLite) each handshake is worker_session_open."""
    if connection.vendor != "postgresql":
        return [_open_alone(r, server_boot, now) for r in requests]
    results: list[HandshakeAccepted | HandshakeRejected | None] = [None] * len(requests)
    ids = [parse_uuid(r.worker_id) for r in requests]
    rows = Worker.objects.filter(id__in=[i for i in ids if i is not None]).values_list(
        "id", "token_hash", "active"
    )
    known = {wid: (token_hash, active) for wid, token_hash, active in rows}
    batch: dict[uuid.UUID, int] = {}  # worker -> the request of the batch's insert
    alone: list[int] = []  # those decided one at a time after the batch
    for i, (request, wid) in enumerate(zip(requests, ids, strict=True)):
        row = known.get(wid) if wid is not None else None
        if wid is None or row is None:
            results[i] = HandshakeRejected(403, "unknown worker")
        elif not token_matches(request.token, row[0]):
            results[i] = HandshakeRejected(401, "bad token")
        elif not row[1]:
            results[i] = HandshakeRejected(403, "worker is deactivated")
        elif wid in batch:
            alone.append(i)
        else:
            batch[wid] = i
    if batch:
        order = list(batch)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                _OPEN_SESSIONS,
                {
                    "boot": server_boot,
                    "now": now,
                    "ids": [requests[batch[w]].session_id for w in order],
                    "workers": order,
                    "channels": [requests[batch[w]].channel_name for w in order],
                },
            )
            inserted = {worker_id: session_id for session_id, worker_id in cursor.fetchall()}
            opened: list[uuid.UUID] = []
            if inserted:
                caps = [requests[batch[w]].capabilities for w in inserted]
                cursor.execute(
                    _OPENED_WORKERS,
                    {
                        "now": now,
                        "workers": list(inserted),
                        "fetch": [c.fetch for c in caps],
                        "eval": [c.eval for c in caps],
                        "build": [c.build for c in caps],
                    },
                )
                updated = {row[0] for row in cursor.fetchall()}
                deactivated = [inserted[w] for w in inserted if w not in updated]
                if deactivated:
                    WorkerSession.objects.filter(id__in=deactivated).delete()
                opened = [w for w in inserted if w in updated]
                if opened:
                    IdleSlot.objects.filter(worker_id__in=opened).delete()
                    _sessions_opened(opened)
            projects: dict[uuid.UUID, list[str]] = {w: [] for w in opened}
            for worker_id, name in (
                Worker.projects.through.objects.filter(worker_id__in=opened)
                .order_by("project__name")
                .values_list("worker_id", "project__name")
            ):
                projects[worker_id].append(name)
        for w in order:
            i = batch[w]
            if w in projects:
                results[i] = HandshakeAccepted(SessionRef(inserted[w], w), projects[w])
            elif w in inserted:
                results[i] = HandshakeRejected(403, "worker is deactivated")
            else:
                alone.append(i)
    if alone:
        # Applied again after a commit it did not hear (lanes.retrying): its own session is open.
        mine = set(
            WorkerSession.objects.filter(
                id__in=[requests[i].session_id for i in alone], closed_at__isnull=True
            ).values_list("id", flat=True)
        )
        for i in sorted(alone):
            request = requests[i]
            if request.session_id in mine:
                wid = ids[i]
                assert wid is not None
                results[i] = HandshakeAccepted(
                    SessionRef(request.session_id, wid), worker_project_names(worker_id=wid)
                )
                continue
            results[i] = _open_alone(request, server_boot, now)
    return [r for r in results if r is not None]


def _open_alone(
    request: SessionOpen, server_boot: uuid.UUID, now: datetime
) -> HandshakeAccepted | HandshakeRejected:
    return worker_session_open(
        worker_id=request.worker_id,
        token=request.token,
        capabilities=request.capabilities,
        channel_name=request.channel_name,
        server_boot=server_boot,
        now=now,
        session_id=request.session_id,
    )


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
    # Locked first (FOR UPDATE): a claim for this session holds its row FOR KEY SHARE until it commits
    # (scheduling's claims, _session_condition), so the jobs handed back below include every claim made
    # for the session; a claim after this commit sees the session closed and loses.
    worker_id = (
        WorkerSession.objects.select_for_update()
        .filter(id=session_id, closed_at__isnull=True)
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
    _worker_lost(worker_id, f"worker lost: {reason}", now, has_session=True)
    return worker_id


_PRESENCE_FLUSH = """
WITH v AS (
    SELECT * FROM unnest(
        %s::uuid[], %s::uuid[], %s::timestamptz[], %s::bool[], %s::float8[], %s::int[], %s::float8[],
        %s::float8[], %s::float8[], %s::int[], %s::timestamptz[]
    ) AS v(session_id, worker_id, seen_at, has_metrics, cpu_usage_pct, ram_free_mb, disk_speed_mbps,
           upload_speed_mbps, download_speed_mbps, build_peak_ram_mb, metrics_at)
), s AS (
    UPDATE worker_session ws SET last_seen = GREATEST(ws.last_seen, v.seen_at)
    FROM v WHERE ws.id = v.session_id AND ws.closed_at IS NULL
    RETURNING v.*
)
UPDATE worker w SET
    last_seen = GREATEST(COALESCE(w.last_seen, s.seen_at), s.seen_at),
    cpu_usage_pct = CASE WHEN s.has_metrics THEN s.cpu_usage_pct ELSE w.cpu_usage_pct END,
    ram_free_mb = CASE WHEN s.has_metrics THEN s.ram_free_mb ELSE w.ram_free_mb END,
    disk_speed_mbps = CASE WHEN s.has_metrics THEN s.disk_speed_mbps ELSE w.disk_speed_mbps END,
    upload_speed_mbps = CASE WHEN s.has_metrics THEN s.upload_speed_mbps ELSE w.upload_speed_mbps END,
    download_speed_mbps = CASE WHEN s.has_metrics THEN s.download_speed_mbps ELSE w.download_speed_mbps END,
    build_peak_ram_mb = CASE WHEN s.has_metrics THEN s.build_peak_ram_mb ELSE w.build_peak_ram_mb END,
    metrics_at = CASE WHEN s.has_metrics THEN s.metrics_at ELSE w.metrics_at END
FROM s WHERE w.id = s.worker_id
"""


def presence_flush(*, entries: Sequence[Presence]) -> int:
    """Write what this process's sessions showed since the last flush (gradient.workers.presence): every
    open session's and its worker's last_seen, and the latest metrics of those that sent a heartbeat, in
    one statement (one commit) on PostgreSQL. A closed session's entry writes nothing. Returns how many
    sessions were written."""
    if not entries:
        return 0
    if connection.vendor != "postgresql":
        return _presence_flush_rows(entries)
    columns: list[list[Any]] = [[] for _ in range(11)]
    for e in entries:
        m = e.metrics
        row = [e.session_id, e.worker_id, e.seen_at, m is not None]
        row += [getattr(m, name) if m is not None else None for name in METRIC_FIELDS]
        row.append(e.metrics_at)
        for column, value in zip(columns, row, strict=True):
            column.append(value)
    with connection.cursor() as cursor:
        cursor.execute(_PRESENCE_FLUSH, columns)
        return int(cursor.rowcount)


def _presence_flush_rows(entries: Sequence[Presence]) -> int:
    """The embedded database's flush: the same writes, row by row, in one transaction."""
    written = 0
    with transaction.atomic(durable=True):
        for e in entries:
            if not WorkerSession.objects.filter(id=e.session_id, closed_at__isnull=True).update(
                last_seen=e.seen_at
            ):
                continue
            written += 1
            fields: dict[str, Any] = {"last_seen": e.seen_at}
            if e.metrics is not None:
                fields.update({name: getattr(e.metrics, name) for name in METRIC_FIELDS})
                fields["metrics_at"] = e.metrics_at
            Worker.objects.filter(id=e.worker_id).update(**fields)
    return written


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


_CAPABILITIES_REPLACE = """
UPDATE worker w SET architectures = v.architectures, system_features = v.system_features,
    max_concurrent_builds = v.max_concurrent_builds, cpu_count = v.cpu_count, ram_total_mb = v.ram_total_mb,
    cpu_core_score = v.cpu_core_score, zone = v.zone, endpoint = v.endpoint, capabilities_at = %(now)s,
    last_seen = %(now)s
FROM unnest(%(ids)s::uuid[], %(arch)s::jsonb[], %(features)s::jsonb[], %(slots)s::int[], %(cpus)s::int[],
            %(ram)s::int[], %(score)s::int[], %(zone)s::text[], %(endpoint)s::text[])
    AS v(id, architectures, system_features, max_concurrent_builds, cpu_count, ram_total_mb,
         cpu_core_score, zone, endpoint)
WHERE w.id = v.id
"""


def workers_capabilities_replace(
    *, items: Sequence[tuple[SessionRef, WorkerCapabilities]], now: datetime
) -> None:
    """worker_capabilities_replace of several sessions (a fleet connecting at once sends its
    WorkerCapabilities together): one statement, one commit on PostgreSQL. A worker named twice keeps
    the last."""
    if connection.vendor != "postgresql":
        for session, capabilities in items:
            worker_capabilities_replace(session=session, capabilities=capabilities, now=now)
        return
    latest = {session.worker_id: capabilities for session, capabilities in items}
    caps = list(latest.values())
    with fixed_cursor() as cursor:
        cursor.execute(
            _CAPABILITIES_REPLACE,
            {
                "now": now,
                "ids": list(latest),
                "arch": [json.dumps(list(c.architectures)) for c in caps],
                "features": [json.dumps(list(c.system_features)) for c in caps],
                "slots": [c.max_concurrent_builds for c in caps],
                "cpus": [c.cpu_count for c in caps],
                "ram": [c.ram_total_mb for c in caps],
                "score": [c.cpu_core_score for c in caps],
                "zone": [c.zone for c in caps],
                "endpoint": [c.endpoint for c in caps],
            },
        )


def worker_session_drain(*, session: SessionRef, now: datetime) -> bool:
    """The worker said Draining: assign it nothing more (its idle slots go too)."""
    with transaction.atomic():
        changed = WorkerSession.objects.filter(
            id=session.session_id, closed_at__isnull=True, draining=False
        ).update(draining=True, last_seen=now)
        IdleSlot.objects.filter(worker_id=session.worker_id).delete()
    return bool(changed)


def worker_drain(*, worker_id: uuid.UUID, now: datetime) -> bool:
    """An operator drains a worker: its open session gets no new assignment from any instance (its idle
    slots go) while its running jobs finish. False when it has no open session or drains already. The
    mark lives on the session: a worker that reconnects is not draining."""
    with transaction.atomic():
        changed = WorkerSession.objects.filter(
            worker_id=worker_id, closed_at__isnull=True, draining=False
        ).update(draining=True)
        IdleSlot.objects.filter(worker_id=worker_id).delete()
    return bool(changed)


def sessions_of_boot_mark_draining(*, server_boot: uuid.UUID) -> int:
    """The server is draining: no session it holds gets a new assignment from any instance."""
    return WorkerSession.objects.filter(server_boot=server_boot, closed_at__isnull=True).update(draining=True)


def sessions_of_boots_close(*, boot_ids: Iterable[uuid.UUID], reason: str, now: datetime) -> list[uuid.UUID]:
    """Close every open session held by these (dead) server boots, without the session hooks: startup
    recovery puts their jobs back itself, step by step. Returns the workers whose session closed."""
    sessions = WorkerSession.objects.filter(closed_at__isnull=True, server_boot__in=list(boot_ids))
    worker_ids = list(sessions.values_list("worker_id", flat=True))
    sessions.update(closed_at=now, close_reason=reason[:CLOSE_REASON_MAX])
    IdleSlot.objects.filter(worker_id__in=worker_ids).delete()
    return worker_ids


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
        _worker_lost(orphaned, "worker lost: no session", now, has_session=False)
    return True


def workers_drop_silent(*, now: datetime, timeout_secs: float, limit: int = 10_000) -> int:
    """The liveness pass: drop every silent worker. 0 or less disables it."""
    if timeout_secs <= 0:
        return 0
    dropped = 0
    while dropped < limit and worker_liveness_step(now=now, timeout_secs=timeout_secs):
        dropped += 1
    return dropped
