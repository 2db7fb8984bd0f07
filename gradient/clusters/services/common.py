"""What every cluster service shares: the policies built from settings, the messages pushed to workers
(protocol.md field names, each sent once the transaction that decided it committed), the cluster lock,
and the coordinator's view of an attempt loaded from its rows.

Lock order, everywhere: cluster_job, then cluster_attempt, then dispatched_job, then the member jobs and
their records. Every service that decides something about an attempt first locks its cluster_job row, so
two decisions about one cluster (a report and the prepare timeout, two reports) run one after the other.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence

from django.conf import settings

from gradient.clusters.decisions.coordinator import (
    AttemptMember,
    AttemptPhase,
    AttemptState,
    ClusterMembership,
    ClusterPeer,
    CoordinatorPolicy,
)
from gradient.clusters.decisions.matcher import MatchPolicy
from gradient.clusters.decisions.planner import PlannerPolicy
from gradient.clusters.decisions.reservation import ReservationPolicy
from gradient.clusters.decisions.types import MemberAddress, SlotKind
from gradient.clusters.models import ClusterAttempt, ClusterJob, ClusterSeat
from gradient.core import protocol
from gradient.core.protocol import (
    AbortCluster,
    AbortJob,
    AssignJob,
    ClusterAddress,
    ClusterSignalDelivery,
    Job,
    ServerMessage,
    StartCluster,
)
from gradient.runtime.outbox import push_to_worker_on_commit

Push = tuple[str, ServerMessage]
"""A message to one worker (its id as text, the message). Services send every push themselves,
through the channel layer once their transaction committed, and return them for the caller's logs."""


# --- Policies -------------------------------------------------------------------------------------------


def coordinator_policy() -> CoordinatorPolicy:
    return CoordinatorPolicy(
        prepare_timeout_secs=float(settings.GRADIENT_SCHEDULER_CLUSTER_PREPARE_TIMEOUT_SECS),
        retry_wait_secs=float(settings.GRADIENT_SCHEDULER_CLUSTER_RETRY_WAIT_SECS),
    )


def match_policy() -> MatchPolicy:
    return MatchPolicy()


def planner_policy() -> PlannerPolicy:
    return PlannerPolicy(
        match=match_policy(),
        coordinator=coordinator_policy(),
        reserve_after_secs=float(settings.GRADIENT_SCHEDULER_CLUSTER_RESERVE_AFTER_SECS),
    )


def reservation_policy() -> ReservationPolicy:
    return ReservationPolicy(
        reserve_after_secs=float(settings.GRADIENT_SCHEDULER_CLUSTER_RESERVE_AFTER_SECS),
        reserve_timeout_secs=float(settings.GRADIENT_SCHEDULER_CLUSTER_RESERVE_TIMEOUT_SECS),
        match=match_policy(),
        coordinator=coordinator_policy(),
    )


# --- Messages -------------------------------------------------------------------------------------------


def push(worker_id: uuid.UUID | str, message: ServerMessage) -> Push:
    """Send `message` to the worker once the current transaction commits."""
    push_to_worker_on_commit(worker_id, message)
    return (str(worker_id), message)


def assign_job_message(
    *, job_key: str, assignment_id: uuid.UUID, job: Job, membership: ClusterMembership
) -> AssignJob:
    return AssignJob(
        job_id=job_key,
        assignment_id=str(assignment_id),
        job=job,
        cluster=protocol.ClusterMembership(
            attempt=membership.attempt,
            role=membership.role,
            index=membership.index,
            hold_secs=membership.hold_secs,
        ),
    )


def start_cluster_message(attempt_id: str, roster: Iterable[ClusterPeer]) -> StartCluster:
    return StartCluster(
        attempt=attempt_id,
        roster=[
            protocol.ClusterPeer(
                role=p.role, index=p.index, worker_id=p.worker_id, zone=p.zone, endpoint=p.endpoint
            )
            for p in roster
        ],
    )


def abort_cluster_message(attempt_id: str, reason: str) -> AbortCluster:
    return AbortCluster(attempt=attempt_id, reason=reason[:2000])


def abort_job_message(job_key: str, assignment_id: uuid.UUID, reason: str) -> AbortJob:
    return AbortJob(job_id=job_key, assignment_id=str(assignment_id), reason=reason[:2000])


def cluster_signal_message(attempt_id: str, sender: MemberAddress, payload: str) -> ClusterSignalDelivery:
    return ClusterSignalDelivery(
        attempt=attempt_id, from_=ClusterAddress(role=sender.role, index=sender.index), payload=payload
    )


# --- Rows -----------------------------------------------------------------------------------------------


def lock_cluster(cluster_id: uuid.UUID) -> ClusterJob | None:
    """The cluster row, locked until the transaction ends (call inside one)."""
    return ClusterJob.objects.select_for_update(no_key=True).filter(id=cluster_id).first()


def attempt_seats(attempt_id: uuid.UUID) -> list[ClusterSeat]:
    return list(ClusterSeat.objects.filter(attempt_id=attempt_id).order_by("role", "index"))


def attempt_phase(attempt: ClusterAttempt) -> AttemptPhase:
    if attempt.finished_at is not None:
        return AttemptPhase.CLOSED
    if attempt.started_at is not None:
        return AttemptPhase.STARTED
    return AttemptPhase.PREPARING


def attempt_state(cluster: ClusterJob, attempt: ClusterAttempt, seats: Sequence[ClusterSeat]) -> AttemptState:
    """The coordinator's view of an attempt, as its rows hold it."""
    return AttemptState(
        attempt_id=str(attempt.id),
        cluster_id=str(cluster.id),
        members=tuple(
            AttemptMember(
                role=s.role,
                index=s.index,
                job_key=s.job_key,
                kind=SlotKind(s.kind),
                worker_id=str(s.worker_id),
                zone=s.zone,
                endpoint=s.endpoint,
                accepted=s.accepted_at is not None,
            )
            for s in seats
        ),
        created_at=attempt.created_at,
        prepare_deadline=attempt.prepare_deadline or attempt.created_at,
        phase=attempt_phase(attempt),
        prepare_failures=cluster.prepare_failures,
        started_at=attempt.started_at,
    )
