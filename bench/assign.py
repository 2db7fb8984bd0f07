"""Assignment throughput and latency, beside two baselines on the same database.

    .venv/bin/python bench/assign.py [--jobs 2000] [--threads 8] [--workers 100]

1. The bare-SQL claim ceiling: threads running only Gradient's claim statement on distinct jobs.
2. A naive queue: `SELECT ... ORDER BY ... LIMIT 1 FOR UPDATE`, then mark and insert, per job.
   (And the same with SKIP LOCKED, the usual fix, for reference.)
3. Gradient itself: a real `serve` process, N simulated workers over real WebSockets sending RequestJob,
   scored and claimed by the service; prints assignments per second and RequestJob-to-AssignJob latency.

Needs PostgreSQL (BENCH_DATABASE_URL, default postgres://postgres@127.0.0.1:5432/gradient_bench).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import describe_machine, reset_tables, setup_django  # noqa: E402


def _make_builds(n: int) -> list:  # type: ignore[type-arg]
    from django.utils import timezone

    from gradient.scheduling.models import DerivationBuild

    now = timezone.now()
    return DerivationBuild.objects.bulk_create(
        [
            DerivationBuild(
                drv_path=f"/nix/store/{i:032d}-bench.drv",
                system="x86_64-linux",
                status="Queued",
                queued_at=now,
            )
            for i in range(n)
        ]
    )


def _make_workers(n: int) -> list:  # type: ignore[type-arg]
    from gradient.workers.models import Worker

    return Worker.objects.bulk_create(
        [Worker(name=f"bench-{i}", token_hash="-", architectures=["x86_64-linux"]) for i in range(n)]
    )


def _run_threads(threads: int, body) -> float:  # type: ignore[no-untyped-def]
    from django.db import connection

    barrier = threading.Barrier(threads + 1)

    def run(i: int) -> None:
        try:
            barrier.wait()
            body(i)
        finally:
            connection.close()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - started


def bare_claim_ceiling(jobs: int, threads: int) -> float:
    from django.db import transaction
    from django.utils import timezone

    from gradient.scheduling.models import JobKind
    from gradient.scheduling.services.claims import ClaimRequest, claim_assignment

    reset_tables()
    builds = _make_builds(jobs)
    workers = _make_workers(threads)
    won = [0] * threads

    def body(i: int) -> None:
        for build in builds[i::threads]:
            request = ClaimRequest(
                kind=JobKind.BUILD, job_key=build.job_key, worker_id=workers[i].id, build_id=build.id
            )
            with transaction.atomic():
                if claim_assignment(request=request, now=timezone.now()) is not None:
                    won[i] += 1

    elapsed = _run_threads(threads, body)
    assert sum(won) == jobs
    return jobs / elapsed


def naive_queue(jobs: int, threads: int, skip_locked: bool) -> float:
    from django.db import connection, transaction
    from django.utils import timezone

    reset_tables()
    _make_builds(jobs)
    workers = _make_workers(threads)
    lock = "FOR UPDATE SKIP LOCKED" if skip_locked else "FOR UPDATE"
    taken = [0] * threads

    def body(i: int) -> None:
        while True:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(
                    "SELECT id FROM derivation_build WHERE status = 'Queued' "  # noqa: S608 (fixed text)
                    f"ORDER BY queued_at, id LIMIT 1 {lock}"
                )
                row = cursor.fetchone()
                if row is None:
                    return
                cursor.execute("UPDATE derivation_build SET status = 'Building' WHERE id = %s", [row[0]])
                cursor.execute(
                    "INSERT INTO dispatched_job (id, kind, job_id, derivation_build_id, worker_id, score, "
                    "score_breakdown, job, phase, dispatched_at, reason) "
                    "VALUES (%s, 'build', %s, %s, %s, 0, '{}', '{}', '', %s, '')",
                    [uuid.uuid4(), f"build:{row[0]}", row[0], workers[i].id, timezone.now()],
                )
                taken[i] += 1

    elapsed = _run_threads(threads, body)
    assert sum(taken) == jobs
    return jobs / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--workers", type=int, default=100, help="simulated WebSocket workers")
    parser.add_argument("--skip-service", action="store_true", help="only the SQL baselines")
    args = parser.parse_args()

    url = setup_django()
    print(f"machine: {describe_machine()}")
    print(f"database: {url}")
    print(f"jobs: {args.jobs}, threads: {args.threads}")
    print(f"bare-SQL claim ceiling:            {bare_claim_ceiling(args.jobs, args.threads):8.0f} claims/s")
    print(f"naive SELECT ... FOR UPDATE queue: {naive_queue(args.jobs, args.threads, False):8.0f} jobs/s")
    print(f"  same with SKIP LOCKED:           {naive_queue(args.jobs, args.threads, True):8.0f} jobs/s")
    if not args.skip_service:
        from service_load import run_service_load

        run_service_load(database_url=url, workers=args.workers, jobs=args.jobs)
    os.environ.pop("DATABASE_URL", None)


if __name__ == "__main__":
    main()
