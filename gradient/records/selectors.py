"""Reads of job records, and the discovery of what the scheduler shows about a job now.

The records app reads only its own tables. What the other apps' rows show about a job (discovery) and
who may read a job's record (read access) come from providers that the app owning each kind of job
registers from its AppConfig.ready(), the way it registers its control hook:

    register_discovery_provider(kind=JobKind.EVALUATION, provider=evaluation_discovery)
    register_read_access(kind=JobKind.EVALUATION, provider=evaluation_read_access)

A kind without a provider fails loudly with ProviderMissing.
"""

from __future__ import annotations

import enum
import re
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Protocol, TypeVar

import msgspec
from django.db.models import QuerySet

from gradient.core.vocab import JobKeyKind
from gradient.records.decisions.discovery import Discovery
from gradient.records.decisions.fold import Job, fold
from gradient.records.decisions.project import Status, project
from gradient.records.errors import ProviderMissing, UnknownRecord
from gradient.records.models import JobRecord, RecordEntry
from gradient.records.schemas import (
    JobKind,
    ObjectRef,
    RawEntry,
    RecordView,
    decode_header,
    parse_job_key,
)

if TYPE_CHECKING:
    from django.contrib.auth.models import AnonymousUser, User

# --- Providers --------------------------------------------------------------------------------------------


class DiscoveryProvider(Protocol):
    """What the owning app's rows show about one job now: its row's status (None when the row is
    gone), every open row of the job (dispatched_job, cluster_attempt) and every row in `recorded` (the
    objects its record names), with `observed_at=now`. Reads only; no writes, no locks."""

    def __call__(
        self, *, job_key: str, job_id: uuid.UUID, recorded: tuple[ObjectRef, ...], now: datetime
    ) -> Discovery: ...


class ReadAccess(enum.Enum):
    """May this user read this job's record?"""

    NO_SUCH_JOB = "no_such_job"  # the job's row does not exist
    DENIED = "denied"
    ALLOWED = "allowed"


class ReadAccessProvider(Protocol):
    def __call__(self, *, job_id: uuid.UUID, user: User | AnonymousUser) -> ReadAccess: ...


_discovery_providers: dict[JobKind, DiscoveryProvider] = {}
_read_access_providers: dict[JobKind, ReadAccessProvider] = {}


_P = TypeVar("_P")


def _register(registry: dict[JobKind, _P], what: str, kind: JobKind, provider: _P) -> None:
    existing = registry.get(kind)
    if existing is not None and existing is not provider:
        raise ValueError(f"{kind} jobs already have a {what} provider ({existing!r}); unregister it first")
    registry[kind] = provider


def register_discovery_provider(*, kind: JobKind, provider: DiscoveryProvider) -> None:
    """Make `provider` the discovery of jobs of this kind (one per kind; registering it again is a no-op)."""
    _register(_discovery_providers, "discovery", kind, provider)


def register_read_access(*, kind: JobKind, provider: ReadAccessProvider) -> None:
    """Make `provider` decide who may read the records of jobs of this kind (one per kind)."""
    _register(_read_access_providers, "read access", kind, provider)


class Named(msgspec.Struct, frozen=True):
    """What an id is called in a record's timeline, and which model's console page shows it
    (`app_label.model_name`, as `Model._meta.label_lower`: "workers.worker")."""

    name: str
    model: str


NameProvider = Callable[[set[uuid.UUID]], dict[str, Named]]
_name_providers: list[NameProvider] = []
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def register_name_provider(provider: NameProvider) -> None:
    """Let an app name the ids it owns (workers, builds, evaluations, assignments, cluster attempts) where a
    record's timeline mentions them. Registering it again is a no-op."""
    if provider not in _name_providers:
        _name_providers.append(provider)


def names_in(texts: Iterable[str]) -> dict[str, Named]:
    """The names of the ids found in `texts` (the entries' stored JSON), from every registered provider:
    id -> its name and model. An id nobody names is absent."""
    ids = {uuid.UUID(m) for text in texts for m in _UUID.findall(text)}
    names: dict[str, Named] = {}
    if ids:
        for provider in _name_providers:
            names.update(provider(ids))
    return names


def discovery_provider(kind: JobKind) -> DiscoveryProvider:
    provider = _discovery_providers.get(kind)
    if provider is None:
        raise ProviderMissing("discovery", kind.value, "register_discovery_provider")
    return provider


def read_access_provider(kind: JobKind) -> ReadAccessProvider:
    provider = _read_access_providers.get(kind)
    if provider is None:
        raise ProviderMissing("read access", kind.value, "register_read_access")
    return provider


# --- Reads ------------------------------------------------------------------------------------------------


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
        prefix = (JobKeyKind.EVAL if kind is JobKind.EVALUATION else JobKeyKind.CLUSTER).prefix
        query = query.filter(job_key__startswith=prefix)
    return query.order_by("created_at", "id")


def record_discovery(*, job_key: str, recorded: Iterable[ObjectRef], now: datetime) -> Discovery:
    """What the scheduler shows now: the job's row status, its open rows, and the rows the record names
    (from the discovery provider of the job's kind), objects in a stable order."""
    kind, job_id = parse_job_key(job_key)
    discovery = discovery_provider(kind)(job_key=job_key, job_id=job_id, recorded=tuple(recorded), now=now)
    return msgspec.structs.replace(
        discovery, objects=tuple(sorted(discovery.objects, key=lambda o: str(o.object)))
    )


def record_read_access(*, job_key: str, user: User | AnonymousUser) -> ReadAccess:
    """Whether `user` may read the record of `job_key`, as the app owning the job decides."""
    kind, job_id = parse_job_key(job_key)
    return read_access_provider(kind)(job_id=job_id, user=user)


def record_status(*, job_key: str, now: datetime) -> Status:
    job = record_job(job_key=job_key, now=now)
    discovery = record_discovery(job_key=job_key, recorded=(s.object for s in job.submissions), now=now)
    return project(job, discovery, now)
