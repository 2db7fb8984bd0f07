"""What scheduling's rows show the records app about an evaluation: its discovery (the evaluation's
status, its dispatched_job rows and whether their workers are connected) and who may read its record.
Registered from SchedulingConfig.ready(); records itself reads no scheduling or workers table."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import TYPE_CHECKING

from django.db.models import Exists, OuterRef

from gradient.records.decisions.discovery import Discovery, ObservedObject
from gradient.records.schemas import ObjectRef, ObjectTable, RowStatus
from gradient.records.selectors import Named, ReadAccess
from gradient.scheduling.models import DerivationBuild, DispatchedJob, Evaluation
from gradient.workers.models import Worker, WorkerSession

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User


def evaluation_discovery(
    *, job_key: str, job_id: uuid.UUID, recorded: tuple[ObjectRef, ...], now: datetime
) -> Discovery:
    """The evaluation's status, its open dispatched_job rows and the rows its record names."""
    status = Evaluation.objects.filter(id=job_id).values_list("status", flat=True).first()
    connected = WorkerSession.objects.filter(worker=OuterRef("worker"), closed_at__isnull=True)
    rows = (
        DispatchedJob.objects.filter(job_id=job_key, finished_at__isnull=True)
        | DispatchedJob.objects.filter(id__in=[ref.id for ref in recorded])
    ).annotate(connected=Exists(connected))
    objects = tuple(
        ObservedObject(
            object=ObjectRef(table=ObjectTable.DISPATCHED_JOB, id=d_id),
            open=finished_at is None,
            worker=worker_name,
            worker_connected=bool(is_connected),
            started=accepted_at is not None,
        )
        for d_id, finished_at, worker_name, is_connected, accepted_at in rows.values_list(
            "id", "finished_at", "worker__name", "connected", "accepted_at"
        )
    )
    return Discovery(
        observed_at=now, objects=objects, row_status=RowStatus(status) if status is not None else None
    )


def evaluation_read_access(*, job_id: uuid.UUID, user: User | AnonymousUser) -> ReadAccess:
    """Staff read every evaluation's record; anyone else only those of their projects."""
    evaluation = Evaluation.objects.select_related("project").filter(id=job_id).first()
    if evaluation is None:
        return ReadAccess.NO_SUCH_JOB
    if user.is_staff:
        return ReadAccess.ALLOWED
    if user.pk is None:
        return ReadAccess.DENIED
    if evaluation.project.members.filter(pk=user.pk).exists():
        return ReadAccess.ALLOWED
    return ReadAccess.DENIED


def names_of_ids(ids: set[uuid.UUID]) -> dict[str, Named]:
    """What a record's timeline calls the scheduling ids it mentions (and whose console page shows each):
    a worker by its name, a build by its derivation's name, an evaluation by repository@commit, an
    assignment by its worker's name."""
    names: dict[str, Named] = {}
    worker, build, evaluation, assignment = (
        m._meta.label_lower for m in (Worker, DerivationBuild, Evaluation, DispatchedJob)
    )
    for worker_id, name in Worker.objects.filter(id__in=ids).values_list("id", "name"):
        names[str(worker_id)] = Named(name, worker)
    for row in DerivationBuild.objects.filter(id__in=ids).only("id", "drv_path"):
        names[str(row.id)] = Named(row.name, build)
    for evaluation_id, repository, commit in Evaluation.objects.filter(id__in=ids).values_list(
        "id", "repository", "commit"
    ):
        names[str(evaluation_id)] = Named(f"{repository}@{commit[:12]}", evaluation)
    for row_id, worker_name in DispatchedJob.objects.filter(id__in=ids).values_list("id", "worker__name"):
        names[str(row_id)] = Named(worker_name, assignment)
    return names
