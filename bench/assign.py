"""Assignment throughput side by side: the same number of jobs, the same number of consumers.

    .venv/bin/python bench/assign.py [--jobs 2000] [--threads 8] [--workers 100] [--skip-service]

1. The bare-SQL claim ceiling: threads running only Gradient's claim statement on distinct jobs.
2. A naive queue: `SELECT ... ORDER BY ... LIMIT 1 FOR UPDATE`, then mark and insert, per job.
   (And the same with SKIP LOCKED, the usual fix, for reference.)
3. Celery on Redis: --jobs no-op tasks (bench/celery_noop.py) enqueued at once and run by a real
   `celery worker` with --threads consumers (prefork, concurrency = threads); enqueue to the last
   completion.
4. Gradient itself: bench/fleet.py's `queued` shape, a real `serve` process and --workers reference
   workers over real WebSockets taking the --jobs builds; assignments per second and the
   RequestJob-to-AssignJob latency.

Needs PostgreSQL (BENCH_DATABASE_URL, default postgres://postgres@127.0.0.1:5432/gradient_bench) and
Redis (REDIS_URL, default redis://127.0.0.1:6379/7).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, describe_machine, log_dir, redis_url, reset_tables, setup_django  # noqa: E402


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

    from gradient.core.jobkey import build_key

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
                    [uuid.uuid4(), build_key(row[0]), row[0], workers[i].id, timezone.now()],
                )
                taken[i] += 1

    elapsed = _run_threads(threads, body)
    assert sum(taken) == jobs
    return jobs / elapsed


def celery_queue(jobs: int, consumers: int) -> tuple[float, float]:
    """--jobs no-op tasks through Redis to a real Celery worker with `consumers` processes. Returns
    (jobs/s from the first enqueue to the last completion, enqueues/s)."""
    import celery_noop

    broker = redis_url()
    env = {**os.environ, "BENCH_CELERY_BROKER": broker, "PYTHONPATH": str(ROOT / "bench")}
    celery_noop.app.control.purge()  # tasks an interrupted run left behind
    log = open(log_dir() / "celery-noop.log", "wb")  # noqa: SIM115 (closed below)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "celery_noop",
            "worker",
            "--concurrency",
            str(consumers),
            "--queues",
            celery_noop.QUEUE,
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--hostname",
            f"bench-noop-{os.getpid()}@%h",
        ],
        cwd=ROOT / "bench",
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    counter = celery_noop.counter()
    try:
        # Warm up: every consumer process started and took a task.
        counter.set(celery_noop.DONE_KEY, 0)
        for i in range(consumers * 4):
            celery_noop.noop.delay(i)
        deadline = time.monotonic() + 120
        while int(counter.get(celery_noop.DONE_KEY) or 0) < consumers * 4:
            if time.monotonic() > deadline or worker.poll() is not None:
                raise RuntimeError("the Celery worker did not start; see var/bench/celery-noop.log")
            time.sleep(0.05)
        counter.set(celery_noop.DONE_KEY, 0)
        started = time.perf_counter()
        for i in range(jobs):
            celery_noop.noop.delay(i)
        enqueued = time.perf_counter() - started
        while int(counter.get(celery_noop.DONE_KEY) or 0) < jobs:
            time.sleep(0.005)
        elapsed = time.perf_counter() - started
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(10)
        log.close()
    return jobs / elapsed, jobs / enqueued


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=8, help="consumers: threads, Celery processes")
    parser.add_argument("--workers", type=int, default=100, help="reference workers for the service")
    parser.add_argument("--skip-service", action="store_true", help="only the SQL and Celery baselines")
    args = parser.parse_args()

    url = setup_django()
    print(f"machine: {describe_machine()}")
    print(f"database: {url}; Redis: {redis_url()}")
    print(f"jobs: {args.jobs}, consumers: {args.threads}")
    print(f"bare-SQL claim ceiling:            {bare_claim_ceiling(args.jobs, args.threads):8.0f} claims/s")
    print(f"naive SELECT ... FOR UPDATE queue: {naive_queue(args.jobs, args.threads, False):8.0f} jobs/s")
    print(f"  same with SKIP LOCKED:           {naive_queue(args.jobs, args.threads, True):8.0f} jobs/s")
    rate, enqueue = celery_queue(args.jobs, args.threads)
    print(f"Celery on Redis, no-op tasks:      {rate:8.0f} jobs/s (enqueue alone {enqueue:.0f}/s)")
    if not args.skip_service:
        from fleet import FleetConfig, run_fleet

        run_fleet(FleetConfig(workers=args.workers, shape="queued", size=args.jobs), url).print()
    os.environ.pop("DATABASE_URL", None)


if __name__ == "__main__":
    main()
