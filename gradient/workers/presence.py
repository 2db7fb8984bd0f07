"""Seen and metrics of this process's sessions, kept in memory and flushed together.

Every message marks its worker seen, and the 10 s heartbeat carries its metrics; writing either per
message cost a commit each. Here the consumer notes them in memory (no I/O, on the event loop) and a
flush writes what changed for every session of this process in one statement every few seconds
(services.presence_flush), far below the liveness timeout (120 s by default). The liveness pass reads
what was flushed; a process that dies loses at most one flush interval of "seen", which the timeout
allows for. A session's metrics belong to it: they are written to its worker's row only while the
session is open (a closed session's pending entry is dropped at the flush's `closed_at IS NULL`).
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings

from gradient.core.protocol import WorkerMetrics


def flush_every_secs() -> float:
    """GRADIENT_PRESENCE_FLUSH_SECS (2 s; tests' servers flush more often)."""
    return max(0.05, float(getattr(settings, "GRADIENT_PRESENCE_FLUSH_SECS", 2.0)))


@dataclass
class Presence:
    """What one session showed since the last flush."""

    session_id: uuid.UUID
    worker_id: uuid.UUID
    seen_at: datetime
    metrics: WorkerMetrics | None = None
    metrics_at: datetime | None = None


_pending: dict[uuid.UUID, Presence] = {}
# Each open session's latest heartbeat, kept after the flush: a claim batch scores with it (the worker's
# row has it only once flushed).
_latest: dict[uuid.UUID, tuple[WorkerMetrics, datetime]] = {}
_lock = threading.Lock()


def note_seen(*, session_id: uuid.UUID, worker_id: uuid.UUID, now: datetime) -> None:
    """The session's worker sent a message at `now`."""
    with _lock:
        entry = _pending.get(session_id)
        if entry is None:
            _pending[session_id] = Presence(session_id, worker_id, now)
        elif now > entry.seen_at:
            entry.seen_at = now


def note_metrics(
    *, session_id: uuid.UUID, worker_id: uuid.UUID, metrics: WorkerMetrics, now: datetime
) -> None:
    """The heartbeat: the latest metrics replace earlier ones (null stays "unknown" to scoring)."""
    with _lock:
        entry = _pending.get(session_id)
        if entry is None:
            entry = _pending[session_id] = Presence(session_id, worker_id, now)
        entry.seen_at = max(entry.seen_at, now)
        entry.metrics = metrics
        entry.metrics_at = now
        _latest[session_id] = (metrics, now)


def latest_metrics(session_id: uuid.UUID) -> tuple[WorkerMetrics, datetime] | None:
    """The session's latest heartbeat and when it came, or None before its first."""
    return _latest.get(session_id)


def forget(session_id: uuid.UUID) -> None:
    """The session ended: what it showed since the last flush is not written."""
    with _lock:
        _pending.pop(session_id, None)
        _latest.pop(session_id, None)


def take() -> list[Presence]:
    """Everything noted since the last take (the flush writes it, or puts it back when it failed)."""
    with _lock:
        entries = list(_pending.values())
        _pending.clear()
    return entries


def put_back(entries: list[Presence]) -> None:
    """A flush that failed (the database away): keep its entries for the next one, newer notes win."""
    with _lock:
        for entry in entries:
            newer = _pending.get(entry.session_id)
            if newer is None:
                _pending[entry.session_id] = entry
            elif newer.metrics is None and entry.metrics is not None:
                newer.metrics, newer.metrics_at = entry.metrics, entry.metrics_at
