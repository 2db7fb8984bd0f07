"""When a worker's credentials go, its open session goes with them, on whatever process holds it:

- a new token (`services.worker_token_reset`, the admin's *Issue new tokens*): the session opened with
  the old one is closed (socket 4401, its jobs back to the pool), so the old token stops working at
  once, not at the next handshake;
- a deleted worker (`pre_delete`, connected in gradient.apps): its socket is closed (4403) instead of
  staying open and deaf after its rows are gone.

Deactivation already closes the session (services.worker_deactivate).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models.signals import pre_delete
from django.utils import timezone

from gradient.runtime.outbox import CLOSE_DEACTIVATED, close_worker_session_on_commit
from gradient.workers.models import Worker, WorkerSession

CLOSE_TOKEN_REVOKED = 4401  # as a Reject{401}: the token it connected with is no longer good


def close_open_sessions(*, worker_id: uuid.UUID, reason: str, code: int, now: datetime | None = None) -> int:
    """Close the worker's open sessions in the database (its jobs go back to the pool) and order their
    consumers to close the sockets once this commits. Returns how many were closed."""
    from gradient.workers.services import _session_close

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


def _close_sockets_of_deleted_worker(sender: Any, instance: Worker, **kwargs: Any) -> None:
    for session_id in WorkerSession.objects.filter(worker_id=instance.id, closed_at__isnull=True).values_list(
        "id", flat=True
    ):
        close_worker_session_on_commit(
            instance.id, session_id=session_id, code=CLOSE_DEACTIVATED, reason="worker deleted"
        )


def connect_signals() -> None:
    pre_delete.connect(
        _close_sockets_of_deleted_worker, sender=Worker, dispatch_uid="gradient-worker-deleted"
    )
