"""The prepare/start state machine of one cluster attempt, prepare backoff, and signal routing.

An attempt begins with a placement: the service claims the cluster and its seats (ClaimCluster). A
lost claim writes nothing and the members go back to the assignment passes. A won claim sends every
seat AssignJob with `cluster{attempt, role, index, hold_secs}`; hold_secs is the prepare timeout plus
10 s, so a worker that never hears StartCluster releases the slot on its own. Once every member
accepted, the attempt starts (StartAttempt: the cluster goes Running and its started-attempt counter
grows) and every member gets StartCluster with the roster.

A reject, the prepare timeout, or a held member's JobFailed before the start closes the attempt
PrepareFailed, sends AbortCluster to every member, and schedules the next try. A failed prepare spends
no retry budget; consecutive failures back off exponentially from the 30 s base with a deterministic
jitter (seeded by the cluster id and the failure count, so every server computes the same time), and
past `park_after_failures` the cluster parks with a waiting reason instead of retrying for ever. Workers
that rejected, let a hold expire, or never answered before the timeout are penalised, which the
matcher turns into a down-rank for a while.

`step` is total: an event that does not apply to the attempt's phase (a stale timer, a report for
another worker, anything after the close) changes nothing and asks for nothing. Member reports after
the start belong to settlement, not here.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum

from gradient.clusters.decisions.types import (
    MemberAddress,
    Placement,
    WaitingCode,
    WaitingReason,
)
from gradient.core.vocab import JobKind

PREPARE_TIMEOUT_SECS = 30.0
HOLD_MARGIN_SECS = 10
PREPARE_RETRY_WAIT_SECS = 30.0


@dataclass(frozen=True, slots=True)
class CoordinatorPolicy:
    prepare_timeout_secs: float = PREPARE_TIMEOUT_SECS
    hold_margin_secs: int = HOLD_MARGIN_SECS
    retry_wait_secs: float = PREPARE_RETRY_WAIT_SECS
    backoff_factor: float = 2.0
    max_retry_wait_secs: float = 960.0
    jitter: float = 0.2
    """Up to this fraction of the wait is added, never taken away: the first retry waits at least 30 s."""
    park_after_failures: int = 8


def hold_secs(policy: CoordinatorPolicy | None = None) -> int:
    """How long a worker holds a member without StartCluster: the prepare timeout plus 10 s."""
    policy = policy or CoordinatorPolicy()
    return math.ceil(policy.prepare_timeout_secs) + policy.hold_margin_secs


def _unit(seed: str) -> float:
    """A number in [0, 1) that depends only on `seed`."""
    digest = hashlib.blake2b(seed.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def prepare_retry_delay(cluster_id: str, failures: int, policy: CoordinatorPolicy | None = None) -> float:
    """Seconds to wait after the `failures`-th consecutive failed prepare (failures >= 1)."""
    if failures < 1:
        raise ValueError("prepare_retry_delay needs at least one failed prepare")
    policy = policy or CoordinatorPolicy()
    base = min(
        policy.retry_wait_secs * policy.backoff_factor ** (failures - 1),
        policy.max_retry_wait_secs,
    )
    return base * (1.0 + policy.jitter * _unit(f"{cluster_id}:{failures}"))


def is_parked(prepare_failures: int, policy: CoordinatorPolicy | None = None) -> bool:
    """Past the cap a cluster stops retrying until an operator resets its prepare failures."""
    policy = policy or CoordinatorPolicy()
    return prepare_failures >= policy.park_after_failures


class AttemptPhase(StrEnum):
    CLAIMING = "claiming"
    PREPARING = "preparing"
    STARTED = "started"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class AttemptMember:
    role: str
    index: int
    job_key: str
    kind: JobKind
    worker_id: str
    zone: str | None = None
    endpoint: str | None = None
    accepted: bool = False

    @property
    def address(self) -> MemberAddress:
        return MemberAddress(self.role, self.index)


@dataclass(frozen=True, slots=True)
class AttemptState:
    attempt_id: str
    cluster_id: str
    members: tuple[AttemptMember, ...]
    created_at: datetime
    prepare_deadline: datetime
    phase: AttemptPhase
    prepare_failures: int = 0
    """Consecutive failed prepares of the cluster before this attempt."""
    started_at: datetime | None = None
    close_reason: str = ""

    def member_on(self, worker_id: str) -> AttemptMember | None:
        return next((m for m in self.members if m.worker_id == worker_id), None)

    @property
    def worker_ids(self) -> tuple[str, ...]:
        return tuple(m.worker_id for m in self.members)


@dataclass(frozen=True, slots=True)
class ClusterMembership:
    """AssignJob.cluster."""

    attempt: str
    role: str
    index: int
    hold_secs: int


@dataclass(frozen=True, slots=True)
class ClusterPeer:
    """One roster entry of StartCluster."""

    role: str
    index: int
    worker_id: str
    zone: str | None = None
    endpoint: str | None = None


# Events


@dataclass(frozen=True, slots=True)
class ClaimWon:
    pass


@dataclass(frozen=True, slots=True)
class ClaimLost:
    pass


@dataclass(frozen=True, slots=True)
class MemberAccepted:
    job_key: str
    worker_id: str


@dataclass(frozen=True, slots=True)
class MemberRejected:
    job_key: str
    worker_id: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PrepareTimedOut:
    pass


@dataclass(frozen=True, slots=True)
class HeldMemberFailed:
    """JobFailed from a held member before the start (hold expired, drain, AbortJob)."""

    job_key: str
    worker_id: str
    error: str = ""
    hold_expired: bool = False


AttemptEvent = ClaimWon | ClaimLost | MemberAccepted | MemberRejected | PrepareTimedOut | HeldMemberFailed


# Actions: what the service writes or sends, in order. Messages go out after the commit.


@dataclass(frozen=True, slots=True)
class ClaimCluster:
    attempt_id: str
    cluster_id: str
    placement: Placement
    created_at: datetime
    prepare_deadline: datetime


@dataclass(frozen=True, slots=True)
class SendAssignJob:
    worker_id: str
    job_key: str
    cluster: ClusterMembership


@dataclass(frozen=True, slots=True)
class StartAttempt:
    """start_cluster_attempt: the attempt started, the cluster Running, attempts + 1, prepare failures 0."""

    attempt_id: str
    cluster_id: str
    started_at: datetime


@dataclass(frozen=True, slots=True)
class SendStartCluster:
    worker_ids: tuple[str, ...]
    attempt_id: str
    roster: tuple[ClusterPeer, ...]


@dataclass(frozen=True, slots=True)
class ClosePrepareFailed:
    """close_cluster_attempt(outcome=PrepareFailed); it also marks the open member rows Abandoned."""

    attempt_id: str
    cluster_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class SendAbortCluster:
    worker_ids: tuple[str, ...]
    attempt_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class ScheduleRetry:
    """The cluster waits until `retry_at`; `prepare_failures` is its new consecutive count."""

    cluster_id: str
    retry_at: datetime
    prepare_failures: int


@dataclass(frozen=True, slots=True)
class ParkCluster:
    cluster_id: str
    prepare_failures: int
    waiting_reason: WaitingReason


@dataclass(frozen=True, slots=True)
class PenaliseWorker:
    worker_id: str
    at: datetime
    reason: str


AttemptAction = (
    ClaimCluster
    | SendAssignJob
    | StartAttempt
    | SendStartCluster
    | ClosePrepareFailed
    | SendAbortCluster
    | ScheduleRetry
    | ParkCluster
    | PenaliseWorker
)

Step = tuple[AttemptState, tuple[AttemptAction, ...]]


def begin_attempt(
    placement: Placement,
    *,
    attempt_id: str,
    now: datetime,
    prepare_failures: int = 0,
    policy: CoordinatorPolicy | None = None,
) -> Step:
    """A new attempt for a placement: the claim to try. Its deadline starts with the claim."""
    policy = policy or CoordinatorPolicy()
    if not placement.seats:
        raise ValueError("a placement without seats cannot begin an attempt")
    deadline = now + timedelta(seconds=policy.prepare_timeout_secs)
    state = AttemptState(
        attempt_id=attempt_id,
        cluster_id=placement.cluster_id,
        members=tuple(
            AttemptMember(s.role, s.index, s.job_key, s.kind, s.worker_id, s.zone, s.endpoint)
            for s in placement.seats
        ),
        created_at=now,
        prepare_deadline=deadline,
        phase=AttemptPhase.CLAIMING,
        prepare_failures=prepare_failures,
    )
    return state, (ClaimCluster(attempt_id, placement.cluster_id, placement, now, deadline),)


def roster(state: AttemptState) -> tuple[ClusterPeer, ...]:
    return tuple(
        ClusterPeer(m.role, m.index, m.worker_id, m.zone, m.endpoint)
        for m in sorted(state.members, key=lambda m: (m.role, m.index))
    )


def is_overdue(state: AttemptState, now: datetime) -> bool:
    """A prepare past its deadline: the pass expires these before placing anything."""
    return state.phase == AttemptPhase.PREPARING and now >= state.prepare_deadline


def step(
    state: AttemptState, event: AttemptEvent, now: datetime, policy: CoordinatorPolicy | None = None
) -> Step:
    policy = policy or CoordinatorPolicy()
    phase = state.phase
    if phase == AttemptPhase.CLAIMING:
        if isinstance(event, ClaimWon):
            return _claimed(state, policy)
        if isinstance(event, ClaimLost):
            # Nothing was written: the transaction rolled back. The members go back to the
            # assignment passes, which re-read their cluster.
            return replace(state, phase=AttemptPhase.CLOSED, close_reason="claim lost"), ()
        return state, ()
    if phase != AttemptPhase.PREPARING:
        return state, ()

    if isinstance(event, MemberAccepted):
        member = state.member_on(event.worker_id)
        if member is None or member.job_key != event.job_key or member.accepted:
            return state, ()
        members = tuple(
            replace(m, accepted=True) if m.worker_id == member.worker_id else m for m in state.members
        )
        state = replace(state, members=members)
        if not all(m.accepted for m in members):
            return state, ()
        started = replace(state, phase=AttemptPhase.STARTED, started_at=now)
        return started, (
            StartAttempt(state.attempt_id, state.cluster_id, now),
            SendStartCluster(state.worker_ids, state.attempt_id, roster(started)),
        )
    if isinstance(event, MemberRejected):
        member = state.member_on(event.worker_id)
        if member is None or member.job_key != event.job_key:
            return state, ()
        reason = f"{member.role}[{member.index}] on {member.worker_id} rejected the prepare"
        if event.reason:
            reason += f": {event.reason}"
        return _prepare_failed(state, now, policy, reason, penalise=(member.worker_id,))
    if isinstance(event, HeldMemberFailed):
        member = state.member_on(event.worker_id)
        if member is None or member.job_key != event.job_key:
            return state, ()
        reason = f"{member.role}[{member.index}] on {member.worker_id} failed before the start"
        if event.error:
            reason += f": {event.error}"
        penalise = (member.worker_id,) if event.hold_expired else ()
        return _prepare_failed(state, now, policy, reason, penalise=penalise)
    if isinstance(event, PrepareTimedOut):
        if now < state.prepare_deadline:
            return state, ()  # a stale timer
        silent = tuple(m for m in state.members if not m.accepted)
        names = ", ".join(f"{m.role}[{m.index}]" for m in silent)
        reason = f"prepare timed out after {policy.prepare_timeout_secs:g} s waiting for {names}"
        return _prepare_failed(state, now, policy, reason, penalise=tuple(m.worker_id for m in silent))
    return state, ()


def _claimed(state: AttemptState, policy: CoordinatorPolicy) -> Step:
    hold = hold_secs(policy)
    sends = tuple(
        SendAssignJob(m.worker_id, m.job_key, ClusterMembership(state.attempt_id, m.role, m.index, hold))
        for m in state.members
    )
    return replace(state, phase=AttemptPhase.PREPARING), sends


def _prepare_failed(
    state: AttemptState,
    now: datetime,
    policy: CoordinatorPolicy,
    reason: str,
    *,
    penalise: tuple[str, ...],
) -> Step:
    failures = state.prepare_failures + 1
    actions: list[AttemptAction] = [
        ClosePrepareFailed(state.attempt_id, state.cluster_id, reason),
        SendAbortCluster(state.worker_ids, state.attempt_id, reason),
    ]
    actions.extend(PenaliseWorker(w, now, reason) for w in penalise)
    if is_parked(failures, policy):
        actions.append(
            ParkCluster(
                state.cluster_id,
                failures,
                WaitingReason(WaitingCode.PARKED, prepare_failures=failures, detail=reason),
            )
        )
    else:
        delay = prepare_retry_delay(state.cluster_id, failures, policy)
        actions.append(ScheduleRetry(state.cluster_id, now + timedelta(seconds=delay), failures))
    closed = replace(state, phase=AttemptPhase.CLOSED, close_reason=reason)
    return closed, tuple(actions)


@dataclass(frozen=True, slots=True)
class SignalRoute:
    """A ClusterSignal to forward: the sender's address and the workers that receive it."""

    sender: MemberAddress
    recipients: tuple[str, ...]


def route_signal(state: AttemptState, from_worker: str, to: MemberAddress | None) -> SignalRoute | None:
    """Where a ClusterSignal goes, or None when it is dropped: only within a started attempt and only
    from one of its members. `to` names one member by role and index; absent means all the others."""
    if state.phase != AttemptPhase.STARTED:
        return None
    sender = state.member_on(from_worker)
    if sender is None:
        return None
    recipients = tuple(
        m.worker_id
        for m in sorted(state.members, key=lambda m: (m.role, m.index))
        if m.worker_id != from_worker and (to is None or m.address == to)
    )
    return SignalRoute(sender.address, recipients)
