"""Placement pass time of the pure cluster planner: 1 000 waiting clusters over 1 000 idle slots.

Pure (no database): builds one snapshot, then times `plan_pass` (which includes building the pass's
PoolIndex) several times and prints the median and p95, and how many clusters each pass placed.

    .venv/bin/python bench/clusters.py [--clusters 1000] [--slots 1000] [--runs 15] [--seed 6]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gradient.clusters.decisions.planner import plan_pass  # noqa: E402
from gradient.clusters.decisions.types import (  # noqa: E402
    CandidateScore,
    Cluster,
    IdleSlot,
    Member,
    Pool,
    SlotKind,
    Worker,
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
    workers: list[Worker] = []
    for n in range(n_workers):
        arch = rng.choice(SYSTEMS)
        workers.append(
            Worker(
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
    slots: list[IdleSlot] = []
    for w in workers:
        slots.append(IdleSlot(w.worker_id, SlotKind.BUILD, now - timedelta(seconds=rng.uniform(0, 20))))
    for w in rng.sample(workers, n_slots - len(slots)):
        slots.append(IdleSlot(w.worker_id, SlotKind.EVAL, now - timedelta(seconds=rng.uniform(0, 20))))

    clusters: list[Cluster] = []
    scores: list[CandidateScore] = []
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
                scores.append(CandidateScore(w.worker_id, key, rng.randint(0, 8 << 30)))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--slots", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--seed", type=int, default=6)
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


if __name__ == "__main__":
    main()
