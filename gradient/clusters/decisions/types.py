"""Plain data the cluster decision modules work on: frozen dataclasses, no Django, no I/O.

The database side loads rows into these (one snapshot per pass), calls a pure decision function, and
writes what it returns. WorkerSnapshot, SlotSnapshot and ScoreSnapshot are such copies of the
workers.Worker, idle_slot and candidate_score rows; the enums are gradient.core.vocab's. Ids are strings
(the rows' UUIDs as text) so tests and the bench can use short readable names; times are aware
datetimes, and `now` is always an argument, never read from a clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from gradient.core.vocab import BUILTIN_SYSTEM as BUILTIN_SYSTEM
from gradient.core.vocab import REQUEUEING_FAILURE_KINDS as REQUEUEING_FAILURE_KINDS
from gradient.core.vocab import AttemptOutcome as AttemptOutcome
from gradient.core.vocab import ClusterStatus as ClusterStatus
from gradient.core.vocab import FailureKind as FailureKind
from gradient.core.vocab import JobKind

SlotKind = JobKind
"""The kind of a member's job, and of the idle slot that can seat it: gradient.core.vocab.JobKind (the
old name, for the services and tests that import it from here)."""


@dataclass(frozen=True, slots=True, order=True)
class MemberAddress:
    """A member's name inside its cluster: role and index (the protocol's ClusterAddress)."""

    role: str
    index: int

    def as_json(self) -> dict[str, object]:
        return {"role": self.role, "index": self.index}


@dataclass(frozen=True, slots=True)
class Member:
    """One member job of a cluster, with everything a worker must offer to seat it.

    `system`, `required_features` describe a build member (`system` "builtin" skips the architecture
    check); `needs_fetch` says an evaluation member has a FetchFlake step, so its worker must fetch as
    well as evaluate (member evaluations are never split). `projects` are the projects the job belongs
    to (one for an evaluation; for a shared build, those of the evaluations that need it): the worker
    must be authorized for at least one. `can_start` is false when the member can no longer start
    (resync removal, evaluation cancel): it holds its cluster back.
    """

    role: str
    index: int
    job_key: str
    kind: JobKind
    primary: bool = False
    pin: str | None = None
    system: str | None = None
    required_features: frozenset[str] = frozenset()
    needs_fetch: bool = False
    projects: frozenset[str] = frozenset()
    can_start: bool = True

    @property
    def address(self) -> MemberAddress:
        return MemberAddress(self.role, self.index)


@dataclass(frozen=True, slots=True)
class Cluster:
    """A cluster job in the queue, as the planner sees it.

    `queued_at` orders clusters (oldest first, after the prioritized ones) and ages them toward a
    reservation; `retry_at` is the backoff after a failed prepare; `prepare_failures` counts consecutive
    failed prepares (past the cap the cluster is parked).
    """

    cluster_id: str
    members: tuple[Member, ...]
    queued_at: datetime
    same_zone: bool = False
    priority: bool = False
    retry_at: datetime | None = None
    prepare_failures: int = 0


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """A connected worker as one pass sees it (a snapshot of its workers.Worker row and session): its
    capabilities, zone and the projects it is authorized for (None: every project). A draining worker
    is connected but seats nothing."""

    worker_id: str
    name: str
    zone: str | None = None
    can_fetch: bool = False
    can_eval: bool = False
    can_build: bool = False
    architectures: frozenset[str] = frozenset()
    system_features: frozenset[str] = frozenset()
    projects: frozenset[str] | None = None
    endpoint: str | None = None
    draining: bool = False

    @property
    def zone_key(self) -> str | None:
        """Workers without a zone (unset or blank) form one zone of their own: None."""
        return self.zone or None


@dataclass(frozen=True, slots=True)
class SlotSnapshot:
    """An unanswered RequestJob of one kind (a snapshot of an idle_slot row): the planner's only view
    of free capacity."""

    worker_id: str
    kind: JobKind
    recorded_at: datetime


@dataclass(frozen=True, slots=True)
class ScoreSnapshot:
    """A worker's answer for one candidate job (a snapshot of a candidate_score row): the NAR bytes it
    would have to fetch."""

    worker_id: str
    job_key: str
    missing_nar_size: int


@dataclass(frozen=True, slots=True)
class Penalty:
    """A worker rejected a prepare or let a hold expire at `at`: down-ranked as a seat for a while."""

    worker_id: str
    at: datetime
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Pool:
    """Free capacity and what is known about it, at one instant.

    `workers` are the connected workers by id, `idle_slots` the recorded unanswered requests (stale ones
    are ignored by age), `scores` the missing NAR sizes by job key, then worker id (the shape of a load
    through idx-candidate_score-job), and `penalties` the latest penalty time by worker id.
    """

    workers: Mapping[str, WorkerSnapshot] = field(default_factory=dict)
    idle_slots: tuple[SlotSnapshot, ...] = ()
    scores: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    penalties: Mapping[str, datetime] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        *,
        workers: Iterable[WorkerSnapshot] = (),
        idle_slots: Iterable[SlotSnapshot] = (),
        scores: Iterable[ScoreSnapshot] = (),
        penalties: Iterable[Penalty] = (),
    ) -> Pool:
        """Build a pool from row-shaped lists; a later penalty of one worker wins over an earlier one."""
        latest: dict[str, datetime] = {}
        for p in penalties:
            if p.worker_id not in latest or p.at > latest[p.worker_id]:
                latest[p.worker_id] = p.at
        by_job: dict[str, dict[str, int]] = {}
        for s in scores:
            by_job.setdefault(s.job_key, {})[s.worker_id] = s.missing_nar_size
        return cls(
            workers={w.worker_id: w for w in workers},
            idle_slots=tuple(idle_slots),
            scores=by_job,
            penalties=latest,
        )


@dataclass(frozen=True, slots=True)
class Seat:
    """One member seated on one worker."""

    role: str
    index: int
    job_key: str
    kind: JobKind
    worker_id: str
    zone: str | None = None
    endpoint: str | None = None

    @property
    def address(self) -> MemberAddress:
        return MemberAddress(self.role, self.index)

    def as_json(self) -> dict[str, object]:
        return {"role": self.role, "index": self.index, "worker_id": self.worker_id, "zone": self.zone}


@dataclass(frozen=True, slots=True)
class Placement:
    """A full placement: every member of the cluster on its own worker. `cost` is the summed missing
    NAR size of the seats (unknown sizes and penalties counted as the matcher's policy says)."""

    cluster_id: str
    seats: tuple[Seat, ...]
    cost: int
    zone: str | None = None

    @property
    def worker_ids(self) -> frozenset[str]:
        return frozenset(s.worker_id for s in self.seats)


class SeatShortage(StrEnum):
    """Why a member has no seat at all."""

    NO_IDLE_SLOT = "no_idle_slot"
    PIN_NOT_IDLE = "pin_not_idle"
    NO_CAPABLE_WORKER = "no_capable_worker"
    NO_PROJECT_ACCESS = "no_project_access"


@dataclass(frozen=True, slots=True)
class MemberShortfall:
    """A member without any seat (in the whole pool, or in one zone), and why."""

    address: MemberAddress
    reason: SeatShortage
    pin: str | None = None

    def as_json(self) -> dict[str, object]:
        out: dict[str, object] = {**self.address.as_json(), "reason": str(self.reason)}
        if self.pin is not None:
            out["pin"] = self.pin
        return out


@dataclass(frozen=True, slots=True)
class ZoneShortfall:
    """What one zone lacks to seat a same_zone cluster: the members it has no seat for, and how many
    distinct workers could seat any member against how many members need one."""

    zone: str | None
    unseated: tuple[MemberShortfall, ...]
    seatable_workers: int
    members: int

    def as_json(self) -> dict[str, object]:
        return {
            "zone": self.zone,
            "unseated": [m.as_json() for m in self.unseated],
            "seatable_workers": self.seatable_workers,
            "members": self.members,
        }


class WaitingCode(StrEnum):
    NO_SEAT = "no_seat"
    TOO_FEW_WORKERS = "too_few_workers"
    NO_ZONE_FITS = "no_zone_fits"
    BACKOFF = "backoff"
    PARKED = "parked"
    RESERVED = "reserved"
    MEMBER_CANNOT_START = "member_cannot_start"
    NO_MEMBERS = "no_members"


@dataclass(frozen=True, slots=True)
class WaitingReason:
    """Why a cluster was not placed in this pass; `as_json()` is what cluster_job.waiting_reason holds."""

    code: WaitingCode
    members: tuple[MemberShortfall, ...] = ()
    zones: tuple[ZoneShortfall, ...] = ()
    blocked: tuple[MemberAddress, ...] = ()
    seatable_workers: int | None = None
    needed: int | None = None
    until: datetime | None = None
    prepare_failures: int | None = None
    detail: str = ""

    def as_json(self) -> dict[str, object]:
        out: dict[str, object] = {"code": str(self.code)}
        if self.members:
            out["members"] = [m.as_json() for m in self.members]
        if self.zones:
            out["zones"] = [z.as_json() for z in self.zones]
        if self.blocked:
            out["blocked"] = [a.as_json() for a in self.blocked]
        if self.seatable_workers is not None:
            out["seatable_workers"] = self.seatable_workers
        if self.needed is not None:
            out["needed"] = self.needed
        if self.until is not None:
            out["until"] = self.until.isoformat()
        if self.prepare_failures is not None:
            out["prepare_failures"] = self.prepare_failures
        if self.detail:
            out["detail"] = self.detail
        return out


@dataclass(frozen=True, slots=True)
class ReservedSeat:
    """One seat of a reservation: the worker keeps its running jobs but gets no new single job of
    `kind` until the reservation commits or is released."""

    role: str
    index: int
    kind: JobKind
    worker_id: str

    def as_json(self) -> dict[str, object]:
        return {"role": self.role, "index": self.index, "kind": str(self.kind), "worker_id": self.worker_id}


@dataclass(frozen=True, slots=True)
class Reservation:
    """An aging cluster's reserved placement (the cluster_reservation row). One at a time."""

    cluster_id: str
    seats: tuple[ReservedSeat, ...]
    created_at: datetime
    expires_at: datetime
