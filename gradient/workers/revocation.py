"""A deleted worker's socket closes (4403) on whatever process holds it, instead of staying open and
deaf after its rows are gone (`pre_delete`, connected in gradient.apps).

A new token (services.worker_token_reset) and a deactivation (services.worker_deactivate) close the
session themselves (services.close_open_sessions).
"""

from __future__ import annotations

from typing import Any

from django.db.models.signals import pre_delete

from gradient.runtime.outbox import CLOSE_DEACTIVATED, close_worker_session_on_commit
from gradient.workers.models import Worker, WorkerSession


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
