"""Seats for one cluster: which worker runs which member, or why there is no full placement.

A worker is a seat for a member when it holds a fresh idle slot of the member's kind (eval or build,
at most `idle_slot_ttl_secs` old), matches the member's pin, and can take the job: capabilities
(architecture contains the build's system unless it is `builtin`, every required feature; an
evaluation member needs an eval-capable worker, and a fetch-capable one when it starts with a fetch,
since member evaluations are never split) and project access.

Members sit one per worker, chosen by min-cost bipartite matching (scipy's linear_sum_assignment) with
cost = the member's missing NAR size on that worker, from the worker's candidate scores. A size the
worker has not reported counts as `unknown_cost`; a worker penalised within `penalty_window_secs`
(it rejected a prepare or let a hold expire) counts as though it missed `penalty_cost` more bytes:
down-ranked, never excluded. Under `same_zone` each zone (workers without a zone form one zone of their
own) is matched alone and the zone with the lowest summed cost among those seating every member wins;
ties go to the zone name, named zones before the unzoned one.

The index keeps every worker set as a Python int used as a bit set (bit i = the i-th worker by id), so
one planning pass over a thousand clusters costs a few set operations per member. The matching
only needs each member's `m` cheapest candidates (m = the cluster's size): in an optimal assignment a
member using a dearer worker could move to one of its m cheapest, at most m - 1 of which are taken by
the others, without raising the cost, so the pruned problem has the same optimum and the same
feasibility.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import numpy as np
from scipy.optimize import linear_sum_assignment

from gradient.clusters.decisions.types import (
    BUILTIN_SYSTEM,
    Cluster,
    Member,
    MemberShortfall,
    Placement,
    Pool,
    Seat,
    SeatShortage,
    WaitingCode,
    WaitingReason,
    WorkerSnapshot,
    ZoneShortfall,
)
from gradient.core.vocab import JobKind

IDLE_SLOT_TTL_SECS = 25.0
UNKNOWN_NAR_COST = 1 << 40
"""A missing size the worker never reported: 1 TiB, larger than any real closure, still finite."""


@dataclass(frozen=True, slots=True)
class MatchPolicy:
    idle_slot_ttl_secs: float = IDLE_SLOT_TTL_SECS
    penalty_window_secs: float = 600.0
    penalty_cost: int = UNKNOWN_NAR_COST
    unknown_cost: int = UNKNOWN_NAR_COST


def has_capabilities(member: Member, worker: WorkerSnapshot) -> bool:
    """The worker can run the member's job, projects aside."""
    if member.kind == JobKind.EVAL:
        return worker.can_eval and (worker.can_fetch or not member.needs_fetch)
    if not worker.can_build:
        return False
    if member.system is not None and member.system != BUILTIN_SYSTEM:
        if member.system not in worker.architectures:
            return False
    return member.required_features <= worker.system_features


def has_project_access(member: Member, worker: WorkerSnapshot) -> bool:
    """The worker is authorized for one of the member's projects (None: for every project)."""
    return worker.projects is None or not worker.projects.isdisjoint(member.projects)


def matches_pin(member: Member, worker: WorkerSnapshot) -> bool:
    return member.pin is None or member.pin == worker.name


def can_seat(member: Member, worker: WorkerSnapshot) -> bool:
    """Everything but the idle slot: pin, capabilities, project access, not draining."""
    return (
        not worker.draining
        and matches_pin(member, worker)
        and has_capabilities(member, worker)
        and has_project_access(member, worker)
    )


def _bits(mask: int) -> Iterator[int]:
    """The set bits of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _first_bits(mask: int, n: int) -> list[int]:
    out: list[int] = []
    while mask and len(out) < n:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _zone_order(zone: str | None) -> tuple[bool, str]:
    return (zone is None, zone or "")


_CapabilityKey = tuple[JobKind, str | None, frozenset[str], bool]


class PoolIndex:
    """One pass's view of a Pool: bit sets of workers by idle kind, zone, capability and penalty.

    Pure: built from the pool, `now` and the policy, and never changed afterwards except for its
    memo tables (capability and project sets computed on first use).
    """

    def __init__(self, pool: Pool, now: datetime, policy: MatchPolicy | None = None) -> None:
        self.pool = pool
        self.now = now
        self.policy = policy or MatchPolicy()
        self.ids: list[str] = sorted(pool.workers)
        self.workers: list[WorkerSnapshot] = [pool.workers[i] for i in self.ids]
        self.position: dict[str, int] = {wid: n for n, wid in enumerate(self.ids)}
        self._by_name: dict[str, int] = {w.name: n for n, w in enumerate(self.workers)}

        self.connected = 0
        zones: dict[str | None, int] = {}
        for n, w in enumerate(self.workers):
            if not w.draining:
                self.connected |= 1 << n
                zones[w.zone_key] = zones.get(w.zone_key, 0) | 1 << n
        self.zones: dict[str | None, int] = dict(sorted(zones.items(), key=lambda kv: _zone_order(kv[0])))

        self.idle: dict[JobKind, int] = {JobKind.EVAL: 0, JobKind.BUILD: 0}
        ttl = self.policy.idle_slot_ttl_secs
        for slot in pool.idle_slots:
            n_ = self.position.get(slot.worker_id)
            if n_ is not None and (now - slot.recorded_at).total_seconds() <= ttl:
                self.idle[slot.kind] |= 1 << n_
        for kind in self.idle:
            self.idle[kind] &= self.connected

        self.penalised = 0
        window = self.policy.penalty_window_secs
        for wid, at in pool.penalties.items():
            n_ = self.position.get(wid)
            if n_ is not None and (now - at).total_seconds() <= window:
                self.penalised |= 1 << n_

        self._scores: dict[str, tuple[int, dict[int, int]]] = {}
        self._capable: dict[_CapabilityKey, int] = {}
        self._access: dict[frozenset[str], int] = {}
        self._all_access = self.connected & self._mask(
            n for n, w in enumerate(self.workers) if w.projects is None
        )

    @staticmethod
    def _mask(positions: Iterable[int]) -> int:
        mask = 0
        for n in positions:
            mask |= 1 << n
        return mask

    def mask_of(self, worker_ids: Iterable[str]) -> int:
        """The bit set of these workers (unknown ids are ignored)."""
        return self._mask(self.position[w] for w in worker_ids if w in self.position)

    def ids_of(self, mask: int) -> list[str]:
        return [self.ids[n] for n in _bits(mask)]

    def capable(self, member: Member) -> int:
        key: _CapabilityKey = (member.kind, member.system, member.required_features, member.needs_fetch)
        mask = self._capable.get(key)
        if mask is None:
            mask = self.connected & self._mask(
                n for n, w in enumerate(self.workers) if has_capabilities(member, w)
            )
            self._capable[key] = mask
        return mask

    def access(self, member: Member) -> int:
        mask = self._access.get(member.projects)
        if mask is None:
            mask = self._all_access | self._mask(
                n
                for n, w in enumerate(self.workers)
                if w.projects is not None and not w.projects.isdisjoint(member.projects)
            )
            mask &= self.connected
            self._access[member.projects] = mask
        return mask

    def pin(self, member: Member) -> int:
        """All workers for an unpinned member, the pinned worker's bit (or nothing) otherwise."""
        if member.pin is None:
            return self.connected
        n = self._by_name.get(member.pin)
        return 0 if n is None else (1 << n) & self.connected

    def fits(self, member: Member) -> int:
        """Workers that could seat the member, idle or not: pin, capabilities, project access."""
        return self.pin(member) & self.capable(member) & self.access(member)

    def scores(self, job_key: str) -> tuple[int, dict[int, int]]:
        """The workers that scored this job (a bit set) and their missing NAR sizes by position."""
        known = self._scores.get(job_key)
        if known is None:
            cap = self.policy.unknown_cost
            mask = 0
            sizes: dict[int, int] = {}
            for wid, size in self.pool.scores.get(job_key, {}).items():
                n = self.position.get(wid)
                if n is not None:
                    # A known size never ranks worse than an unknown one.
                    sizes[n] = min(max(int(size), 0), cap)
                    mask |= 1 << n
            known = self._scores[job_key] = (mask, sizes)
        return known

    def seat_cost(self, member: Member, n: int) -> int:
        cost = self.scores(member.job_key)[1].get(n, self.policy.unknown_cost)
        if self.penalised >> n & 1:
            cost += self.policy.penalty_cost
        return cost

    def match(
        self,
        cluster: Cluster,
        *,
        available: Mapping[JobKind, int],
        busy: Mapping[JobKind, int] | None = None,
    ) -> Placement | WaitingReason:
        """Seat every member of `cluster` on its own worker among `available[kind]`, or explain why not.

        `busy` (reservation planning only) marks available workers that are not idle for that kind;
        they cost more than any idle seat could, so idle workers are seated first wherever a full
        match allows.
        """
        members = sorted(cluster.members, key=lambda m: (m.role, m.index))
        if not members:
            return WaitingReason(WaitingCode.NO_MEMBERS)
        candidates = [available.get(m.kind, 0) & self.fits(m) for m in members]
        busy_cost = 0
        if busy:
            per_seat = self.policy.unknown_cost + self.policy.penalty_cost
            busy_cost = (len(members) + 1) * (per_seat + 1)
        groups = self.zones.items() if cluster.same_zone else [(None, self.connected)]

        best: tuple[int, tuple[bool, str], Placement] | None = None
        for zone, zone_mask in groups:
            in_zone = [c & zone_mask for c in candidates]
            solved = self._solve(members, in_zone, busy, busy_cost)
            if solved is None:
                continue
            cost, chosen = solved
            key = (cost, _zone_order(zone) if cluster.same_zone else (False, ""))
            if best is None or key < best[:2]:
                seats = tuple(self._seat(m, n) for m, n in zip(members, chosen, strict=True))
                placement = Placement(cluster.cluster_id, seats, cost, zone if cluster.same_zone else None)
                best = (key[0], key[1], placement)
        if best is not None:
            return best[2]
        return self.explain(cluster, available=available)

    def _seat(self, member: Member, n: int) -> Seat:
        w = self.workers[n]
        return Seat(
            member.role, member.index, member.job_key, member.kind, w.worker_id, w.zone_key, w.endpoint
        )

    def _solve(
        self,
        members: Sequence[Member],
        candidates: Sequence[int],
        busy: Mapping[JobKind, int] | None,
        busy_cost: int,
    ) -> tuple[int, list[int]] | None:
        m = len(members)
        union = 0
        for c in candidates:
            if not c:
                return None
            union |= c
        if union.bit_count() < m:
            return None

        options: list[list[tuple[int, int]]] = []
        for member, c in zip(members, candidates, strict=True):
            busy_mask = busy.get(member.kind, 0) if busy else 0
            scored_mask, scored = self.scores(member.job_key)
            unscored = c & ~scored_mask
            found: list[tuple[int, int]] = []
            for n in _bits(c & scored_mask):
                found.append((scored[n] + self._extra(n, busy_mask, busy_cost), n))
            # Unscored workers differ only by penalty and busyness: the lowest ids of each class.
            for pen in (False, True):
                pen_mask = self.penalised if pen else ~self.penalised
                for is_busy in (False, True) if busy_mask else (False,):
                    busy_sel = busy_mask if is_busy else ~busy_mask
                    for n in _first_bits(unscored & pen_mask & busy_sel, m):
                        found.append((self.policy.unknown_cost + self._extra(n, busy_mask, busy_cost), n))
            options.append(heapq.nsmallest(m, found))

        columns = sorted({n for opts in options for _, n in opts})
        if len(columns) < m:
            return None
        col = {n: j for j, n in enumerate(columns)}
        matrix = np.full((m, len(columns)), np.inf)
        for row, opts in enumerate(options):
            for cost, n in opts:
                matrix[row, col[n]] = float(cost)
        try:
            rows, cols = linear_sum_assignment(matrix)
        except ValueError:  # "cost matrix is infeasible": no full matching
            return None
        if len(rows) < m:
            return None
        chosen = [0] * m
        for r, c_ in zip(rows.tolist(), cols.tolist(), strict=True):
            chosen[r] = columns[c_]
        total = 0
        for row, n in enumerate(chosen):
            total += next(cost for cost, k in options[row] if k == n)
        return total, chosen

    def _extra(self, n: int, busy_mask: int, busy_cost: int) -> int:
        extra = self.policy.penalty_cost if self.penalised >> n & 1 else 0
        if busy_mask >> n & 1:
            extra += busy_cost
        return extra

    def shortage(self, member: Member, available: int, within: int | None = None) -> SeatShortage:
        """Why `member` has no seat among `available` (restricted to `within`, a zone): the first
        missing requirement, in order idle slot (or the pinned worker's), capability, project."""
        idle = available if within is None else available & within
        if member.pin is not None:
            pinned = self.pin(member)
            if not idle & pinned:
                return SeatShortage.PIN_NOT_IDLE
            return (
                SeatShortage.NO_CAPABLE_WORKER
                if not pinned & self.capable(member)
                else SeatShortage.NO_PROJECT_ACCESS
            )
        if not idle:
            return SeatShortage.NO_IDLE_SLOT
        if not idle & self.capable(member):
            return SeatShortage.NO_CAPABLE_WORKER
        return SeatShortage.NO_PROJECT_ACCESS

    def explain(self, cluster: Cluster, *, available: Mapping[JobKind, int]) -> WaitingReason:
        """Why `cluster` has no full placement among `available`."""
        members = sorted(cluster.members, key=lambda m: (m.role, m.index))
        if not members:
            return WaitingReason(WaitingCode.NO_MEMBERS)
        candidates = [available.get(m.kind, 0) & self.fits(m) for m in members]
        missing = tuple(
            MemberShortfall(m.address, self.shortage(m, available.get(m.kind, 0)), m.pin)
            for m, c in zip(members, candidates, strict=True)
            if not c
        )
        if missing:
            return WaitingReason(WaitingCode.NO_SEAT, members=missing)
        union = 0
        for c in candidates:
            union |= c
        if not cluster.same_zone:
            return WaitingReason(
                WaitingCode.TOO_FEW_WORKERS, seatable_workers=union.bit_count(), needed=len(members)
            )
        kinds_idle = 0
        for m in members:
            kinds_idle |= available.get(m.kind, 0)
        zones: list[ZoneShortfall] = []
        for zone, zone_mask in self.zones.items():
            if not kinds_idle & zone_mask:
                continue
            unseated = tuple(
                MemberShortfall(m.address, self.shortage(m, available.get(m.kind, 0), zone_mask), m.pin)
                for m, c in zip(members, candidates, strict=True)
                if not c & zone_mask
            )
            zones.append(ZoneShortfall(zone, unseated, (union & zone_mask).bit_count(), len(members)))
        return WaitingReason(
            WaitingCode.NO_ZONE_FITS,
            zones=tuple(zones),
            seatable_workers=union.bit_count(),
            needed=len(members),
        )


def idle_available(
    index: PoolIndex, *, taken: int = 0, hidden: Mapping[JobKind, int] | None = None
) -> dict[JobKind, int]:
    """Idle workers per kind, minus workers already seated (`taken`) and seats hidden per kind."""
    hidden = hidden or {}
    return {kind: mask & ~taken & ~hidden.get(kind, 0) for kind, mask in index.idle.items()}


def match_cluster(
    cluster: Cluster,
    pool: Pool,
    now: datetime,
    policy: MatchPolicy | None = None,
    *,
    exclude: Iterable[str] = (),
) -> Placement | WaitingReason:
    """Seat one cluster on the pool's idle workers (except `exclude`), or say why it cannot sit."""
    index = PoolIndex(pool, now, policy)
    return index.match(cluster, available=idle_available(index, taken=index.mask_of(exclude)))
