"""A record's entries as a readable timeline (who, when, what), for the admin and the CLI. Pure."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import msgspec

from gradient.records.decisions.fold import Job, decode_entry
from gradient.records.errors import DecodeError, InvalidHistory
from gradient.records.schemas import (
    Abandon,
    AssignmentClaimed,
    AssignmentClosed,
    Body,
    CallDeadline,
    Cancel,
    ClusterAttemptClosed,
    ClusterAttemptOpened,
    ClusterAttemptStarted,
    DeactivateWorker,
    DrainWorker,
    Escalated,
    GiveUp,
    Hold,
    OutcomeCommitted,
    Prioritize,
    RawEntry,
    Rebuild,
    Release,
    Requeue,
    Resubmit,
    Resubmitted,
    Settled,
    StatusChanged,
    WorkerReport,
    tag_of,
)


class TimelineRow(msgspec.Struct, frozen=True, kw_only=True):
    revision: int
    at: datetime
    actor: str
    kind: str
    what: str
    effect: str  # for a control intent: what it did ("" for facts)
    body: str  # the stored JSON, indented


def _short(value: object) -> str:
    return str(value)[:8]


Names = Mapping[str, str]  # an id (worker, build, evaluation, assignment, cluster attempt) -> its name


def _named(value: object, names: Names, fallback: str = "") -> str:
    """The name of an id, or of the id in a job key (`build:<id>`), else the fallback (the short id)."""
    text = str(value)
    _, _, tail = text.rpartition(":")
    return names.get(text) or names.get(tail) or fallback or _short(value)


def _reason(text: str) -> str:
    return f": {text}" if text else ""


def describe(body: Body, names: Names | None = None) -> str:
    """One line saying what the entry records; ids are shown by their names where `names` has them."""
    names = names or {}
    if isinstance(body, (Cancel, Hold, Release, Requeue, GiveUp, Resubmit, Abandon)):
        return f"{tag_of(body).replace('_', ' ')} requested{_reason(body.reason)}"
    if isinstance(body, Prioritize):
        return f"prioritize requested for {_named(body.target, names, body.target)}{_reason(body.reason)}"
    if isinstance(body, Rebuild):
        return f"rebuild requested for {_named(body.build, names, body.build)}{_reason(body.reason)}"
    if isinstance(body, DrainWorker):
        return f"drain requested for worker {_named(body.worker, names, body.worker)}{_reason(body.reason)}"
    if isinstance(body, DeactivateWorker):
        worker = _named(body.worker, names, body.worker)
        return f"deactivation requested for worker {worker}{_reason(body.reason)}"
    if isinstance(body, AssignmentClaimed):
        member = (
            f" as a member of cluster attempt {_named(body.cluster_attempt_id, names)}"
            if body.cluster_attempt_id
            else ""
        )
        return (
            f"submission {body.submission}: claimed for {_named(body.worker, names, body.worker)}, "
            f"attempt {body.attempt}{member}"
        )
    if isinstance(body, AssignmentClosed):
        on = names.get(str(body.assignment_id))
        which = f"the try on {on}" if on else f"assignment {_short(body.assignment_id)}"
        return f"{which} closed {body.outcome.value}{_reason(body.reason)}"
    if isinstance(body, ClusterAttemptOpened):
        seats = ", ".join(f"{s.role}[{s.index}] on {_named(s.worker, names, s.worker)}" for s in body.seats)
        return (
            f"submission {body.submission}: cluster attempt {_named(body.cluster_attempt_id, names)} (claim "
            f"{body.attempt}) opened" + (f" on {seats}" if seats else "")
        )
    if isinstance(body, ClusterAttemptStarted):
        return f"cluster attempt {_named(body.cluster_attempt_id, names)} started"
    if isinstance(body, ClusterAttemptClosed):
        verdict = f" (verdict {body.verdict.value})" if body.verdict else ""
        return (
            f"cluster attempt {_named(body.cluster_attempt_id, names)} closed {body.outcome.value}{verdict}"
            f"{_reason(body.reason)}"
        )
    if isinstance(body, CallDeadline):
        return f"{body.call.value} call on {body.object} due by {body.deadline:%Y-%m-%d %H:%M:%S}"
    if isinstance(body, WorkerReport):
        worker = _named(body.worker, names, body.worker)
        # the assignment is the worker's own try: named, it would only repeat the worker
        target = (
            f" on {_short(body.assignment_id)}"
            if body.assignment_id and str(body.assignment_id) not in names
            else ""
        )
        return f"{worker} reported {body.kind.value}{target}{_reason(body.summary)}"
    if isinstance(body, StatusChanged):
        return f"status {body.status.value}{_reason(body.reason)}"
    if isinstance(body, OutcomeCommitted):
        return f"outcome {body.outcome.value}{_reason(body.cause)}"
    if isinstance(body, Escalated):
        return f"escalated: {body.reason}" + (f" ({body.cause})" if body.cause else "")
    if isinstance(body, Resubmitted):
        return f"restarted as {_named(body.successor, names, body.successor)}"
    if isinstance(body, Settled):
        return "settled"
    return tag_of(body)


def _pretty(text: str) -> str:
    try:
        return json.dumps(json.loads(text), indent=2, sort_keys=True)
    except ValueError:
        return text


def timeline(
    entries: Sequence[RawEntry], job: Job | None = None, names: Names | None = None
) -> list[TimelineRow]:
    """Every entry, oldest first, ids shown by their `names`. An entry this build cannot read is shown as
    such, never hidden."""
    effects = {c.revision: c.effect.value.replace("_", " ") for c in job.controls} if job else {}
    rows = []
    for entry in entries:
        try:
            what = describe(decode_entry(entry), names)
        except (DecodeError, InvalidHistory) as exc:
            what = f"unreadable {entry.schema} entry: {exc}"
        rows.append(
            TimelineRow(
                revision=entry.revision,
                at=entry.recorded_at,
                actor=entry.actor,
                kind=entry.kind,
                what=what,
                effect=effects.get(entry.revision, ""),
                body=_pretty(entry.body),
            )
        )
    return rows
