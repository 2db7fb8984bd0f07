"""Writes on job records: create once, append facts, commit only while the revision read is current,
commit control intents with retries, settle, tombstone, and the records pass.

Optimistic commits are enforced by the database: a commit is one conditional UPDATE of the record's
revision (`WHERE revision = <read>`), which a concurrent writer can only pass after the first writer
committed, and then no longer matches; the unique (record, revision) index backs it up. Nothing here
reads a revision and then writes on the strength of it.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import msgspec
from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, connection, transaction

from gradient.records.decisions.check import disagreements
from gradient.records.decisions.discovery import unsettled_reasons
from gradient.records.decisions.fold import APPLIED_EFFECTS, Effect, Job, fold
from gradient.records.errors import (
    ControlDeadlineExceeded,
    DecodeError,
    IdempotencyConflict,
    InvalidHistory,
    NotSettled,
    RecordExists,
    RecordTombstoned,
    RevisionConflict,
    SchemaError,
    UnknownRecord,
)
from gradient.records.models import JobRecord, RecordEntry
from gradient.records.schemas import (
    CONTROL_INTENTS,
    FACT_TYPES,
    HEADER_SCHEMA,
    OPERATOR_INTENTS,
    AnyControl,
    Body,
    Desired,
    Fact,
    Header,
    JobKind,
    Outcome,
    Plan,
    RawEntry,
    Settled,
    decode_header,
    encode,
    parse_job_key,
    schema_for,
    spec_digest,
    tag_of,
)
from gradient.records.selectors import record_discovery, record_read, records_list
from gradient.runtime.setsql import fixed_cursor

log = logging.getLogger("gradient.records")

Spec = Mapping[str, Any] | msgspec.Struct

# After this many lost races commit_control reads with the record row locked, so a stream of
# evidence commits cannot starve it however fast it is.
OPTIMISTIC_CONTROL_TRIES = 2


# --- Plan -------------------------------------------------------------------------------------------------


def plan_default(*, kind: JobKind, retry_budget: int | None = None) -> Plan:
    """The plan a new job records, from this server's settings. An existing job keeps its own."""
    budget = retry_budget if retry_budget is not None else (2 if kind is JobKind.CLUSTER else 0)
    return Plan(
        max_attempts=max(1, budget) if kind is JobKind.CLUSTER else 10,
        retry_budget=budget,
        prepare_timeout_secs=settings.GRADIENT_SCHEDULER_CLUSTER_PREPARE_TIMEOUT_SECS,
        hold_margin_secs=10,
        unbuildable_grace_secs=settings.GRADIENT_SCHEDULER_UNBUILDABLE_GRACE_SECS,
        heartbeat_timeout_secs=settings.GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS,
    )


# --- Create -----------------------------------------------------------------------------------------------


def _spec_object(spec: Spec) -> dict[str, Any]:
    builtins = msgspec.to_builtins(spec)
    if not isinstance(builtins, dict):
        raise SchemaError("a job's spec is a JSON object")
    return builtins


def record_by_idempotency_key(*, idempotency_key: str, spec: Spec) -> JobRecord | None:
    """The record an Idempotency-Key already names (tombstoned or not), if its spec is the same; raises
    IdempotencyConflict when the key names a job with another spec. Callers check this before they
    create their own row."""
    existing = JobRecord.objects.filter(idempotency_key=idempotency_key).first()
    if existing is None:
        return None
    if existing.digest != spec_digest(spec):
        raise IdempotencyConflict(idempotency_key, existing.job_key)
    return existing


def record_create(
    *,
    job_key: str,
    spec: Spec,
    plan: Plan,
    created_by: User | None,
    idempotency_key: str | None,
    supersedes: str | None = None,
    now: datetime,
) -> tuple[JobRecord, bool]:
    """Write the record's header, once. Call inside the transaction that creates the job's row.

    With an Idempotency-Key that already names a job: the same spec returns that job's record and
    False (even tombstoned, so a late submit cannot recreate the job; roll your own row back and
    answer with that job); another spec raises IdempotencyConflict.
    """
    kind, _ = parse_job_key(job_key)
    spec_object = _spec_object(spec)
    digest = spec_digest(spec_object)
    if idempotency_key is not None:
        existing = record_by_idempotency_key(idempotency_key=idempotency_key, spec=spec_object)
        if existing is not None:
            return existing, False
    generation = 1
    if supersedes is not None:
        previous = JobRecord.objects.filter(job_key=supersedes).values_list("header", "header_schema").first()
        if previous is None:
            raise UnknownRecord(supersedes)
        generation = decode_header(previous[0], schema=previous[1]).generation + 1
    header = Header(
        job_key=job_key,
        kind=kind,
        spec=spec_object,
        digest=digest,
        plan=plan,
        created_by=created_by.get_username() if created_by is not None else None,
        created_at=now,
        supersedes=supersedes,
        generation=generation,
    )
    try:
        with transaction.atomic():  # a savepoint: a lost race leaves the caller's transaction usable
            record = JobRecord.objects.create(
                job_key=job_key,
                header_schema=HEADER_SCHEMA,
                header=encode(header),
                digest=digest,
                idempotency_key=idempotency_key,
                created_by=created_by,
                created_at=now,
            )
    except IntegrityError:
        if idempotency_key is not None:
            existing = record_by_idempotency_key(idempotency_key=idempotency_key, spec=spec_object)
            if existing is not None:
                return existing, False
        if JobRecord.objects.filter(job_key=job_key).exists():
            raise RecordExists(job_key) from None
        raise
    return record, True


# --- Commit -----------------------------------------------------------------------------------------------


def _entry_rows(
    record_id: Any, first: int, bodies: Sequence[Body], actor: str, now: datetime
) -> list[RecordEntry]:
    rows = []
    for offset, body in enumerate(bodies):
        if not isinstance(body, CONTROL_INTENTS + OPERATOR_INTENTS + FACT_TYPES):
            raise TypeError(f"not a record entry: {body!r}")
        kind, schema = schema_for(body)
        rows.append(
            RecordEntry(
                record_id=record_id,
                revision=first + offset,
                kind=kind.value,
                schema=schema,
                body=encode(body),
                actor=actor,
                recorded_at=now,
            )
        )
    return rows


def _why_not(job_key: str, expected: int | None) -> Exception:
    state = JobRecord.objects.filter(job_key=job_key).values_list("tombstoned_at", flat=True)
    if not state.exists():
        return UnknownRecord(job_key)
    if state.first() is not None:
        return RecordTombstoned(job_key)
    assert expected is not None
    return RevisionConflict(job_key, expected)


_BUMP = "UPDATE job_record SET revision = revision + %s WHERE job_key = %s AND tombstoned_at IS NULL"
_BUMP_AT = _BUMP + " AND revision = %s"


def record_append_facts(
    *, job_key: str, facts: Sequence[Fact], now: datetime, actor: str = "scheduler"
) -> int:
    """Append `facts` at the record's next revisions, inside the caller's transaction, and return the new
    revision. The conditional UPDATE locks the record row until the caller commits, so appenders are
    serialized by the database; the caller's state change and its facts commit or roll back together.
    """
    if not facts:
        raise ValueError("no facts to append")
    for fact in facts:
        if not isinstance(fact, FACT_TYPES):
            raise TypeError(f"not a fact: {fact!r}")
    with transaction.atomic(savepoint=False), connection.cursor() as cursor:
        cursor.execute(_BUMP + " RETURNING id, revision", [len(facts), job_key])
        row = cursor.fetchone()
        if row is None:
            raise _why_not(job_key, None)
        record_id, revision = row
        RecordEntry.objects.bulk_create(_entry_rows(record_id, revision - len(facts) + 1, facts, actor, now))
    return int(revision)


_BUMP_MANY = """
WITH locked AS (
    -- Locked in key order, so that two appenders of overlapping sets never wait on each other in turn.
    SELECT id FROM job_record WHERE job_key = ANY(%(keys)s) AND tombstoned_at IS NULL
    ORDER BY job_key FOR NO KEY UPDATE
)
UPDATE job_record r SET revision = r.revision + v.n
FROM locked, unnest(%(keys)s::text[], %(counts)s::int[]) AS v(job_key, n)
WHERE r.id = locked.id AND r.job_key = v.job_key
RETURNING r.job_key, r.id, r.revision
"""


def record_append_facts_many(
    *, facts: Mapping[str, Sequence[Fact]], now: datetime, actor: str = "scheduler"
) -> dict[str, int]:
    """record_append_facts for many records at once (a pass's claims): each record's facts at its next
    revisions, in one UPDATE of the revisions and one INSERT of the entries, inside the caller's
    transaction; the records' rows stay locked until the caller commits. Returns each record's new
    revision. A record that is unknown or tombstoned raises as record_append_facts does (the caller's
    transaction then rolls back whole)."""
    wanted = {key: list(bodies) for key, bodies in facts.items() if bodies}
    if not wanted:
        return {}
    for bodies in wanted.values():
        for fact in bodies:
            if not isinstance(fact, FACT_TYPES):
                raise TypeError(f"not a fact: {fact!r}")
    if connection.vendor != "postgresql":
        return {
            key: record_append_facts(job_key=key, facts=bodies, now=now, actor=actor)
            for key, bodies in wanted.items()
        }
    keys = sorted(wanted)
    with transaction.atomic(savepoint=False), fixed_cursor() as cursor:
        cursor.execute(_BUMP_MANY, {"keys": keys, "counts": [len(wanted[k]) for k in keys]})
        bumped = {key: (record_id, int(revision)) for key, record_id, revision in cursor.fetchall()}
        for key in keys:
            if key not in bumped:
                raise _why_not(key, None)
        rows: list[RecordEntry] = []
        for key in keys:
            record_id, revision = bumped[key]
            bodies = wanted[key]
            rows += _entry_rows(record_id, revision - len(bodies) + 1, bodies, actor, now)
        RecordEntry.objects.bulk_create(rows)
    return {key: revision for key, (_, revision) in bumped.items()}


def record_commit(
    *,
    job_key: str,
    expected_revision: int,
    entries: Sequence[Body],
    now: datetime,
    actor: str = "scheduler",
    settle: bool = False,
) -> int:
    """Commit `entries` only while `expected_revision` is still the record's revision; returns the new
    revision or raises RevisionConflict. `settle` also sets the settled labels (used with a Settled fact)."""
    if not entries:
        raise ValueError("no entries to commit")
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(_BUMP_AT + " RETURNING id, revision", [len(entries), job_key, expected_revision])
            row = cursor.fetchone()
            if row is None:
                raise _why_not(job_key, expected_revision)
            record_id, revision = row
            RecordEntry.objects.bulk_create(
                _entry_rows(record_id, expected_revision + 1, entries, actor, now)
            )
            if settle:
                JobRecord.objects.filter(id=record_id).update(settled=True, settled_at=now)
    except IntegrityError as exc:
        # The unique (record, revision) index: only reachable if a writer bypassed the conditional bump.
        raise RevisionConflict(job_key, expected_revision) from exc
    return int(revision)


# --- Control intents --------------------------------------------------------------------------------------


class Receipt(msgspec.Struct, frozen=True, kw_only=True):
    """What a committed control intent did."""

    job_key: str
    revision: int
    intent: str
    actor: str
    effect: Effect | None  # None when this build could not fold the record (see `folded`)
    applied: bool
    outcome: Outcome | None
    desired: Desired | None
    folded: bool
    message: str
    tries: int


ControlHook = Callable[[Receipt], None]
_control_hooks: dict[JobKind, list[ControlHook]] = {JobKind.EVALUATION: [], JobKind.CLUSTER: []}


def register_control_hook(*, kind: JobKind, hook: ControlHook) -> None:
    """Call `hook(receipt)` after every committed control intent on a record of this kind (from
    transaction.on_commit): the owning app carries the intent out (abort the rows, requeue, ...)."""
    if hook not in _control_hooks[kind]:
        _control_hooks[kind].append(hook)


def unregister_control_hook(*, kind: JobKind, hook: ControlHook) -> None:
    if hook in _control_hooks[kind]:
        _control_hooks[kind].remove(hook)


def _receipt_message(intent: str, effect: Effect | None, job: Job | None, problem: str) -> str:
    if job is None or effect is None:
        return f"{intent} appended; this build could not fold the record ({problem})"
    outcome = job.outcome.value
    messages = {
        Effect.CANCELLED: "cancelled: it ends Aborted, and what it still runs is told to stop",
        Effect.CANCEL_AFTER_OUTCOME: f"cancel after the job ended: the outcome stays {outcome}",
        Effect.HELD: "held: no new submission until released",
        Effect.HOLD_IGNORED: "nothing to hold: the job "
        + (f"ended {outcome}" if job.has_outcome else "is being cancelled"),
        Effect.RELEASED: "released: every hold is lifted",
        Effect.RELEASE_IGNORED: "nothing was held",
        Effect.REQUEUE_PENDING: "requeue pending: the current submission ends and the job is offered again",
        Effect.REQUEUE_IGNORED: "nothing to requeue",
        Effect.GIVEN_UP: f"given up: the outcome is failed ({job.cause})",
        Effect.GIVE_UP_AFTER_OUTCOME: f"give up after the job ended: the outcome stays {outcome}",
        Effect.RESUBMIT_PENDING: "resubmit pending: a new generation follows once the job has ended",
        Effect.RESUBMIT_IGNORED: "already resubmitted or pending",
        Effect.ABANDONED: "abandoned: the outcome is cancelled and leftovers no longer hold settling back",
        Effect.ABANDON_AFTER_OUTCOME: f"leftovers abandoned: the outcome stays {outcome}",
        Effect.PRIORITIZED: "prioritized: it moves ahead of the queue",
        Effect.PRIORITIZE_IGNORED: f"nothing to prioritize: the job ended {outcome}",
        Effect.REBUILD_REQUESTED: "rebuild requested: the shared build is queued afresh",
        Effect.WORKER_DRAINED: "worker drained: it gets nothing new, its jobs finish",
        Effect.WORKER_DEACTIVATED: "worker deactivated: its session closes, its jobs go back to the pool",
    }
    return messages[effect]


def commit_control(
    *, job_key: str, intent: AnyControl, actor: str, now: datetime, deadline_secs: float = 5.0
) -> Receipt:
    """Append a control intent, re-reading and retrying on a revision conflict until `deadline_secs`.

    A record whose facts this build cannot decode (newer schemas) or fold still takes the intent: the
    receipt then says it was not folded. Raises ControlDeadlineExceeded, UnknownRecord, RecordTombstoned.
    """
    if not isinstance(intent, CONTROL_INTENTS + OPERATOR_INTENTS):
        raise TypeError(f"not a control intent: {intent!r}")
    started = time.monotonic()
    tries = 0
    while True:
        tries += 1
        try:
            with transaction.atomic():
                _, view = record_read(job_key=job_key, lock=tries > OPTIMISTIC_CONTROL_TRIES)
                revision = record_commit(
                    job_key=job_key, expected_revision=view.revision, entries=[intent], now=now, actor=actor
                )
        except RevisionConflict:
            if time.monotonic() - started >= deadline_secs:
                raise ControlDeadlineExceeded(f"{job_key}: {tries} tries in {deadline_secs}s") from None
            continue
        break
    entry = RawEntry(
        revision=revision,
        kind="control",
        schema=schema_for(intent)[1],
        body=encode(intent),
        actor=actor,
        recorded_at=now,
    )
    job: Job | None
    problem = ""
    try:
        job = fold(view.header, (*view.entries, entry), now)
    except (DecodeError, InvalidHistory) as exc:
        job, problem = None, str(exc)
    effect = job.controls[-1].effect if job is not None else None
    receipt = Receipt(
        job_key=job_key,
        revision=revision,
        intent=tag_of(intent),
        actor=actor,
        effect=effect,
        applied=effect in APPLIED_EFFECTS if effect is not None else True,
        outcome=job.outcome if job is not None else None,
        desired=job.desired if job is not None else None,
        folded=job is not None,
        message=_receipt_message(tag_of(intent), effect, job, problem),
        tries=tries,
    )
    for hook in list(_control_hooks[view.header.kind]):
        # robust: one failing hook is logged and does not keep the others from running
        transaction.on_commit(functools.partial(hook, receipt), robust=True)
    return receipt


# --- Settle, tombstone ------------------------------------------------------------------------------------


def record_settle(*, job_key: str, now: datetime) -> bool:
    """Commit `settled` and set the settled labels if the settled predicate holds now; returns whether
    it did. A concurrent commit makes it give up (the next pass tries again)."""
    with transaction.atomic():
        record, view = record_read(job_key=job_key)
        if record.settled or record.tombstoned_at is not None:
            return False
        job = fold(view.header, view.entries, now)
        discovery = record_discovery(job_key=job_key, recorded=(s.object for s in job.submissions), now=now)
        if job.settled or unsettled_reasons(job, discovery):
            return False
        try:
            record_commit(
                job_key=job_key,
                expected_revision=view.revision,
                entries=[Settled()],
                now=now,
                actor="records",
                settle=True,
            )
        except RevisionConflict:
            return False
    return True


def record_tombstone(*, job_key: str, now: datetime) -> JobRecord:
    """Drop a settled record's entries and mark it tombstoned. The header row stays, and with it the
    Idempotency-Key, so a late submit with the same key finds it instead of recreating the job."""
    with transaction.atomic():
        marked = JobRecord.objects.filter(job_key=job_key, settled=True, tombstoned_at__isnull=True).update(
            tombstoned_at=now
        )
        record = JobRecord.objects.filter(job_key=job_key).first()
        if record is None:
            raise UnknownRecord(job_key)
        if not marked and record.tombstoned_at is None:
            raise NotSettled(job_key)
        if marked:
            RecordEntry.objects.filter(record=record).delete()
    return record


# --- The records pass -------------------------------------------------------------------------------------


class RecordProblem(msgspec.Struct, frozen=True, kw_only=True):
    job_key: str
    problems: tuple[str, ...]


class CheckReport(msgspec.Struct, kw_only=True):
    checked: int = 0
    settled: int = 0
    problems: list[RecordProblem] = msgspec.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "settled": self.settled,
            "disagreeing": len(self.problems),
            "jobs": [p.job_key for p in self.problems[:50]],
        }


def record_check_one(*, job_key: str, now: datetime, settle: bool) -> tuple[tuple[str, ...], bool]:
    """Fold one record, compare it with its rows, and settle it if asked and the predicate holds.
    Returns (problems, settled)."""
    with transaction.atomic():
        try:
            # Locked: writers append a job's facts holding its record row, in the transaction that changes
            # its rows; holding it too, the record and the rows are read at one point of the job's history
            # (unlocked, a transition committing between the two reads looked like a disagreement).
            _, view = record_read(job_key=job_key, lock=True)
            job = fold(view.header, view.entries, now)
        except (DecodeError, InvalidHistory) as exc:
            return (f"the record cannot be folded: {exc}",), False
        discovery = record_discovery(job_key=job_key, recorded=(s.object for s in job.submissions), now=now)
        problems = disagreements(job, discovery, now)
    settled = False
    if (
        settle
        and not problems
        and job.has_outcome
        and not job.settled
        and not unsettled_reasons(job, discovery)
    ):
        settled = record_settle(job_key=job_key, now=now)
    return problems, settled


def records_check(*, now: datetime, settle: bool, batch_size: int = 500) -> CheckReport:
    """Fold every unsettled record, report each whose rows disagree with its fold, and settle those
    whose settled predicate holds. Walks the unsettled index in batches."""
    report = CheckReport()
    last: tuple[datetime, uuid.UUID] | None = None
    while True:
        query = records_list(settled=False)
        if last is not None:
            query = query.filter(created_at__gte=last[0]).exclude(created_at=last[0], id__lte=last[1])
        batch = list(query.values_list("job_key", "created_at", "id")[:batch_size])
        if not batch:
            return report
        for job_key, created_at, record_id in batch:
            last = (created_at, record_id)
            problems, settled = record_check_one(job_key=job_key, now=now, settle=settle)
            report.checked += 1
            report.settled += int(settled)
            if problems:
                report.problems.append(RecordProblem(job_key=job_key, problems=problems))
                log.warning("record %s disagrees with its rows: %s", job_key, "; ".join(problems))
