"""Aging reservations: a cluster that found no simultaneously idle workers for too long reserves seats.

`step(state, inputs, now)` is called once per cluster-dispatch pass, after the planner:

- Without a reservation, the planner's pick (the oldest unplaced cluster past `reserve_after_secs`,
  prioritized first) reserves the matcher's placement over every connected eligible worker, idle
  workers seated first (a busy seat costs more than any idle one could). Nothing happens if even that
  finds no full placement.
- A held reservation commits, as an ordinary placement over exactly its seats, once every seat's worker
  holds an idle slot of the seat's kind. It is released after `reserve_timeout_secs`, when a seat's
  worker disconnects (or drains), when the cluster leaves the queue, or when the idle seats no longer
  fit the cluster (capabilities changed). The next pass can reserve again.

Only one cluster holds a reservation at a time (the state is one Reservation or None). Reserved
workers keep their running jobs but get no new single job of the reserved kind (`is_reserved`), and
other clusters plan over the unreserved idle workers (`hidden_seats`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from gradient.clusters.decisions.coordinator import CoordinatorPolicy, is_parked
from gradient.clusters.decisions.matcher import MatchPolicy, PoolIndex
from gradient.clusters.decisions.types import (
    Cluster,
    Placement,
    Pool,
    Reservation,
    ReservedSeat,
)
from gradient.core.vocab import JobKind

RESERVE_AFTER_SECS = 600.0
RESERVE_TIMEOUT_SECS = 1800.0


@dataclass(frozen=True, slots=True)
class ReservationPolicy:
    reserve_after_secs: float = RESERVE_AFTER_SECS
    reserve_timeout_secs: float = RESERVE_TIMEOUT_SECS
    match: MatchPolicy = MatchPolicy()
    coordinator: CoordinatorPolicy = CoordinatorPolicy()


@dataclass(frozen=True, slots=True)
class ReservationInputs:
    """`clusters`: every Queued cluster; `candidate`: the planner's pick to reserve (PlanResult.reserve);
    `seated`: workers this pass's placements just took, which count as busy."""

    clusters: tuple[Cluster, ...]
    pool: Pool
    candidate: str | None = None
    seated: frozenset[str] = frozenset()


class ReleaseReason(StrEnum):
    TIMEOUT = "timeout"
    SEAT_DISCONNECTED = "seat_disconnected"
    LEFT_QUEUE = "left_queue"
    SEATS_UNFIT = "seats_unfit"


@dataclass(frozen=True, slots=True)
class Reserve:
    reservation: Reservation


@dataclass(frozen=True, slots=True)
class Commit:
    """Every seat is idle: claim this placement like any other. The reservation ends."""

    placement: Placement


@dataclass(frozen=True, slots=True)
class Release:
    cluster_id: str
    reason: ReleaseReason


ReservationAction = Reserve | Commit | Release


def is_reserved(reservation: Reservation | None, worker_id: str, kind: JobKind | str) -> bool:
    """Whether single assignment must not give this worker a new job of this kind."""
    if reservation is None:
        return False
    return any(s.worker_id == worker_id and s.kind == kind for s in reservation.seats)


def hidden_seats(index: PoolIndex, reservation: Reservation | None) -> dict[JobKind, int]:
    """The reserved (worker, kind) pairs as bit sets per kind: no idle capacity for other clusters."""
    hidden = {JobKind.EVAL: 0, JobKind.BUILD: 0}
    if reservation is not None:
        for s in reservation.seats:
            hidden[s.kind] |= index.mask_of((s.worker_id,))
    return hidden


def is_aged(cluster: Cluster, now: datetime, policy: ReservationPolicy | None = None) -> bool:
    policy = policy or ReservationPolicy()
    return (now - cluster.queued_at).total_seconds() >= policy.reserve_after_secs


def can_try(cluster: Cluster, now: datetime, coordinator: CoordinatorPolicy) -> bool:
    """Every member can start, and the cluster is neither backing off nor parked."""
    return (
        all(m.can_start for m in cluster.members)
        and (cluster.retry_at is None or cluster.retry_at <= now)
        and not is_parked(cluster.prepare_failures, coordinator)
    )


Step = tuple[Reservation | None, tuple[ReservationAction, ...]]


def step(
    state: Reservation | None,
    inputs: ReservationInputs,
    now: datetime,
    policy: ReservationPolicy | None = None,
    *,
    index: PoolIndex | None = None,
) -> Step:
    policy = policy or ReservationPolicy()
    index = index or PoolIndex(inputs.pool, now, policy.match)
    if state is None:
        return _reserve(inputs, now, policy, index)
    return _held(state, inputs, now, policy, index)


def _held(
    state: Reservation, inputs: ReservationInputs, now: datetime, policy: ReservationPolicy, index: PoolIndex
) -> Step:
    cluster = next((c for c in inputs.clusters if c.cluster_id == state.cluster_id), None)
    if cluster is None:
        return None, (Release(state.cluster_id, ReleaseReason.LEFT_QUEUE),)
    seat_mask = index.mask_of(s.worker_id for s in state.seats)
    seat_workers = {s.worker_id for s in state.seats}
    if seat_mask.bit_count() < len(seat_workers) or seat_mask & ~index.connected:
        return None, (Release(state.cluster_id, ReleaseReason.SEAT_DISCONNECTED),)
    if now >= state.expires_at:
        return None, (Release(state.cluster_id, ReleaseReason.TIMEOUT),)

    seated = index.mask_of(inputs.seated)
    if not all(index.idle[s.kind] & ~seated & index.mask_of((s.worker_id,)) for s in state.seats):
        return state, ()
    if not can_try(cluster, now, policy.coordinator):
        return state, ()
    available: Mapping[JobKind, int] = {kind: mask & seat_mask & ~seated for kind, mask in index.idle.items()}
    result = index.match(cluster, available=available)
    if isinstance(result, Placement):
        return None, (Commit(result),)
    return None, (Release(state.cluster_id, ReleaseReason.SEATS_UNFIT),)


def _reserve(inputs: ReservationInputs, now: datetime, policy: ReservationPolicy, index: PoolIndex) -> Step:
    if inputs.candidate is None:
        return None, ()
    cluster = next((c for c in inputs.clusters if c.cluster_id == inputs.candidate), None)
    if cluster is None or not is_aged(cluster, now, policy) or not can_try(cluster, now, policy.coordinator):
        return None, ()
    seated = index.mask_of(inputs.seated)
    available = {kind: index.connected for kind in JobKind}
    busy = {kind: index.connected & ~(mask & ~seated) for kind, mask in index.idle.items()}
    result = index.match(cluster, available=available, busy=busy)
    if not isinstance(result, Placement):
        return None, ()
    reservation = Reservation(
        cluster_id=cluster.cluster_id,
        seats=tuple(ReservedSeat(s.role, s.index, s.kind, s.worker_id) for s in result.seats),
        created_at=now,
        expires_at=now + timedelta(seconds=policy.reserve_timeout_secs),
    )
    return reservation, (Reserve(reservation),)
