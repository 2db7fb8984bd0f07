"""Reads of the workers app: workers with their session state, and what they are allowed to work for.
(What a worker can be offered, and which assignment a report belongs to, are the scheduler's:
gradient.scheduling.services.offers and .reports.)"""

from __future__ import annotations

import uuid

from django.db.models import Exists, OuterRef, QuerySet

from gradient.scheduling.models import DispatchedJob, Project
from gradient.workers.models import Worker, WorkerSession


def worker_project_names(*, worker_id: uuid.UUID) -> list[str]:
    return list(Project.objects.filter(workers=worker_id).order_by("name").values_list("name", flat=True))


def workers_with_session_state() -> QuerySet[Worker]:
    """Every worker, annotated with `connected` (an open session) and `draining` (that session drains)."""
    open_sessions = WorkerSession.objects.filter(worker=OuterRef("pk"), closed_at__isnull=True)
    return Worker.objects.annotate(
        connected=Exists(open_sessions),
        draining=Exists(open_sessions.filter(draining=True)),
    ).prefetch_related("projects")


def workers_with_open_assignments(*, worker_ids: list[uuid.UUID]) -> set[uuid.UUID]:
    return set(
        DispatchedJob.objects.filter(worker_id__in=worker_ids, finished_at__isnull=True).values_list(
            "worker_id", flat=True
        )
    )
