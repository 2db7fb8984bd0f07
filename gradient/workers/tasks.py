"""Periodic passes of the workers app: thin tasks that call services."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from gradient.runtime.passes import pass_run
from gradient.workers.services import workers_drop_silent


@shared_task(name="gradient.workers.tasks.worker_liveness_pass")
def worker_liveness_pass() -> int | None:
    """Drop workers silent past GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS; their jobs go back."""
    timeout = settings.GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS
    if timeout <= 0:
        return 0
    return pass_run(
        name="worker-liveness", body=lambda: workers_drop_silent(now=timezone.now(), timeout_secs=timeout)
    )
