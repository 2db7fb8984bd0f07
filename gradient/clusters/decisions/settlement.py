"""The verdict of a started cluster attempt, how each member settles, and startup recovery.

Verdicts, in order (the reference notes):

1. Complete if the primary succeeded or every member succeeded;
2. otherwise Abort if any member was aborted by an evaluation abort (or the cluster's abort intent);
3. otherwise Retry if a member failed or was lost, budget is left (`attempts < retry_budget`, so a
   budget of 0 or 1 allows one started attempt) and every member can still start;
4. otherwise Fail.

A report decides only when it makes one of these true: a non-primary success with the others still
running decides nothing (`verdict` returns None). The first deciding report resolves the attempt, and
every member then settles by that verdict, including reports that arrive during the resolution
(`settle_member` is the one mapping for both).

| verdict  | attempt   | cluster   | members |
|----------|-----------|-----------|---------|
| Complete | Succeeded | Completed | reported members settle, still-running ones end Aborted |
| Retry    | Failed    | Queued    | every member job goes back to the assignment passes |
| Fail     | Failed    | Failed    | own outcome, requeueing kinds made permanent; survivors end Aborted |
| Abort    | Aborted   | Aborted   | reported members settle, survivors end Aborted |

A member that finished with its cluster can never requeue as a single job, so under every verdict but
Retry a failure of a requeueing kind (transient, substitute_unavailable, inputs_unavailable) settles as
permanent, and a member lost with its worker settles as a permanent failure under Fail and Aborted
under Complete and Abort. `canceled` (the worker is stopping) counts as lost.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from gradient.clusters.decisions.types import MemberAddress
from gradient.core.vocab import (
    REQUEUEING_FAILURE_KINDS,
    AttemptOutcome,
    ClusterStatus,
    FailureKind,
    SeatResult,
)
from gradient.core.vocab import Verdict as Verdict

MemberOutcome = SeatResult
"""What a member showed so far: gradient.core.vocab.SeatResult (cluster_seat.result), the old name."""


@dataclass(frozen=True, slots=True)
class MemberResult:
    role: str
    index: int
    job_key: str
    primary: bool = False
    outcome: SeatResult = SeatResult.RUNNING
    failure_kind: FailureKind | None = None
    error: str = ""
    can_start: bool = True
    """False when the member job can no longer start again (resync removal, evaluation cancel)."""

    @property
    def address(self) -> MemberAddress:
        return MemberAddress(self.role, self.index)

    @property
    def effective_outcome(self) -> SeatResult:
        if self.outcome == SeatResult.FAILED and self.failure_kind == FailureKind.CANCELED:
            return SeatResult.LOST
        return self.outcome


@dataclass(frozen=True, slots=True)
class AttemptFacts:
    """A started attempt as the reports so far leave it. `attempts` counts started attempts, this one
    included."""

    members: tuple[MemberResult, ...]
    attempts: int
    retry_budget: int
    abort_requested: bool = False


def classify_failure(kind: FailureKind, *, evaluation_aborted: bool) -> SeatResult:
    """A member's JobFailed as an outcome: an abort caused by an evaluation abort aborts the cluster,
    `canceled` (worker stopping) is a lost member, anything else a failure."""
    if kind == FailureKind.ABORTED and evaluation_aborted:
        return SeatResult.EVALUATION_ABORTED
    if kind == FailureKind.CANCELED:
        return SeatResult.LOST
    return SeatResult.FAILED


def retry_allowed(attempts: int, retry_budget: int) -> bool:
    """Budget is left: retry_budget bounds started attempts (0 or 1: one, 2: a first and one retry)."""
    return attempts < retry_budget


def verdict(facts: AttemptFacts) -> Verdict | None:
    """The verdict the reports so far decide, or None while nothing decides yet."""
    outcomes = [m.effective_outcome for m in facts.members]
    if any(
        m.primary and o == SeatResult.SUCCEEDED for m, o in zip(facts.members, outcomes, strict=True)
    ) or all(o == SeatResult.SUCCEEDED for o in outcomes):
        return Verdict.COMPLETE
    if facts.abort_requested or SeatResult.EVALUATION_ABORTED in outcomes:
        return Verdict.ABORT
    if SeatResult.FAILED in outcomes or SeatResult.LOST in outcomes:
        if retry_allowed(facts.attempts, facts.retry_budget) and all(m.can_start for m in facts.members):
            return Verdict.RETRY
        return Verdict.FAIL
    return None


def attempt_outcome(v: Verdict) -> AttemptOutcome:
    return {
        Verdict.COMPLETE: AttemptOutcome.SUCCEEDED,
        Verdict.RETRY: AttemptOutcome.FAILED,
        Verdict.FAIL: AttemptOutcome.FAILED,
        Verdict.ABORT: AttemptOutcome.ABORTED,
    }[v]


def cluster_status(v: Verdict) -> ClusterStatus:
    return {
        Verdict.COMPLETE: ClusterStatus.COMPLETED,
        Verdict.RETRY: ClusterStatus.QUEUED,
        Verdict.FAIL: ClusterStatus.FAILED,
        Verdict.ABORT: ClusterStatus.ABORTED,
    }[v]


class MemberSettlement(StrEnum):
    COMPLETED = "completed"
    """The job's own success transition."""
    FAILED = "failed"
    """The job's failure transition, with `failure_kind`."""
    ABORTED = "aborted"
    """The job ends Aborted."""
    REQUEUED = "requeued"
    """The job goes back to the assignment passes (through the cluster book)."""


@dataclass(frozen=True, slots=True)
class MemberDisposition:
    address: MemberAddress
    job_key: str
    settlement: MemberSettlement
    failure_kind: FailureKind | None = None
    error: str = ""
    abort_running: bool = False
    """The member was still running: its worker gets AbortJob before the job settles."""


def final_failure_kind(kind: FailureKind | None) -> FailureKind:
    """A failure that must not requeue: requeueing kinds become permanent."""
    if kind is None or kind in REQUEUEING_FAILURE_KINDS or kind == FailureKind.CANCELED:
        return FailureKind.PERMANENT
    return kind


def settle_member(v: Verdict, member: MemberResult) -> MemberDisposition:
    """How one member settles under the decided verdict (also for a report arriving during the
    resolution: pass the member as that report leaves it)."""
    outcome = member.effective_outcome
    running = outcome == SeatResult.RUNNING

    def out(
        settlement: MemberSettlement, kind: FailureKind | None = None, error: str = ""
    ) -> MemberDisposition:
        return MemberDisposition(member.address, member.job_key, settlement, kind, error, running)

    if v == Verdict.RETRY:
        return out(MemberSettlement.REQUEUED)
    if outcome == SeatResult.SUCCEEDED:
        return out(MemberSettlement.COMPLETED)
    if running:
        return out(MemberSettlement.ABORTED, error=_WHY[v])
    if outcome == SeatResult.EVALUATION_ABORTED:
        return out(MemberSettlement.ABORTED, error=member.error or "evaluation aborted")
    if outcome == SeatResult.LOST:
        if v == Verdict.FAIL:
            return out(
                MemberSettlement.FAILED,
                FailureKind.PERMANENT,
                "worker lost while running a cluster member; cluster retry budget spent",
            )
        return out(MemberSettlement.ABORTED, error="worker lost while running a cluster member")
    kind = final_failure_kind(member.failure_kind)
    error = member.error
    if kind != member.failure_kind:
        error = (
            f"{member.error} (made permanent: {_WHY[v]})" if member.error else f"made permanent: {_WHY[v]}"
        )
    return out(MemberSettlement.FAILED, kind, error)


_WHY = {
    Verdict.COMPLETE: "its cluster completed",
    Verdict.RETRY: "its cluster retries",
    Verdict.FAIL: "its cluster failed",
    Verdict.ABORT: "its cluster was aborted",
}


@dataclass(frozen=True, slots=True)
class Resolution:
    verdict: Verdict
    attempt_outcome: AttemptOutcome
    cluster_status: ClusterStatus
    members: tuple[MemberDisposition, ...]


def resolve(facts: AttemptFacts) -> Resolution | None:
    """The verdict and every member's settlement, or None while nothing decides yet."""
    v = verdict(facts)
    if v is None:
        return None
    return Resolution(
        v,
        attempt_outcome(v),
        cluster_status(v),
        tuple(settle_member(v, m) for m in sorted(facts.members, key=lambda m: (m.role, m.index))),
    )


# Startup recovery


@dataclass(frozen=True, slots=True)
class OpenAttempt:
    attempt_id: str
    started: bool


@dataclass(frozen=True, slots=True)
class RecoveringCluster:
    """A cluster as the database holds it at server start. `has_dead_member`: a member can no longer
    start (its evaluation terminal, its shared build in a lasting failure, ...)."""

    cluster_id: str
    status: ClusterStatus
    attempts: int
    retry_budget: int
    has_dead_member: bool = False
    open_attempt: OpenAttempt | None = None


@dataclass(frozen=True, slots=True)
class AttemptClose:
    attempt_id: str
    cluster_id: str
    outcome: AttemptOutcome
    reason: str


@dataclass(frozen=True, slots=True)
class ClusterChange:
    """A status change; `members` says how the members still unsettled settle."""

    cluster_id: str
    status_from: ClusterStatus
    status_to: ClusterStatus
    members: MemberSettlement
    reason: str


@dataclass(frozen=True, slots=True)
class RecoveryPlan:
    closes: tuple[AttemptClose, ...]
    changes: tuple[ClusterChange, ...]


def recover_clusters(clusters: Iterable[RecoveringCluster]) -> RecoveryPlan:
    """Startup recovery of clusters, in the reference notes' order: close unstarted open attempts
    PrepareFailed, then started ones Aborted; Running clusters with a dead member become Aborted,
    Running clusters whose budget is spent Failed, the remaining Running ones Queued; Queued clusters
    with a dead member are aborted."""
    snapshot = sorted(clusters, key=lambda c: c.cluster_id)
    closes: list[AttemptClose] = []
    for started, outcome, reason in (
        (False, AttemptOutcome.PREPARE_FAILED, "server restarted during the prepare"),
        (True, AttemptOutcome.ABORTED, "server restarted while the attempt ran"),
    ):
        closes.extend(
            AttemptClose(c.open_attempt.attempt_id, c.cluster_id, outcome, reason)
            for c in snapshot
            if c.open_attempt is not None and c.open_attempt.started is started
        )

    changes: list[ClusterChange] = []
    decided: set[str] = set()

    def change(c: RecoveringCluster, to: ClusterStatus, members: MemberSettlement, reason: str) -> None:
        changes.append(ClusterChange(c.cluster_id, c.status, to, members, reason))
        decided.add(c.cluster_id)

    running = [c for c in snapshot if c.status == ClusterStatus.RUNNING]
    for c in running:
        if c.has_dead_member:
            change(c, ClusterStatus.ABORTED, MemberSettlement.ABORTED, "a member can no longer start")
    for c in running:
        if c.cluster_id not in decided and not retry_allowed(c.attempts, c.retry_budget):
            change(c, ClusterStatus.FAILED, MemberSettlement.ABORTED, "retry budget spent")
    for c in running:
        if c.cluster_id not in decided:
            change(c, ClusterStatus.QUEUED, MemberSettlement.REQUEUED, "requeued after a server restart")
    for c in snapshot:
        if c.status == ClusterStatus.QUEUED and c.has_dead_member:
            change(c, ClusterStatus.ABORTED, MemberSettlement.ABORTED, "a member can no longer start")
    return RecoveryPlan(tuple(closes), tuple(changes))
