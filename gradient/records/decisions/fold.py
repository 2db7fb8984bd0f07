"""Fold: replay a record's history over its header and return the Job.

Pure: no I/O, no clock. Every actor that folds the same revision gets an equal Job (the Job does not
depend on `now`, which is taken for the interface's sake). A history the protocol could not have
written is refused with InvalidHistory, never folded into something plausible; a body this build
cannot read is refused with SchemaError or UnknownNameError.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

import msgspec

from gradient.core.vocab import AttemptOutcome, EntryKind, RecordKind
from gradient.records.errors import InvalidHistory
from gradient.records.schemas import (
    ENTRY_SCHEMAS,
    TERMINAL_OUTCOMES,
    Abandon,
    AnyControl,
    AssignmentClaimed,
    AssignmentClosed,
    Body,
    CallDeadline,
    CallKind,
    Cancel,
    ClusterAttemptClosed,
    ClusterAttemptOpened,
    ClusterAttemptStarted,
    DeactivateWorker,
    Desired,
    DrainWorker,
    Escalated,
    GiveUp,
    Header,
    Hold,
    ObjectRef,
    ObjectTable,
    Outcome,
    OutcomeCommitted,
    Plan,
    Prioritize,
    RawEntry,
    Rebuild,
    Release,
    ReportKind,
    Requeue,
    Resubmit,
    Resubmitted,
    RowStatus,
    Seat,
    Settled,
    StatusChanged,
    WorkerReport,
    decode_body,
    parse_job_key,
    tag_of,
)


class Effect(enum.StrEnum):
    """What a control intent did when it was folded; a receipt reports it."""

    CANCELLED = "cancelled"
    CANCEL_AFTER_OUTCOME = "cancel_after_outcome"  # desired cancel, the committed outcome stays
    HELD = "held"
    HOLD_IGNORED = "hold_ignored"  # the job has an outcome or is being cancelled
    RELEASED = "released"
    RELEASE_IGNORED = "release_ignored"  # nothing was held
    REQUEUE_PENDING = "requeue_pending"
    REQUEUE_IGNORED = "requeue_ignored"  # outcome, cancel, or nothing running to requeue
    GIVEN_UP = "given_up"
    GIVE_UP_AFTER_OUTCOME = "give_up_after_outcome"
    RESUBMIT_PENDING = "resubmit_pending"
    RESUBMIT_IGNORED = "resubmit_ignored"  # already resubmitted, or already pending
    ABANDONED = "abandoned"
    ABANDON_AFTER_OUTCOME = "abandon_after_outcome"  # leftovers waived, the outcome stays
    # gradient.control.v2: the operator's console actions; none changes the desired state or outcome
    PRIORITIZED = "prioritized"
    PRIORITIZE_IGNORED = "prioritize_ignored"  # the job has an outcome
    REBUILD_REQUESTED = "rebuild_requested"
    WORKER_DRAINED = "worker_drained"
    WORKER_DEACTIVATED = "worker_deactivated"


APPLIED_EFFECTS = frozenset(
    {
        Effect.CANCELLED,
        Effect.HELD,
        Effect.RELEASED,
        Effect.REQUEUE_PENDING,
        Effect.GIVEN_UP,
        Effect.RESUBMIT_PENDING,
        Effect.ABANDONED,
        Effect.ABANDON_AFTER_OUTCOME,
        Effect.PRIORITIZED,
        Effect.REBUILD_REQUESTED,
        Effect.WORKER_DRAINED,
        Effect.WORKER_DEACTIVATED,
    }
)


class Report(msgspec.Struct, frozen=True, kw_only=True):
    revision: int
    at: datetime
    assignment_id: uuid.UUID | None
    worker: str
    kind: ReportKind
    summary: str


class Submission(msgspec.Struct, frozen=True, kw_only=True):
    """One dispatch of the job and its canonical object (dispatched_job or cluster_attempt row)."""

    number: int
    object: ObjectRef
    attempt: int
    worker: str | None  # the assignee; None for a cluster attempt (see seats)
    seats: tuple[Seat, ...]
    cluster_attempt_id: uuid.UUID | None  # for a member assignment: the attempt it belongs to
    opened_revision: int
    opened_at: datetime
    started_at: datetime | None
    closed_revision: int | None
    closed_at: datetime | None
    close_outcome: str | None  # DispatchOutcome or AttemptOutcome value
    close_reason: str
    waived: bool  # abandoned by an operator: no longer holds settling back
    reports: int
    last_report: Report | None

    @property
    def open(self) -> bool:
        return self.closed_revision is None


class HoldRecord(msgspec.Struct, frozen=True, kw_only=True):
    revision: int
    actor: str
    reason: str
    at: datetime


class DeadlineRecord(msgspec.Struct, frozen=True, kw_only=True):
    revision: int
    call: CallKind
    object: ObjectRef
    deadline: datetime


class EscalationRecord(msgspec.Struct, frozen=True, kw_only=True):
    revision: int
    reason: str
    cause: str
    actor: str
    at: datetime


class ControlRecord(msgspec.Struct, frozen=True, kw_only=True):
    revision: int
    intent: str
    reason: str
    actor: str
    at: datetime
    effect: Effect


class LateOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """An outcome fact that arrived after an outcome was committed: kept as evidence, never applied."""

    revision: int
    outcome: Outcome
    cause: str


class Job(msgspec.Struct, frozen=True, kw_only=True):
    job_key: str
    kind: RecordKind
    revision: int
    generation: int
    supersedes: str | None
    digest: str
    plan: Plan
    created_at: datetime
    created_by: str | None
    desired: Desired
    outcome: Outcome
    cause: str
    outcome_revision: int | None
    outcome_at: datetime | None
    status: RowStatus  # the row's status as last recorded (Queued at creation)
    status_tracked: bool  # whether any status_changed fact was recorded
    submissions: tuple[Submission, ...]
    holds: tuple[HoldRecord, ...]
    deadlines: tuple[DeadlineRecord, ...]
    escalations: tuple[EscalationRecord, ...]
    controls: tuple[ControlRecord, ...]
    reports: tuple[Report, ...]
    late_outcomes: tuple[LateOutcome, ...]
    pending_requeue: ObjectRef | None  # the submission a requeue intent wants ended
    pending_resubmit: bool
    cleanup_pending: bool
    abandoned: bool
    successor: str | None
    settled: bool
    settled_at: datetime | None

    @property
    def has_outcome(self) -> bool:
        return self.outcome is not Outcome.NONE

    @property
    def open_submissions(self) -> tuple[Submission, ...]:
        return tuple(s for s in self.submissions if s.open)

    @property
    def current(self) -> Submission | None:
        return self.submissions[-1] if self.submissions else None

    def submission_for(self, ref: ObjectRef) -> Submission | None:
        for s in self.submissions:
            if s.object == ref:
                return s
        return None


# --- The fold ---------------------------------------------------------------------------------------------


@dataclass
class _Sub:
    number: int
    object: ObjectRef
    attempt: int
    worker: str | None
    seats: tuple[Seat, ...]
    cluster_attempt_id: uuid.UUID | None
    opened_revision: int
    opened_at: datetime
    started_at: datetime | None = None
    closed_revision: int | None = None
    closed_at: datetime | None = None
    close_outcome: str | None = None
    close_reason: str = ""
    waived: bool = False
    reports: int = 0
    last_report: Report | None = None

    def freeze(self) -> Submission:
        return Submission(
            number=self.number,
            object=self.object,
            attempt=self.attempt,
            worker=self.worker,
            seats=self.seats,
            cluster_attempt_id=self.cluster_attempt_id,
            opened_revision=self.opened_revision,
            opened_at=self.opened_at,
            started_at=self.started_at,
            closed_revision=self.closed_revision,
            closed_at=self.closed_at,
            close_outcome=self.close_outcome,
            close_reason=self.close_reason,
            waived=self.waived,
            reports=self.reports,
            last_report=self.last_report,
        )


@dataclass
class _State:
    header: Header
    desired: Desired = Desired.RUN
    outcome: Outcome = Outcome.NONE
    cause: str = ""
    outcome_revision: int | None = None
    outcome_at: datetime | None = None
    status: RowStatus = RowStatus.QUEUED
    status_tracked: bool = False
    subs: list[_Sub] = field(default_factory=list)
    by_object: dict[ObjectRef, _Sub] = field(default_factory=dict)
    holds: list[HoldRecord] = field(default_factory=list)
    deadlines: list[DeadlineRecord] = field(default_factory=list)
    escalations: list[EscalationRecord] = field(default_factory=list)
    controls: list[ControlRecord] = field(default_factory=list)
    reports: list[Report] = field(default_factory=list)
    late_outcomes: list[LateOutcome] = field(default_factory=list)
    pending_requeue: ObjectRef | None = None
    pending_resubmit: bool = False
    cleanup_pending: bool = False
    abandoned: bool = False
    successor: str | None = None
    settled: bool = False
    settled_at: datetime | None = None

    def open_subs(self) -> list[_Sub]:
        return [s for s in self.subs if s.closed_revision is None]

    def commit_outcome(self, outcome: Outcome, cause: str, entry: RawEntry, *, fact: bool = False) -> bool:
        """The first outcome wins. A later outcome fact is kept as evidence only (a control intent that
        finds an outcome leaves nothing to show: its effect says so)."""
        if self.outcome is not Outcome.NONE:
            if fact:
                self.late_outcomes.append(LateOutcome(revision=entry.revision, outcome=outcome, cause=cause))
            return False
        self.outcome = outcome
        self.cause = cause
        self.outcome_revision = entry.revision
        self.outcome_at = entry.recorded_at
        return True

    def freeze(self, revision: int) -> Job:
        h = self.header
        return Job(
            job_key=h.job_key,
            kind=h.kind,
            revision=revision,
            generation=h.generation,
            supersedes=h.supersedes,
            digest=h.digest,
            plan=h.plan,
            created_at=h.created_at,
            created_by=h.created_by,
            desired=self.desired,
            outcome=self.outcome,
            cause=self.cause,
            outcome_revision=self.outcome_revision,
            outcome_at=self.outcome_at,
            status=self.status,
            status_tracked=self.status_tracked,
            submissions=tuple(s.freeze() for s in self.subs),
            holds=tuple(self.holds),
            deadlines=tuple(self.deadlines),
            escalations=tuple(self.escalations),
            controls=tuple(self.controls),
            reports=tuple(self.reports),
            late_outcomes=tuple(self.late_outcomes),
            pending_requeue=self.pending_requeue,
            pending_resubmit=self.pending_resubmit,
            cleanup_pending=self.cleanup_pending,
            abandoned=self.abandoned,
            successor=self.successor,
            settled=self.settled,
            settled_at=self.settled_at,
        )


def decode_entry(entry: RawEntry) -> Body:
    """Check the entry is exactly one kind, agreeing with its schema, then decode its body strictly."""
    try:
        kind = EntryKind(entry.kind)
    except ValueError:
        raise InvalidHistory(
            entry.revision, f"entry kind {entry.kind!r} is neither control nor fact"
        ) from None
    schema_kind = ENTRY_SCHEMAS.get(entry.schema)
    if schema_kind is not None and schema_kind is not kind:
        raise InvalidHistory(
            entry.revision, f"a {kind.value} entry with {entry.schema}: it cannot be both kinds"
        )
    return decode_body(entry.schema, entry.body)  # an unknown schema: SchemaError


def fold(header: Header, entries: Sequence[RawEntry], now: datetime) -> Job:
    """Replay `entries` (revisions 1..n, in order) over `header`. Raises InvalidHistory, SchemaError or
    UnknownNameError; never returns a Job for a history it cannot vouch for."""
    del now  # the Job is a function of the revision alone
    kind, _ = parse_job_key(header.job_key)
    if kind is not header.kind:
        raise InvalidHistory(0, f"header kind {header.kind.value} does not match the key {header.job_key}")
    if header.generation < 1 or (header.supersedes is None) != (header.generation == 1):
        raise InvalidHistory(0, "generation 1 exactly when the job supersedes nothing")
    state = _State(header=header)
    for position, entry in enumerate(entries, start=1):
        if entry.revision != position:
            raise InvalidHistory(entry.revision, f"expected revision {position}: revisions are 1, 2, 3, ...")
        body = decode_entry(entry)
        if isinstance(
            body,
            (Cancel, Hold, Release, Requeue, GiveUp, Resubmit, Abandon)
            + (Prioritize, Rebuild, DrainWorker, DeactivateWorker),
        ):
            _apply_control(state, body, entry)
        else:
            _apply_fact(state, body, entry)
    return state.freeze(len(entries))


def fold_prefix(header: Header, entries: Sequence[RawEntry], revision: int, now: datetime) -> Job:
    """The Job as it was at `revision`."""
    return fold(header, entries[:revision], now)


# --- Control intents --------------------------------------------------------------------------------------


def _apply_control(state: _State, intent: AnyControl, entry: RawEntry) -> None:
    effect = _control_effect(state, intent, entry)
    state.controls.append(
        ControlRecord(
            revision=entry.revision,
            intent=tag_of(intent),
            reason=intent.reason,
            actor=entry.actor,
            at=entry.recorded_at,
            effect=effect,
        )
    )


def _mark_cleanup(state: _State) -> None:
    state.cleanup_pending = any(not s.waived for s in state.open_subs())


def _control_effect(state: _State, intent: AnyControl, entry: RawEntry) -> Effect:
    by = entry.actor or "an operator"
    if isinstance(intent, Prioritize):
        return Effect.PRIORITIZE_IGNORED if state.outcome is not Outcome.NONE else Effect.PRIORITIZED
    if isinstance(intent, Rebuild):
        return Effect.REBUILD_REQUESTED  # a shared build's own state: this job's outcome stays
    if isinstance(intent, DrainWorker):
        return Effect.WORKER_DRAINED
    if isinstance(intent, DeactivateWorker):
        return Effect.WORKER_DEACTIVATED
    if isinstance(intent, Cancel):
        state.desired = Desired.CANCEL
        state.holds.clear()
        state.pending_requeue = None
        state.pending_resubmit = False
        _mark_cleanup(state)
        cause = f"cancelled by {by}" + (f": {intent.reason}" if intent.reason else "")
        if state.commit_outcome(Outcome.CANCELLED, cause, entry):
            return Effect.CANCELLED
        return Effect.CANCEL_AFTER_OUTCOME
    if isinstance(intent, Hold):
        if state.outcome is not Outcome.NONE or state.desired is Desired.CANCEL:
            return Effect.HOLD_IGNORED
        state.desired = Desired.HOLD
        state.holds.append(
            HoldRecord(revision=entry.revision, actor=entry.actor, reason=intent.reason, at=entry.recorded_at)
        )
        return Effect.HELD
    if isinstance(intent, Release):
        if not state.holds:
            return Effect.RELEASE_IGNORED
        state.holds.clear()
        if state.desired is Desired.HOLD:
            state.desired = Desired.RUN
        return Effect.RELEASED
    if isinstance(intent, Requeue):
        current = state.open_subs()
        if state.outcome is not Outcome.NONE or state.desired is Desired.CANCEL or not current:
            return Effect.REQUEUE_IGNORED
        state.pending_requeue = current[-1].object
        return Effect.REQUEUE_PENDING
    if isinstance(intent, GiveUp):
        ended_hold = state.holds[-1].reason if state.holds else ""
        state.holds.clear()
        if state.desired is Desired.HOLD:
            state.desired = Desired.RUN
        state.pending_requeue = None
        _mark_cleanup(state)
        cause = ended_hold or f"given up by {by}" + (f": {intent.reason}" if intent.reason else "")
        if not state.commit_outcome(Outcome.FAILED, cause, entry):
            return Effect.GIVE_UP_AFTER_OUTCOME
        state.escalations.append(
            EscalationRecord(
                revision=entry.revision,
                reason=f"given up by {by}",
                cause=cause,
                actor=entry.actor,
                at=entry.recorded_at,
            )
        )
        return Effect.GIVEN_UP
    if isinstance(intent, Resubmit):
        if state.successor is not None or state.pending_resubmit:
            return Effect.RESUBMIT_IGNORED
        state.pending_resubmit = True
        return Effect.RESUBMIT_PENDING
    # Abandon
    state.desired = Desired.CANCEL
    state.holds.clear()
    state.pending_requeue = None
    state.pending_resubmit = False
    state.abandoned = True
    for sub in state.open_subs():
        sub.waived = True
    state.cleanup_pending = False
    cause = f"abandoned by {by}" + (f": {intent.reason}" if intent.reason else "")
    if state.commit_outcome(Outcome.CANCELLED, cause, entry):
        return Effect.ABANDONED
    return Effect.ABANDON_AFTER_OUTCOME


# --- Facts ------------------------------------------------------------------------------------------------


def _open_submission(
    state: _State,
    entry: RawEntry,
    *,
    number: int,
    ref: ObjectRef,
    attempt: int,
    worker: str | None,
    seats: tuple[Seat, ...],
    cluster_attempt_id: uuid.UUID | None,
) -> None:
    last = len(state.subs)
    if 1 <= number <= last:
        first = state.subs[number - 1].object
        raise InvalidHistory(
            entry.revision, f"a second canonical object {ref} for submission {number}, which has {first}"
        )
    if number != last + 1:
        raise InvalidHistory(entry.revision, f"submission {number} authorized after submission {last}")
    if ref in state.by_object:
        raise InvalidHistory(entry.revision, f"key {ref} reserved twice")
    if attempt < 1:
        raise InvalidHistory(entry.revision, f"attempt number {attempt} is not positive")
    sub = _Sub(
        number=number,
        object=ref,
        attempt=attempt,
        worker=worker,
        seats=seats,
        cluster_attempt_id=cluster_attempt_id,
        opened_revision=entry.revision,
        opened_at=entry.recorded_at,
    )
    state.subs.append(sub)
    state.by_object[ref] = sub
    if state.abandoned:
        sub.waived = True
    elif state.outcome is not Outcome.NONE or state.desired is Desired.CANCEL:
        state.cleanup_pending = True  # a claim that raced the end of the job: it must be stopped


def _recorded(state: _State, entry: RawEntry, ref: ObjectRef, what: str) -> _Sub:
    sub = state.by_object.get(ref)
    if sub is None:
        raise InvalidHistory(entry.revision, f"{what} {ref}, which was never recorded")
    return sub


def _close(state: _State, entry: RawEntry, sub: _Sub, outcome: str, reason: str) -> None:
    if sub.closed_revision is not None:
        raise InvalidHistory(entry.revision, f"{sub.object} closed twice")
    sub.closed_revision = entry.revision
    sub.closed_at = entry.recorded_at
    sub.close_outcome = outcome
    sub.close_reason = reason
    if state.pending_requeue == sub.object:
        state.pending_requeue = None  # the requeue landed
    if state.cleanup_pending:
        _mark_cleanup(state)


def _require_kind(state: _State, entry: RawEntry, kind: RecordKind, fact: str) -> None:
    if state.header.kind is not kind:
        raise InvalidHistory(
            entry.revision, f"{fact} does not belong on the record of {state.header.job_key}"
        )


def _apply_fact(state: _State, fact: Body, entry: RawEntry) -> None:
    if isinstance(fact, AssignmentClaimed):
        _require_kind(state, entry, RecordKind.EVALUATION, "assignment_claimed")
        _open_submission(
            state,
            entry,
            number=fact.submission,
            ref=ObjectRef(table=ObjectTable.DISPATCHED_JOB, id=fact.assignment_id),
            attempt=fact.attempt,
            worker=fact.worker,
            seats=(),
            cluster_attempt_id=fact.cluster_attempt_id,
        )
    elif isinstance(fact, AssignmentClosed):
        ref = ObjectRef(table=ObjectTable.DISPATCHED_JOB, id=fact.assignment_id)
        _close(state, entry, _recorded(state, entry, ref, "closing"), fact.outcome.value, fact.reason)
    elif isinstance(fact, ClusterAttemptOpened):
        _require_kind(state, entry, RecordKind.CLUSTER, "cluster_attempt_opened")
        _open_submission(
            state,
            entry,
            number=fact.submission,
            ref=ObjectRef(table=ObjectTable.CLUSTER_ATTEMPT, id=fact.cluster_attempt_id),
            attempt=fact.attempt,
            worker=None,
            seats=fact.seats,
            cluster_attempt_id=None,
        )
    elif isinstance(fact, ClusterAttemptStarted):
        ref = ObjectRef(table=ObjectTable.CLUSTER_ATTEMPT, id=fact.cluster_attempt_id)
        sub = _recorded(state, entry, ref, "starting")
        if sub.closed_revision is not None or sub.started_at is not None:
            raise InvalidHistory(entry.revision, f"{ref} started after it closed or started twice")
        sub.started_at = entry.recorded_at
    elif isinstance(fact, ClusterAttemptClosed):
        ref = ObjectRef(table=ObjectTable.CLUSTER_ATTEMPT, id=fact.cluster_attempt_id)
        sub = _recorded(state, entry, ref, "closing")
        if fact.outcome is AttemptOutcome.SUCCEEDED and sub.started_at is None:
            raise InvalidHistory(entry.revision, f"{ref} succeeded without starting")
        _close(state, entry, sub, fact.outcome.value, fact.reason)
    elif isinstance(fact, CallDeadline):
        _recorded(state, entry, fact.object, "a deadline for")
        state.deadlines.append(
            DeadlineRecord(
                revision=entry.revision, call=fact.call, object=fact.object, deadline=fact.deadline
            )
        )
    elif isinstance(fact, WorkerReport):
        report = Report(
            revision=entry.revision,
            at=entry.recorded_at,
            assignment_id=fact.assignment_id,
            worker=fact.worker,
            kind=fact.kind,
            summary=fact.summary,
        )
        state.reports.append(report)
        if fact.assignment_id is not None:
            target = state.by_object.get(ObjectRef(table=ObjectTable.DISPATCHED_JOB, id=fact.assignment_id))
            if target is not None:  # a report for another record's assignment is evidence all the same
                target.reports += 1
                target.last_report = report
                if fact.kind is ReportKind.ACCEPTED and target.started_at is None:
                    target.started_at = entry.recorded_at
    elif isinstance(fact, StatusChanged):
        state.status = fact.status
        state.status_tracked = True
    elif isinstance(fact, OutcomeCommitted):
        if fact.outcome not in TERMINAL_OUTCOMES:
            raise InvalidHistory(entry.revision, f"outcome {fact.outcome.value!r} is not terminal")
        state.commit_outcome(fact.outcome, fact.cause, entry, fact=True)
    elif isinstance(fact, Escalated):
        state.escalations.append(
            EscalationRecord(
                revision=entry.revision,
                reason=fact.reason,
                cause=fact.cause,
                actor=entry.actor,
                at=entry.recorded_at,
            )
        )
    elif isinstance(fact, Resubmitted):
        if state.successor is not None:
            raise InvalidHistory(entry.revision, f"resubmitted twice ({state.successor}, {fact.successor})")
        if fact.successor == state.header.job_key:
            raise InvalidHistory(entry.revision, "a job cannot supersede itself")
        parse_job_key(fact.successor)
        state.successor = fact.successor
        state.pending_resubmit = False
    elif isinstance(fact, Settled):
        if state.settled:
            raise InvalidHistory(entry.revision, "settled twice")
        if state.outcome is Outcome.NONE:
            raise InvalidHistory(entry.revision, "settled without an outcome")
        unended = [str(s.object) for s in state.open_subs() if not s.waived]
        if unended:
            raise InvalidHistory(entry.revision, f"settled while {', '.join(unended)} is still open")
        state.settled = True
        state.settled_at = entry.recorded_at
    else:  # pragma: no cover - the union is exhaustive; a new fact type must be folded here
        raise InvalidHistory(entry.revision, f"fact {tag_of(fact)} is not folded")
