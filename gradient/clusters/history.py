"""A cluster's record, written by the clusters services: every status change of a cluster_job and every
claim, start and close of one of its attempts appends its fact in the same transaction as the row change
(records.record_append_facts holds the record row until the caller commits). Cluster records use the job
key `cluster:<uuid>`; members keep their own records (`eval:<uuid>`), written by scheduling.history.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from django.contrib.auth.models import User

from gradient.core.jobkey import cluster_key as cluster_key
from gradient.core.vocab import AttemptOutcome, ClusterStatus, RecordKind, Verdict
from gradient.records.models import JobRecord
from gradient.records.schemas import (
    CallDeadline,
    CallKind,
    ClusterAttemptClosed,
    ClusterAttemptOpened,
    ClusterAttemptStarted,
    Fact,
    ObjectRef,
    ObjectTable,
    Outcome,
    OutcomeCommitted,
    RowStatus,
    Seat,
    StatusChanged,
)
from gradient.records.services import (
    plan_default,
    record_append_facts,
    record_append_facts_many,
    record_create,
)

TERMINAL_OUTCOME: dict[str, Outcome] = {
    ClusterStatus.COMPLETED.value: Outcome.SUCCEEDED,
    ClusterStatus.FAILED.value: Outcome.FAILED,
    ClusterStatus.ABORTED.value: Outcome.CANCELLED,
}


def attempt_ref(attempt_id: uuid.UUID) -> ObjectRef:
    return ObjectRef(table=ObjectTable.CLUSTER_ATTEMPT, id=attempt_id)


def append(cluster_id: uuid.UUID, facts: Sequence[Fact], now: datetime, actor: str = "scheduler") -> None:
    """Append in the caller's transaction. A cluster made outside the services (SQL, a fixture) gets its
    record on its first fact, so its history is never lost; one whose attempts were never recorded will
    not fold, which the records pass then reports."""
    if not facts:
        return
    key = cluster_key(cluster_id)
    if not JobRecord.objects.filter(job_key=key).exists():
        _record_for_existing_row(cluster_id, now)
    record_append_facts(job_key=key, facts=facts, now=now, actor=actor)


def append_many(facts: Mapping[uuid.UUID, Sequence[Fact]], now: datetime, actor: str = "scheduler") -> None:
    """append for many clusters at once (a pass's claims), in the caller's transaction: one read of which
    records exist, then one set append of every record's facts."""
    wanted = {cluster_id: bodies for cluster_id, bodies in facts.items() if bodies}
    if not wanted:
        return
    keys = {cluster_id: cluster_key(cluster_id) for cluster_id in wanted}
    known = set(JobRecord.objects.filter(job_key__in=list(keys.values())).values_list("job_key", flat=True))
    for cluster_id, key in keys.items():
        if key not in known:
            _record_for_existing_row(cluster_id, now)
    record_append_facts_many(facts={keys[c]: bodies for c, bodies in wanted.items()}, now=now, actor=actor)


def _record_for_existing_row(cluster_id: uuid.UUID, now: datetime) -> None:
    from gradient.clusters.models import ClusterJob

    cluster = ClusterJob.objects.get(id=cluster_id)
    spec = {
        "same_zone": cluster.same_zone,
        "retry_budget": cluster.retry_budget,
        "priority": cluster.priority,
        "members": [
            {"role": m.role, "index": m.index, "job": m.job_key, "primary": m.primary, "pin": m.pin}
            for m in cluster.members.order_by("role", "index")
        ],
    }
    record_create(
        job_key=cluster_key(cluster_id),
        spec=spec,
        plan=plan_default(kind=RecordKind.CLUSTER, retry_budget=cluster.retry_budget),
        created_by=None,
        idempotency_key=None,
        now=now,
    )


def status_facts(status: str, reason: str) -> list[Fact]:
    facts: list[Fact] = [StatusChanged(status=RowStatus(status), reason=reason[:500])]
    if status in TERMINAL_OUTCOME:
        facts.append(OutcomeCommitted(outcome=TERMINAL_OUTCOME[status], cause=reason[:500]))
    return facts


def cluster_record_create(
    *, cluster_id: uuid.UUID, spec: dict[str, Any], retry_budget: int, created_by: User | None, now: datetime
) -> None:
    """The cluster's record header and its first status, in the caller's transaction."""
    record_create(
        job_key=cluster_key(cluster_id),
        spec=spec,
        plan=plan_default(kind=RecordKind.CLUSTER, retry_budget=retry_budget),
        created_by=created_by,
        idempotency_key=None,
        now=now,
    )
    append(cluster_id, status_facts("Queued", "submitted"), now)


def attempt_opened_facts(
    *, attempt_id: uuid.UUID, number: int, seats: Sequence[tuple[str, int, str]], prepare_deadline: datetime
) -> list[Fact]:
    """claim_cluster won: the attempt is the record's next submission, and the hold of every member's
    AssignJob is a call whose deadline is the prepare deadline (the workers let go a margin later)."""
    return [
        ClusterAttemptOpened(
            submission=number,
            cluster_attempt_id=attempt_id,
            attempt=number,
            seats=tuple(Seat(role=role, index=index, worker=worker) for role, index, worker in seats),
        ),
        CallDeadline(call=CallKind.HOLD, object=attempt_ref(attempt_id), deadline=prepare_deadline),
    ]


def attempt_opened(
    *,
    cluster_id: uuid.UUID,
    attempt_id: uuid.UUID,
    number: int,
    seats: Sequence[tuple[str, int, str]],
    prepare_deadline: datetime,
    now: datetime,
) -> None:
    append(
        cluster_id,
        attempt_opened_facts(
            attempt_id=attempt_id, number=number, seats=seats, prepare_deadline=prepare_deadline
        ),
        now,
    )


def attempt_started(*, cluster_id: uuid.UUID, attempt_id: uuid.UUID, reason: str, now: datetime) -> None:
    append(
        cluster_id,
        [ClusterAttemptStarted(cluster_attempt_id=attempt_id), *status_facts("Running", reason)],
        now,
    )


def attempt_closed(
    *,
    cluster_id: uuid.UUID,
    attempt_id: uuid.UUID,
    outcome: str,
    verdict: str | None,
    reason: str,
    now: datetime,
) -> None:
    append(
        cluster_id,
        [
            ClusterAttemptClosed(
                cluster_attempt_id=attempt_id,
                outcome=AttemptOutcome(outcome),
                verdict=Verdict(verdict) if verdict is not None else None,
                reason=reason[:500],
            )
        ],
        now,
    )
