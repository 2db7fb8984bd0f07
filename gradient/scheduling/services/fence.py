"""The fence every report passes: it acts only on the job's open assignment on the worker that sent it.

A report (or answer, or log piece) names its job and its assignment_id; anything else (a stale id,
another worker's id, a report after the close, a malformed id) is dropped: no state change, no error,
no close. The fence is in the SQL itself (`WHERE id = ... AND worker_id = ... AND job_id = ... AND
finished_at IS NULL`), with the row locked for the report's transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from django.db import connection

from gradient.core.ids import parse_uuid
from gradient.runtime import setsql
from gradient.runtime.setsql import fixed_cursor
from gradient.scheduling.models import DispatchedJob
from gradient.scheduling.services.lifecycle import ReportOutcome

DROPPED = ReportOutcome(False, "dropped: not the job's open assignment on this worker")


def fenced_assignment(*, worker_id: uuid.UUID, job_key: str, assignment_id: str) -> DispatchedJob | None:
    """The open assignment the report names, locked, or None when the report must be dropped."""
    parsed = parse_uuid(assignment_id)
    if parsed is None:
        return None
    return (
        DispatchedJob.objects.select_for_update(no_key=True)
        .filter(id=parsed, job_id=job_key, worker_id=worker_id, finished_at__isnull=True)
        .first()
    )


def fenced_assignments(
    claims: Sequence[tuple[uuid.UUID, str, str]],
) -> tuple[dict[uuid.UUID, DispatchedJob], set[uuid.UUID]]:
    """The fence for a whole batch of (worker_id, job key, assignment_id): the open single-job
    assignments they name, each locked (in id order, so two batches never wait on each other in a cycle)
    and kept only where worker and job match (the caller matches each report to its row again); and
    the ids of open cluster-member assignments among them, left unlocked (the cluster code locks its
    cluster first, then the member's row)."""
    wanted: dict[uuid.UUID, set[tuple[uuid.UUID, str]]] = {}
    for worker_id, job_key, named in claims:
        parsed = parse_uuid(named)
        if parsed is not None:
            wanted.setdefault(parsed, set()).add((worker_id, job_key))
    if not wanted:
        return {}, set()
    ids = list(wanted)
    if connection.vendor == "postgresql":
        rows = _open_singles_locked(ids)
    else:
        rows = list(
            DispatchedJob.objects.select_for_update(no_key=True)
            .filter(id__in=ids, finished_at__isnull=True, cluster_attempt__isnull=True)
            .order_by("id")
        )
    found = {row.id for row in rows}
    # Cluster members are looked for only among the ids that are no open single assignment (usually
    # none: no second statement).
    others = [assignment_id for assignment_id in ids if assignment_id not in found]
    members = (
        set(
            DispatchedJob.objects.filter(
                id__in=others, finished_at__isnull=True, cluster_attempt__isnull=False
            ).values_list("id", flat=True)
        )
        if others
        else set()
    )
    # The worker and the job must match too: checked here rather than as one OR term per report in the
    # statement (a batch of hundreds made the ORM build a statement far costlier than the read).
    return {row.id: row for row in rows if (row.worker_id, row.job_id) in wanted[row.id]}, members


# The assignment rows a report batch needs, as fixed text (PostgreSQL): every batch asks, and building
# the ORM's statement cost more than running it. The job payload and the score's breakdown are left
# out (deferred: read from the database if anything asks, which a build's usual reports never do).
_FENCE_FIELDS = [f for f in DispatchedJob._meta.concrete_fields if f.name not in ("job", "score_breakdown")]
_FENCE_SQL = (
    "SELECT "  # noqa: S608 (column names from the model, no input)
    + ", ".join(f.column for f in _FENCE_FIELDS)
    + " FROM dispatched_job WHERE id = ANY(%b::uuid[]) AND finished_at IS NULL AND cluster_attempt_id IS NULL"
    " ORDER BY id FOR NO KEY UPDATE"
)


_FENCE_NAMES = tuple(f.attname for f in _FENCE_FIELDS)


def _open_singles_locked(ids: list[uuid.UUID]) -> list[DispatchedJob]:
    with fixed_cursor() as cursor:
        cursor.execute(_FENCE_SQL, [ids])
        return [setsql.from_row(DispatchedJob, _FENCE_NAMES, row) for row in cursor.fetchall()]
