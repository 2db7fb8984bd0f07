"""One placement pass over every cluster able to start.

Clusters are taken prioritized first, then the oldest (`queued_at`, then the id, so every server
orders them the same). Each gets the matcher's placement over the idle workers that are left: a worker
seated for one cluster is not offered to the next, and the seats of the reservation in force are
offered to nobody else (the reserved cluster itself commits through the reservation step, not here).
Clusters that cannot be tried (a member that can no longer start, backing off after a failed
prepare, parked past the prepare-failure cap) are skipped with their reason. A cluster without a full
placement keeps waiting, and says why.

Without a reservation in force, the result also names the cluster that should reserve: the first
unplaced cluster, in placement order, that has waited past `reserve_after_secs` and can be tried.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from gradient.clusters.decisions.coordinator import CoordinatorPolicy, is_parked
from gradient.clusters.decisions.matcher import MatchPolicy, PoolIndex, idle_available
from gradient.clusters.decisions.reservation import RESERVE_AFTER_SECS, hidden_seats
from gradient.clusters.decisions.types import (
    Cluster,
    Placement,
    Pool,
    Reservation,
    WaitingCode,
    WaitingReason,
)


@dataclass(frozen=True, slots=True)
class PlannerPolicy:
    match: MatchPolicy = MatchPolicy()
    coordinator: CoordinatorPolicy = CoordinatorPolicy()
    reserve_after_secs: float = RESERVE_AFTER_SECS


@dataclass(frozen=True, slots=True)
class PlanResult:
    placements: tuple[Placement, ...]
    waiting: Mapping[str, WaitingReason] = field(default_factory=dict)
    reserve: str | None = None


def placement_order(clusters: Iterable[Cluster]) -> list[Cluster]:
    """Prioritized clusters first, then the oldest; the id breaks ties."""
    return sorted(clusters, key=lambda c: (not c.priority, c.queued_at, c.cluster_id))


def plan_pass(
    clusters: Iterable[Cluster],
    pool: Pool,
    now: datetime,
    *,
    reservation: Reservation | None = None,
    policy: PlannerPolicy | None = None,
    index: PoolIndex | None = None,
) -> PlanResult:
    policy = policy or PlannerPolicy()
    index = index or PoolIndex(pool, now, policy.match)
    hidden = hidden_seats(index, reservation)
    taken = 0
    placements: list[Placement] = []
    waiting: dict[str, WaitingReason] = {}
    reserve: str | None = None

    for cluster in placement_order(clusters):
        cid = cluster.cluster_id
        if reservation is not None and cid == reservation.cluster_id:
            seats = index.mask_of(s.worker_id for s in reservation.seats)
            idle_seats = sum(
                1 for s in reservation.seats if index.idle[s.kind] & ~taken & index.mask_of((s.worker_id,))
            )
            waiting[cid] = WaitingReason(
                WaitingCode.RESERVED, seatable_workers=idle_seats, needed=seats.bit_count()
            )
            continue
        blocked = tuple(
            m.address for m in sorted(cluster.members, key=lambda m: (m.role, m.index)) if not m.can_start
        )
        if blocked:
            waiting[cid] = WaitingReason(WaitingCode.MEMBER_CANNOT_START, blocked=blocked)
            continue
        if is_parked(cluster.prepare_failures, policy.coordinator):
            waiting[cid] = WaitingReason(WaitingCode.PARKED, prepare_failures=cluster.prepare_failures)
            continue
        if cluster.retry_at is not None and cluster.retry_at > now:
            waiting[cid] = WaitingReason(
                WaitingCode.BACKOFF, until=cluster.retry_at, prepare_failures=cluster.prepare_failures
            )
            continue

        result = index.match(cluster, available=idle_available(index, taken=taken, hidden=hidden))
        if isinstance(result, Placement):
            placements.append(result)
            taken |= index.mask_of(result.worker_ids)
            continue
        waiting[cid] = result
        if (
            reservation is None
            and reserve is None
            and (now - cluster.queued_at).total_seconds() >= policy.reserve_after_secs
        ):
            reserve = cid

    return PlanResult(tuple(placements), waiting, reserve)
