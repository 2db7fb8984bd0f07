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


class Ref(msgspec.Struct, frozen=True):
    """A mention of another object (a worker, a build, an evaluation, an assignment, a cluster attempt) in
    a timeline line: `id` is the key its name was found under, `text` what the line shows for it. The
    console links it to the object's page; plain text shows only `text`."""

    id: str
    text: str


Piece = str | Ref
Line = tuple[Piece, ...]


class TimelineRow(msgspec.Struct, frozen=True, kw_only=True):
    revision: int
    at: datetime
    actor: str
    kind: str
    what: str
    effect: str  # for a control intent: what it did ("" for facts)
    body: str  # the stored JSON, indented
    parts: Line = ()  # `what`, with the objects it names as `Ref`s


def _short(value: object) -> str:
    return str(value)[:8]


Names = Mapping[str, str]  # an id (worker, build, evaluation, assignment, cluster attempt) -> its name


def _named(value: object, names: Names, fallback: str = "") -> Piece:
    """The name of an id, or of the id in a job key (`build:<id>`), as a `Ref`; else the fallback (the
    short id) as plain text: nothing named, nothing to link."""
    whole = str(value)
    _, _, tail = whole.rpartition(":")
    for key in (whole, tail):
        if names.get(key):
            return Ref(id=key, text=names[key])
    return fallback or _short(value)


def _reason(text: str) -> str:
    return f": {text}" if text else ""


def plain(line: Line) -> str:
    """A line as text: each `Ref` by its text."""
    return "".join(p.text if isinstance(p, Ref) else p for p in line)


def _line(*pieces: Piece) -> Line:
    """The pieces, with the empty ones dropped and neighbouring texts joined."""
    out: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, str) and (not piece or (out and isinstance(out[-1], str))):
            if piece:
                out[-1] = f"{out[-1]}{piece}"
            continue
        out.append(piece)
    return tuple(out)


def describe_line(body: Body, names: Names | None = None) -> Line:
    """What the entry records, the objects it names as `Ref`s (where `names` has them)."""
    names = names or {}
    if isinstance(body, (Cancel, Hold, Release, Requeue, GiveUp, Resubmit, Abandon)):
        return _line(f"{tag_of(body).replace('_', ' ')} requested{_reason(body.reason)}")
    if isinstance(body, Prioritize):
        return _line(
            "prioritize requested for ", _named(body.target, names, body.target), _reason(body.reason)
        )
    if isinstance(body, Rebuild):
        return _line("rebuild requested for ", _named(body.build, names, body.build), _reason(body.reason))
    if isinstance(body, DrainWorker):
        return _line(
            "drain requested for worker ", _named(body.worker, names, body.worker), _reason(body.reason)
        )
    if isinstance(body, DeactivateWorker):
        return _line(
            "deactivation requested for worker ",
            _named(body.worker, names, body.worker),
            _reason(body.reason),
        )
    if isinstance(body, AssignmentClaimed):
        member: tuple[Piece, ...] = (
            (" as a member of cluster attempt ", _named(body.cluster_attempt_id, names))
            if body.cluster_attempt_id
            else ()
        )
        return _line(
            f"submission {body.submission}: claimed for ",
            _named(body.worker, names, body.worker),
            f", attempt {body.attempt}",
            *member,
        )
    if isinstance(body, AssignmentClosed):
        key = str(body.assignment_id)
        which: Piece = (
            Ref(id=key, text=f"the try on {names[key]}")
            if key in names
            else f"assignment {_short(body.assignment_id)}"
        )
        return _line(which, f" closed {body.outcome.value}{_reason(body.reason)}")
    if isinstance(body, ClusterAttemptOpened):
        seats: list[Piece] = []
        for i, s in enumerate(body.seats):
            seats += [", " if i else " on ", f"{s.role}[{s.index}] on ", _named(s.worker, names, s.worker)]
        return _line(
            f"submission {body.submission}: cluster attempt ",
            _named(body.cluster_attempt_id, names),
            f" (claim {body.attempt}) opened",
            *seats,
        )
    if isinstance(body, ClusterAttemptStarted):
        return _line("cluster attempt ", _named(body.cluster_attempt_id, names), " started")
    if isinstance(body, ClusterAttemptClosed):
        verdict = f" (verdict {body.verdict.value})" if body.verdict else ""
        return _line(
            "cluster attempt ",
            _named(body.cluster_attempt_id, names),
            f" closed {body.outcome.value}{verdict}{_reason(body.reason)}",
        )
    if isinstance(body, CallDeadline):
        return _line(f"{body.call.value} call on {body.object} due by {body.deadline:%Y-%m-%d %H:%M:%S}")
    if isinstance(body, WorkerReport):
        # the assignment is the worker's own try: named, it would only repeat the worker
        target = (
            f" on {_short(body.assignment_id)}"
            if body.assignment_id and str(body.assignment_id) not in names
            else ""
        )
        return _line(
            _named(body.worker, names, body.worker),
            f" reported {body.kind.value}{target}{_reason(body.summary)}",
        )
    if isinstance(body, StatusChanged):
        return _line(f"status {body.status.value}{_reason(body.reason)}")
    if isinstance(body, OutcomeCommitted):
        return _line(f"outcome {body.outcome.value}{_reason(body.cause)}")
    if isinstance(body, Escalated):
        return _line(f"escalated: {body.reason}" + (f" ({body.cause})" if body.cause else ""))
    if isinstance(body, Resubmitted):
        return _line("restarted as ", _named(body.successor, names, body.successor))
    if isinstance(body, Settled):
        return _line("settled")
    return _line(tag_of(body))


def describe(body: Body, names: Names | None = None) -> str:
    """One line saying what the entry records; ids are shown by their names where `names` has them."""
    return plain(describe_line(body, names))


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
            parts = describe_line(decode_entry(entry), names)
        except (DecodeError, InvalidHistory) as exc:
            parts = (f"unreadable {entry.schema} entry: {exc}",)
        rows.append(
            TimelineRow(
                revision=entry.revision,
                at=entry.recorded_at,
                actor=entry.actor,
                kind=entry.kind,
                what=plain(parts),
                parts=parts,
                effect=effects.get(entry.revision, ""),
                body=_pretty(entry.body),
            )
        )
    return rows
