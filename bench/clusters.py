"""Cluster placement at 1 000 waiting clusters over 1 000 idle slots: the pure planner, then the real
cluster-dispatch pass on PostgreSQL.

    .venv/bin/python bench/clusters.py [--clusters 1000] [--slots 1000] [--runs 15] [--db-runs 5]
                                       [--seed 6] [--pure-only]

1. Pure (no database): builds one snapshot, then times `plan_pass` (which includes building the pass's
   PoolIndex) --runs times and prints the median and p95, and how many clusters each pass placed.
2. The database pass: the same snapshot written to the benchmark database (projects, workers with open
   sessions and idle slots, Queued builds and evaluations, the clusters through `cluster_create` with
   their records, the workers' candidate scores), then `cluster_dispatch_pass` --db-runs times, each in a
   transaction rolled back afterwards so every run starts from the same state: load the book and the
   pool, plan, claim every placement (attempts, seats, member assignments, records), reservations,
   waiting reasons. Needs PostgreSQL (BENCH_DATABASE_URL, default .../gradient_bench).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gradient.clusters.decisions.planner import plan_pass  # noqa: E402
from gradient.clusters.decisions.types import (  # noqa: E402
    Cluster,
    Member,
    Pool,
    ScoreSnapshot,
    SlotKind,
    SlotSnapshot,
    WorkerSnapshot,
)

ZONES = ("zone-a", "zone-b", "zone-c", "zone-d", None)
SYSTEMS = ("x86_64-linux", "x86_64-linux", "x86_64-linux", "aarch64-linux")
FEATURES = (frozenset(), frozenset(), frozenset({"kvm"}), frozenset({"big-parallel"}))
PROJECTS = tuple(f"project-{n}" for n in range(8))


def build_snapshot(
    n_clusters: int, n_slots: int, rng: random.Random, now: datetime
) -> tuple[list[Cluster], Pool]:
    # About one worker in four idles for both kinds, so n_slots slots sit on ~0.8 * n_slots workers.
    n_workers = max(1, int(n_slots / 1.25))
    workers: list[WorkerSnapshot] = []
    for n in range(n_workers):
        arch = rng.choice(SYSTEMS)
        workers.append(
            WorkerSnapshot(
                worker_id=f"w{n:05d}",
                name=f"worker-{n}",
                zone=rng.choice(ZONES),
                can_fetch=True,
                can_eval=rng.random() < 0.6,
                can_build=True,
                architectures=frozenset({arch, "i686-linux"} if arch == "x86_64-linux" else {arch}),
                system_features=frozenset({"kvm", "big-parallel"}) if rng.random() < 0.5 else frozenset(),
                projects=None if rng.random() < 0.7 else frozenset(rng.sample(PROJECTS, 3)),
            )
        )
    slots: list[SlotSnapshot] = []
    for w in workers:
        slots.append(SlotSnapshot(w.worker_id, SlotKind.BUILD, now - timedelta(seconds=rng.uniform(0, 20))))
    for w in rng.sample(workers, n_slots - len(slots)):
        slots.append(SlotSnapshot(w.worker_id, SlotKind.EVAL, now - timedelta(seconds=rng.uniform(0, 20))))

    clusters: list[Cluster] = []
    scores: list[ScoreSnapshot] = []
    for c in range(n_clusters):
        size = rng.randint(2, 4)
        members: list[Member] = []
        for i in range(size):
            kind = SlotKind.EVAL if rng.random() < 0.25 else SlotKind.BUILD
            key = f"{kind.value}:{c}-{i}"
            pin = f"worker-{rng.randrange(n_workers)}" if rng.random() < 0.05 else None
            members.append(
                Member(
                    role="server" if i == 0 else "client",
                    index=i,
                    job_key=key,
                    kind=kind,
                    primary=i == 0,
                    pin=pin,
                    system=rng.choice(SYSTEMS) if kind is SlotKind.BUILD else None,
                    required_features=rng.choice(FEATURES) if kind is SlotKind.BUILD else frozenset(),
                    needs_fetch=kind is SlotKind.EVAL,
                    projects=frozenset({rng.choice(PROJECTS)}),
                )
            )
            # Each member was offered to, and scored by, a few dozen workers.
            for w in rng.sample(workers, min(30, n_workers)):
                scores.append(ScoreSnapshot(w.worker_id, key, rng.randint(0, 8 << 30)))
        clusters.append(
            Cluster(
                cluster_id=f"c{c:05d}",
                members=tuple(members),
                queued_at=now - timedelta(seconds=rng.uniform(0, 3600)),
                same_zone=rng.random() < 0.3,
                priority=rng.random() < 0.1,
            )
        )
    return clusters, Pool.of(workers=workers, idle_slots=slots, scores=scores)


class _Rollback(Exception):
    pass


def seed_database(clusters: list[Cluster], pool: Pool, now: datetime) -> None:
    """Write the snapshot: one row per worker, session, idle slot, member job, cluster and score."""
    from django.utils import timezone

    from gradient.clusters.services.lifecycle import MemberSpec, cluster_create
    from gradient.runtime.passes import server_boot_start
    from gradient.scheduling.history import evaluation_record_create
    from gradient.scheduling.models import (
        CandidateScore,
        DerivationBuild,
        Evaluation,
        EvaluationBuild,
        EvaluationStatus,
        Project,
    )
    from gradient.workers.models import IdleSlot, WorkerSession
    from gradient.workers.models import Worker as WorkerRow

    projects = {name: Project.objects.create(name=name) for name in PROJECTS}
    real_now = timezone.now()
    shift = real_now - now
    boot = server_boot_start(now=real_now)
    rows = WorkerRow.objects.bulk_create(
        [
            WorkerRow(
                name=w.name,
                token_hash="-",
                zone=w.zone,
                can_fetch=w.can_fetch,
                can_eval=w.can_eval,
                can_build=w.can_build,
                architectures=sorted(w.architectures),
                system_features=sorted(w.system_features),
                max_concurrent_builds=1,
            )
            for w in pool.workers.values()
        ]
    )
    ids = {w.worker_id: row.id for w, row in zip(pool.workers.values(), rows, strict=True)}
    through = WorkerRow.projects.through
    through.objects.bulk_create(
        [
            through(worker_id=ids[w.worker_id], project_id=projects[name].id)
            for w in pool.workers.values()
            for name in (w.projects if w.projects is not None else PROJECTS)
        ]
    )
    WorkerSession.objects.bulk_create(
        [
            WorkerSession(
                worker_id=i, channel_name="bench", server_boot=boot.id, opened_at=real_now, last_seen=real_now
            )
            for i in ids.values()
        ]
    )
    IdleSlot.objects.bulk_create(
        [
            IdleSlot(worker_id=ids[s.worker_id], kind=s.kind.value, recorded_at=s.recorded_at + shift)
            for s in pool.idle_slots
        ]
    )
    needing = {
        name: Evaluation.objects.create(
            project=p, repository="sim:c", commit="c", status=EvaluationStatus.BUILDING
        )
        for name, p in projects.items()
    }
    keys: dict[str, str] = {}
    for cluster in clusters:
        specs = []
        for m in cluster.members:
            (project,) = m.projects
            if m.kind is SlotKind.EVAL:
                job = Evaluation.objects.create(
                    project=projects[project], repository=f"sim:{m.job_key}", commit="c"
                )
                # With its record, as a submitted evaluation has (evaluations.evaluation_create): made
                # without, each claimed member's first fact made it one, in the pass.
                evaluation_record_create(evaluation=job, created_by=None, idempotency_key=None, now=real_now)
                specs.append(MemberSpec(role=m.role, evaluation_id=job.id, primary=m.primary, pin=m.pin))
            else:
                build = DerivationBuild.objects.create(
                    drv_path=f"/nix/store/{m.job_key.replace(':', '-')}.drv",
                    system=m.system or "x86_64-linux",
                    required_features=sorted(m.required_features),
                    status="Queued",
                    queued_at=cluster.queued_at + shift,
                )
                EvaluationBuild.objects.create(evaluation=needing[project], build=build)
                specs.append(MemberSpec(role=m.role, build_id=build.id, primary=m.primary, pin=m.pin))
                job = build
            keys[m.job_key] = job.job_key
        cluster_create(members=specs, same_zone=cluster.same_zone, priority=cluster.priority, now=real_now)
    CandidateScore.objects.bulk_create(
        [
            CandidateScore(
                worker_id=ids[worker_id],
                job_id=keys[key],
                missing_count=1,
                missing_nar_size=size,
                updated_at=real_now,
            )
            for key, per_worker in pool.scores.items()
            for worker_id, size in per_worker.items()
        ],
        batch_size=5000,
    )
    # Seeding takes a while: age the idle slots from now, as in the snapshot, so none has gone stale.
    age_idle_slots_from(real_now)


def age_idle_slots_from(then: datetime) -> datetime:
    """Move every idle slot forward by the time since `then`; returns now."""
    from django.db.models import F
    from django.utils import timezone

    from gradient.workers.models import IdleSlot

    now = timezone.now()
    IdleSlot.objects.update(recorded_at=F("recorded_at") + (now - then))
    return now


def count_statements() -> Callable[[], int]:
    """Count the statements sent through psycopg from now on (every cursor's execute: Django's, the
    fixed-text statements' and savepoints); returns the reader. The pass's runs only: call just before."""
    import psycopg

    count = 0
    execute = psycopg.Cursor.execute

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal count
        count += 1
        return execute(self, *args, **kwargs)

    psycopg.Cursor.execute = counted  # type: ignore[method-assign]
    return lambda: count


def database_pass(clusters: list[Cluster], pool: Pool, now: datetime, runs: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import describe_machine, reset_tables, setup_django

    url = setup_django()
    from django.db import transaction
    from django.utils import timezone

    from gradient.clusters.services.dispatch import cluster_dispatch_pass

    reset_tables()
    started = time.perf_counter()
    seed_database(clusters, pool, now)
    seeded_at = timezone.now()
    print(f"database pass: {url} ({describe_machine()})")
    print(f"  seeded in {time.perf_counter() - started:.1f} s")
    timings: list[float] = []
    result = None
    statements = count_statements()
    per_pass: list[int] = []
    for _ in range(runs):
        try:
            with transaction.atomic():
                age_idle_slots_from(seeded_at)  # each run sees the slots as fresh as the first did
                sent = statements()
                start = time.perf_counter()
                result = cluster_dispatch_pass(now=timezone.now())
                timings.append(time.perf_counter() - start)
                per_pass.append(statements() - sent)
                raise _Rollback
        except _Rollback:
            pass
    timings.sort()
    p95 = timings[min(len(timings) - 1, round(0.95 * (len(timings) - 1)))]
    median = statistics.median(timings) * 1000
    print(
        f"  cluster-dispatch pass ({runs} runs, rolled back): median {median:.1f} ms, p95 {p95 * 1000:.1f} ms"
    )
    print(f"  statements a pass: {statistics.median(per_pass):.0f} (savepoints included)")
    if result is not None:
        print(
            f"  clusters: {result.clusters}; placed and claimed: {result.placed} "
            f"(claims lost {result.claims_lost}); reserved {result.reserved}; waiting: {result.waiting} "
            f"({result.reasons_written} reasons written)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--slots", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--seed", type=int, default=6)
    parser.add_argument("--db-runs", type=int, default=5)
    parser.add_argument("--pure-only", action="store_true", help="skip the database pass")
    args = parser.parse_args()

    now = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
    rng = random.Random(args.seed)
    clusters, pool = build_snapshot(args.clusters, args.slots, rng, now)
    members = sum(len(c.members) for c in clusters)

    timings: list[float] = []
    placed = seated = 0
    for _ in range(args.runs):
        start = time.perf_counter()
        result = plan_pass(clusters, pool, now)
        timings.append(time.perf_counter() - start)
        placed = len(result.placements)
        seated = sum(len(p.seats) for p in result.placements)

    timings.sort()
    p95 = timings[min(len(timings) - 1, round(0.95 * (len(timings) - 1)))]
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}")
    print(
        f"snapshot: {len(clusters)} waiting clusters ({members} members), {len(pool.idle_slots)} idle slots "
        f"on {len(pool.workers)} workers, {sum(len(v) for v in pool.scores.values())} candidate scores"
    )
    print(f"runs: {args.runs}")
    print(f"placement pass: median {statistics.median(timings) * 1000:.1f} ms, p95 {p95 * 1000:.1f} ms")
    print(f"clusters placed: {placed} ({seated} seats); waiting: {len(clusters) - placed}")
    if not args.pure_only:
        database_pass(clusters, pool, now, args.db_runs)


if __name__ == "__main__":
    main()
