"""What clusters' rows show the records app about a cluster job: its discovery (the cluster_job's
status and its cluster_attempt rows). Registered from ClustersConfig.ready(); records itself reads no
clusters table."""

from __future__ import annotations

import uuid
from datetime import datetime

from gradient.clusters.models import ClusterAttempt, ClusterJob
from gradient.records.decisions.discovery import Discovery, ObservedObject
from gradient.records.schemas import ObjectRef, ObjectTable, RowStatus
from gradient.records.selectors import Named


def cluster_discovery(
    *, job_key: str, job_id: uuid.UUID, recorded: tuple[ObjectRef, ...], now: datetime
) -> Discovery:
    """The cluster job's status, its open cluster_attempt rows and the rows its record names."""
    status = ClusterJob.objects.filter(id=job_id).values_list("status", flat=True).first()
    attempts = ClusterAttempt.objects.filter(
        cluster_job_id=job_id, finished_at__isnull=True
    ) | ClusterAttempt.objects.filter(id__in=[ref.id for ref in recorded])
    objects = tuple(
        ObservedObject(
            object=ObjectRef(table=ObjectTable.CLUSTER_ATTEMPT, id=a_id),
            open=finished_at is None,
            started=started_at is not None,
        )
        for a_id, finished_at, started_at in attempts.values_list("id", "finished_at", "started_at")
    )
    return Discovery(
        observed_at=now, objects=objects, row_status=RowStatus(status) if status is not None else None
    )


def names_of_ids(ids: set[uuid.UUID]) -> dict[str, Named]:
    """A cluster attempt, in a record's timeline, by its number: #2."""
    model = ClusterAttempt._meta.label_lower
    return {
        str(attempt_id): Named(f"#{number}", model)
        for attempt_id, number in ClusterAttempt.objects.filter(id__in=ids).values_list("id", "number")
    }
