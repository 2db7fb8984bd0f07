"""Builders and Hypothesis strategies for job records: headers, entries, and histories a
protocol-respecting writer could have produced (the scheduler's facts interleaved with operators'
control intents)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import strategies as st

from gradient.records.schemas import (
    Abandon,
    AssignmentClaimed,
    AssignmentClosed,
    AssignmentOutcome,
    AttemptOutcome,
    Body,
    CallDeadline,
    CallKind,
    Cancel,
    ClusterAttemptClosed,
    ClusterAttemptOpened,
    ClusterAttemptStarted,
    ControlIntent,
    Escalated,
    GiveUp,
    Header,
    Hold,
    JobKind,
    ObjectRef,
    ObjectTable,
    Outcome,
    OutcomeCommitted,
    Plan,
    RawEntry,
    Release,
    ReportKind,
    Requeue,
    Resubmit,
    Resubmitted,
    RowStatus,
    Seat,
    Settled,
    StatusChanged,
    Verdict,
    WorkerReport,
    encode,
    job_key_for,
    schema_for,
    spec_digest,
)

History = tuple[Header, tuple[RawEntry, ...]]

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)

PLAN = Plan(
    max_attempts=3,
    retry_budget=2,
    prepare_timeout_secs=30,
    hold_margin_secs=10,
    unbuildable_grace_secs=300,
    heartbeat_timeout_secs=120,
)


def make_header(
    kind: JobKind = JobKind.EVALUATION, *, job_id: uuid.UUID | None = None, plan: Plan = PLAN
) -> Header:
    spec = {"project": "demo", "repository": "sim:chain?n=3", "commit": "0" * 40}
    return Header(
        job_key=job_key_for(kind, job_id or uuid.uuid4()),
        kind=kind,
        spec=spec,
        digest=spec_digest(spec),
        plan=plan,
        created_by="alice",
        created_at=T0,
        supersedes=None,
        generation=1,
    )


def entry(revision: int, body: Body, *, actor: str = "scheduler", at: datetime | None = None) -> RawEntry:
    kind, schema = schema_for(body)
    return RawEntry(
        revision=revision,
        kind=kind.value,
        schema=schema,
        body=encode(body),
        actor=actor,
        recorded_at=at or T0 + timedelta(seconds=revision),
    )


def entries(*bodies: Body | tuple[Body, str], start: int = 1) -> tuple[RawEntry, ...]:
    """Entries at revisions start, start+1, ...; a (body, actor) pair names the actor."""
    out = []
    for offset, item in enumerate(bodies):
        body, actor = item if isinstance(item, tuple) else (item, "scheduler")
        out.append(entry(start + offset, body, actor=actor))
    return tuple(out)


def renumber(items: Iterable[RawEntry]) -> tuple[RawEntry, ...]:
    return tuple(
        RawEntry(
            revision=i,
            kind=e.kind,
            schema=e.schema,
            body=e.body,
            actor=e.actor,
            recorded_at=T0 + timedelta(seconds=i),
        )
        for i, e in enumerate(items, start=1)
    )


# --- A protocol-respecting writer, as a Hypothesis strategy -----------------------------------------------


@dataclass
class Writer:
    """What the generator knows about the history it wrote so far, enough to write only what the
    protocol could: one open submission at a time, numbered in order, each object once, closes of
    open objects only, starts of unstarted attempts only, settled once after an outcome."""

    kind: JobKind
    allow_outcomes: bool = True
    bodies: list[tuple[Body, str]] = field(default_factory=list)
    objects: list[ObjectRef] = field(default_factory=list)
    open: ObjectRef | None = None
    started: set[ObjectRef] = field(default_factory=set)
    waived: set[ObjectRef] = field(default_factory=set)
    abandoned: bool = False
    outcome: bool = False
    settled: bool = False
    resubmitted: bool = False

    def add(self, body: Body, actor: str = "scheduler") -> None:
        self.bodies.append((body, actor))

    def claimable(self) -> bool:
        return self.open is None

    def settleable(self) -> bool:
        return self.outcome and not self.settled and (self.open is None or self.open in self.waived)


_reason = st.text(alphabet="abcdefghijklmnopqrstuvwxyz ", max_size=12)
_worker = st.sampled_from(["w1", "w2", "w3"])
_operator = st.sampled_from(["admin:alice", "api:bob"])


def control_intents(allow_outcomes: bool = True) -> st.SearchStrategy[ControlIntent]:
    kinds: list[type[Any]] = [Hold, Release, Requeue, Resubmit]
    if allow_outcomes:
        kinds += [Cancel, GiveUp, Abandon]
    return st.builds(lambda k, r: k(reason=r), st.sampled_from(kinds), _reason)


@st.composite
def histories(
    draw: st.DrawFn,
    kind: JobKind | None = None,
    allow_outcomes: bool = True,
    min_size: int = 0,
    max_size: int = 24,
) -> History:
    """A header and a history a protocol-respecting writer could have written."""
    job_kind = kind or draw(st.sampled_from(list(JobKind)))
    w = Writer(kind=job_kind, allow_outcomes=allow_outcomes)
    steps = draw(st.integers(min_value=min_size, max_value=max_size))
    for _ in range(steps):
        _step(draw, w)
    return make_header(job_kind), entries(*w.bodies)


def _step(draw: st.DrawFn, w: Writer) -> None:
    choices = ["control", "report", "status", "escalate"]
    if w.claimable():
        choices.append("claim")
    if w.open is not None:
        choices += ["close", "deadline"]
        if w.kind is JobKind.CLUSTER and w.open not in w.started:
            choices.append("start")
    if w.allow_outcomes:
        choices.append("outcome")
    if w.settleable():
        choices.append("settle")
    if w.outcome and not w.resubmitted:
        choices.append("resubmitted")
    choice = draw(st.sampled_from(choices))
    if choice == "control":
        intent = draw(control_intents(w.allow_outcomes))
        w.add(intent, draw(_operator))
        if isinstance(intent, (Cancel, GiveUp, Abandon)):
            w.outcome = True
        if isinstance(intent, Abandon):
            w.abandoned = True
            if w.open is not None:
                w.waived.add(w.open)
    elif choice == "claim":
        number = len(w.objects) + 1
        object_id = uuid.UUID(int=draw(st.integers(min_value=1, max_value=2**64)) + number * 2**80)
        if w.kind is JobKind.EVALUATION:
            ref = ObjectRef(table=ObjectTable.DISPATCHED_JOB, id=object_id)
            w.add(
                AssignmentClaimed(
                    submission=number, assignment_id=object_id, worker=draw(_worker), attempt=number
                )
            )
        else:
            ref = ObjectRef(table=ObjectTable.CLUSTER_ATTEMPT, id=object_id)
            seats = (Seat(role="node", index=0, worker=draw(_worker)),)
            w.add(
                ClusterAttemptOpened(
                    submission=number, cluster_attempt_id=object_id, attempt=number, seats=seats
                )
            )
        w.objects.append(ref)
        w.open = ref
        if w.abandoned:
            w.waived.add(ref)
    elif choice == "start":
        assert w.open is not None
        w.add(ClusterAttemptStarted(cluster_attempt_id=w.open.id))
        w.started.add(w.open)
    elif choice == "close":
        assert w.open is not None
        if w.kind is JobKind.EVALUATION:
            w.add(
                AssignmentClosed(
                    assignment_id=w.open.id,
                    outcome=draw(st.sampled_from(list(AssignmentOutcome))),
                    reason=draw(_reason),
                )
            )
        else:
            outcomes = [o for o in AttemptOutcome if o is not AttemptOutcome.SUCCEEDED or w.open in w.started]
            w.add(
                ClusterAttemptClosed(
                    cluster_attempt_id=w.open.id,
                    outcome=draw(st.sampled_from(outcomes)),
                    verdict=draw(st.none() | st.sampled_from(list(Verdict))),
                )
            )
        w.open = None
    elif choice == "deadline":
        assert w.open is not None
        w.add(
            CallDeadline(
                call=draw(st.sampled_from(list(CallKind))),
                object=w.open,
                deadline=T0 + timedelta(seconds=draw(st.integers(min_value=0, max_value=600))),
            )
        )
    elif choice == "report":
        assignment = w.open.id if w.open is not None and w.kind is JobKind.EVALUATION else None
        w.add(
            WorkerReport(
                assignment_id=assignment,
                worker=draw(_worker),
                kind=draw(st.sampled_from(list(ReportKind))),
                summary=draw(_reason),
            )
        )
    elif choice == "status":
        w.add(StatusChanged(status=draw(st.sampled_from(list(RowStatus)))))
    elif choice == "escalate":
        w.add(Escalated(reason=draw(_reason) or "stuck", cause=draw(_reason)))
    elif choice == "outcome":
        terminal = [o for o in Outcome if o is not Outcome.NONE]
        w.add(OutcomeCommitted(outcome=draw(st.sampled_from(terminal)), cause=draw(_reason)))
        w.outcome = True
    elif choice == "settle":
        w.add(Settled(), "records")
        w.settled = True
    elif choice == "resubmitted":
        w.add(Resubmitted(successor=job_key_for(w.kind, uuid.UUID(int=draw(st.integers(1, 2**64))))))
        w.resubmitted = True


def bodies_of(history: Sequence[RawEntry]) -> list[str]:
    return [e.body for e in history]
