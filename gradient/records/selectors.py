"""Reads of job records, and the discovery of what the scheduler shows about a job now."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from django.db.models import Exists, OuterRef, QuerySet

from gradient.clusters.models import ClusterAttempt, ClusterJob
from gradient.records.decisions.discovery import Discovery, ObservedObject
from gradient.records.decisions.fold import Job, fold
from gradient.records.decisions.project import Status, project
from gradient.records.decisions.steps import Step, next_steps
from gradient.records.errors import UnknownRecord
from gradient.records.models import JobRecord, RecordEntry
from gradient.records.schemas import (
    JobKind,
    ObjectRef,
    ObjectTable,
    RawEntry,
    RecordView,
    RowStatus,
    decode_header,
    parse_job_key,
)
from gradient.scheduling.models import DispatchedJob, Evaluation
from gradient.workers.models import WorkerSession


def record_get(*, job_key: str) -> JobRecord:
    try:
        return JobRecord.objects.get(job_key=job_key)
    except JobRecord.DoesNotExist:
        raise UnknownRecord(job_key) from None


def record_entries(*, record: JobRecord, upto: int | None = None) -> tuple[RawEntry, ...]:
    rows = RecordEntry.objects.filter(record=record).order_by("revision")
    if upto is not None:
        rows = rows.filter(revision__lte=upto)
    return tuple(
        RawEntry(
            revision=revision,
            kind=kind,
            schema=schema,
            body=body,
            actor=actor,
            recorded_at=recorded_at,
        )
        for revision, kind, schema, body, actor, recorded_at in rows.values_list(
            "revision", "kind", "schema", "body", "actor", "recorded_at"
        )
    )


def record_read(*, job_key: str, lock: bool = False) -> tuple[JobRecord, RecordView]:
    """The record and its view at its current revision. With `lock`, the record row is locked (call
    inside a transaction) so no one can commit until this transaction ends."""
    query = JobRecord.objects.filter(job_key=job_key)
    if lock:
        query = query.select_for_update(no_key=True)
    record = query.first()
    if record is None:
        raise UnknownRecord(job_key)
    entries = record_entries(record=record, upto=record.revision)
    view = RecordView(header=decode_header(record.header, schema=record.header_schema), entries=entries)
    return record, view


def record_job(*, job_key: str, now: datetime) -> Job:
    _, view = record_read(job_key=job_key)
    return fold(view.header, view.entries, now)


def records_list(
    *, settled: bool | None = None, kind: JobKind | None = None, tombstoned: bool = False
) -> QuerySet[JobRecord]:
    """Records by the settled labels (None: both). Tombstoned records are left out unless asked for."""
    query = JobRecord.objects.all()
    if settled is not None:
        query = query.filter(settled=settled)
    if not tombstoned:
        query = query.filter(tombstoned_at__isnull=True)
    if kind is not None:
        prefix = "eval:" if kind is JobKind.EVALUATION else "cluster:"
        query = query.filter(job_key__startswith=prefix)
    return query.order_by("created_at", "id")


def _row_status(value: str | None) -> RowStatus | None:
    return RowStatus(value) if value is not None else None


def record_discovery(*, job_key: str, recorded: Iterable[ObjectRef], now: datetime) -> Discovery:
    """What the scheduler shows now: the job's row status, its open rows, and the rows the record names."""
    kind, job_id = parse_job_key(job_key)
    recorded_ids = [ref.id for ref in recorded]
    objects: list[ObservedObject] = []
    if kind is JobKind.EVALUATION:
        status = Evaluation.objects.filter(id=job_id).values_list("status", flat=True).first()
        connected = WorkerSession.objects.filter(worker=OuterRef("worker"), closed_at__isnull=True)
        rows = (
            DispatchedJob.objects.filter(job_id=job_key, finished_at__isnull=True)
            | DispatchedJob.objects.filter(id__in=recorded_ids)
        ).annotate(connected=Exists(connected))
        for d_id, finished_at, worker_name, is_connected, accepted_at in rows.values_list(
            "id", "finished_at", "worker__name", "connected", "accepted_at"
        ):
            objects.append(
                ObservedObject(
                    object=ObjectRef(table=ObjectTable.DISPATCHED_JOB, id=d_id),
                    open=finished_at is None,
                    worker=worker_name,
                    worker_connected=bool(is_connected),
                    started=accepted_at is not None,
                )
            )
    else:
        status = ClusterJob.objects.filter(id=job_id).values_list("status", flat=True).first()
        attempts = ClusterAttempt.objects.filter(
            cluster_job_id=job_id, finished_at__isnull=True
        ) | ClusterAttempt.objects.filter(id__in=recorded_ids)
        for a_id, finished_at, started_at in attempts.values_list("id", "finished_at", "started_at"):
            objects.append(
                ObservedObject(
                    object=ObjectRef(table=ObjectTable.CLUSTER_ATTEMPT, id=a_id),
                    open=finished_at is None,
                    started=started_at is not None,
                )
            )
    objects.sort(key=lambda o: str(o.object))
    return Discovery(observed_at=now, objects=tuple(objects), row_status=_row_status(status))


def record_status(*, job_key: str, now: datetime) -> Status:
    job = record_job(job_key=job_key, now=now)
    discovery = record_discovery(job_key=job_key, recorded=(s.object for s in job.submissions), now=now)
    return project(job, discovery, now)


def record_next_steps(*, job_key: str, now: datetime) -> list[Step]:
    job = record_job(job_key=job_key, now=now)
    discovery = record_discovery(job_key=job_key, recorded=(s.object for s in job.submissions), now=now)
    return next_steps(job, discovery, now)
