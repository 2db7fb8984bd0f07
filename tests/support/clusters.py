"""Builders for the pure cluster decision tests: short, readable snapshots without a database."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from gradient.clusters.decisions.types import (
    Cluster,
    Member,
    Penalty,
    Pool,
    ScoreSnapshot,
    SlotKind,
    SlotSnapshot,
    WorkerSnapshot,
)

NOW = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
X86 = "x86_64-linux"


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def later(seconds: float) -> datetime:
    return NOW + timedelta(seconds=seconds)


def worker(
    wid: str,
    *,
    zone: str | None = None,
    eval: bool = True,
    fetch: bool = True,
    build: bool = True,
    archs: Iterable[str] = (X86,),
    features: Iterable[str] = (),
    projects: Iterable[str] | None = None,
    draining: bool = False,
    endpoint: str | None = None,
) -> WorkerSnapshot:
    """A worker whose name is its id, capable of everything on x86_64-linux unless told otherwise."""
    return WorkerSnapshot(
        worker_id=wid,
        name=wid,
        zone=zone,
        can_fetch=fetch,
        can_eval=eval,
        can_build=build,
        architectures=frozenset(archs),
        system_features=frozenset(features),
        projects=None if projects is None else frozenset(projects),
        endpoint=endpoint,
        draining=draining,
    )


def build(
    role: str,
    index: int = 0,
    *,
    key: str | None = None,
    primary: bool = False,
    pin: str | None = None,
    system: str = X86,
    features: Iterable[str] = (),
    projects: Iterable[str] = ("p",),
    can_start: bool = True,
) -> Member:
    return Member(
        role=role,
        index=index,
        job_key=key or f"build:{role}-{index}",
        kind=SlotKind.BUILD,
        primary=primary,
        pin=pin,
        system=system,
        required_features=frozenset(features),
        projects=frozenset(projects),
        can_start=can_start,
    )


def evaluation(
    role: str,
    index: int = 0,
    *,
    key: str | None = None,
    primary: bool = False,
    pin: str | None = None,
    needs_fetch: bool = False,
    projects: Iterable[str] = ("p",),
) -> Member:
    return Member(
        role=role,
        index=index,
        job_key=key or f"eval:{role}-{index}",
        kind=SlotKind.EVAL,
        primary=primary,
        pin=pin,
        needs_fetch=needs_fetch,
        projects=frozenset(projects),
    )


def cluster(
    cid: str,
    *members: Member,
    age: float = 60.0,
    same_zone: bool = False,
    priority: bool = False,
    retry_at: datetime | None = None,
    prepare_failures: int = 0,
) -> Cluster:
    return Cluster(
        cluster_id=cid,
        members=tuple(members),
        queued_at=ago(age),
        same_zone=same_zone,
        priority=priority,
        retry_at=retry_at,
        prepare_failures=prepare_failures,
    )


def idle(wid: str, kind: SlotKind = SlotKind.BUILD, *, age: float = 1.0) -> SlotSnapshot:
    return SlotSnapshot(wid, kind, ago(age))


def pool(
    workers: Iterable[WorkerSnapshot],
    *,
    idle_build: Iterable[str] | None = None,
    idle_eval: Iterable[str] = (),
    slots: Iterable[SlotSnapshot] = (),
    scores: dict[tuple[str, str], int] | None = None,
    penalties: dict[str, datetime] | None = None,
) -> Pool:
    """A pool; without `idle_build`, every worker holds a fresh build slot."""
    ws = list(workers)
    build_ids = [w.worker_id for w in ws] if idle_build is None else list(idle_build)
    all_slots = [idle(w) for w in build_ids] + [idle(w, SlotKind.EVAL) for w in idle_eval] + list(slots)
    return Pool.of(
        workers=ws,
        idle_slots=all_slots,
        scores=[ScoreSnapshot(w, k, size) for (w, k), size in (scores or {}).items()],
        penalties=[Penalty(w, at) for w, at in (penalties or {}).items()],
    )
