"""Queue depth: the assignment pass and RequestJob at 1 000 and at 100 000 pending builds.

    .venv/bin/python bench/queue_depth.py [--depths 1000 100000] [--workers 10] [--requests 20]

For each depth: one evaluation, Building, with that many Queued shared builds (bulk inserted), and
--workers connected build workers (open sessions; their pushes go to the in-memory channel layer, where
nobody listens: the measured cost is the server's). Then, in this process, calling the services the
`serve` process and the pass call:

- the assignment pass (`assignment_pass`: retries, an offer delta to every connected worker, the
  waiting pass), first with nothing offered yet (every worker gets every build, in JobOffer pages of
  1 000) and then again in the steady state (nothing new);
- RequestJobList for one worker (the full list, as on connect);
- RequestJob (`assignment.request_job`, a claim each): --requests of them from a worker that scored
  nothing, and --requests from a worker that scored every pending build (what a reference worker does
  with every offer: a candidate_score row per build).

Needs PostgreSQL (BENCH_DATABASE_URL, default postgres://postgres@127.0.0.1:5432/gradient_bench).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import describe_machine, reset_tables, seed_queued_builds, setup_django, summary  # noqa: E402

BATCH = 5000


def seed(depth: int, workers: int) -> tuple[list[Any], list[str]]:
    """The pending builds, their evaluation and the connected workers. Returns (workers, job keys)."""
    from django.utils import timezone

    from gradient.runtime.passes import server_boot_start
    from gradient.scheduling.models import Evaluation, EvaluationStatus
    from gradient.scheduling.services.projects import project_create
    from gradient.workers.models import Worker, WorkerSession

    reset_tables()
    now = timezone.now()
    project = project_create(name="depth")
    evaluation = Evaluation.objects.create(
        project=project, repository="sim:depth", commit="depth", status=EvaluationStatus.BUILDING
    )
    keys = [b.job_key for b in seed_queued_builds(evaluation, depth, "depth", now)]
    boot = server_boot_start(now=now)
    rows = []
    for i in range(workers):
        worker = Worker.objects.create(
            name=f"depth-{i}",
            token_hash="-",
            can_build=True,
            architectures=["x86_64-linux"],
            max_concurrent_builds=1000,
            cpu_core_score=1000,
        )
        worker.projects.set([project])
        WorkerSession.objects.create(
            worker=worker, channel_name=f"bench.{i}", server_boot=boot.id, opened_at=now, last_seen=now
        )
        rows.append(worker)
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return rows, keys


def score_everything(worker_id: Any, keys: list[str]) -> None:
    from django.utils import timezone

    from gradient.scheduling.models import CandidateScore

    now = timezone.now()
    for start in range(0, len(keys), BATCH):
        CandidateScore.objects.bulk_create(
            [
                CandidateScore(
                    worker_id=worker_id, job_id=k, missing_count=1, missing_nar_size=4096 + n, updated_at=now
                )
                for n, k in enumerate(keys[start : start + BATCH], start=start)
            ]
        )


def timed(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return (time.perf_counter() - started) * 1000, value


def requests(worker_id: Any, n: int) -> list[float]:
    from django.utils import timezone

    from gradient.scheduling.services.assignment import request_job

    out = []
    for _ in range(n):
        ms, handed = timed(
            lambda: request_job(worker_id=worker_id, protocol_kind="build", now=timezone.now())
        )
        if handed is None:
            raise RuntimeError("a RequestJob found nothing to hand out")
        out.append(ms)
    return out


def run_depth(depth: int, workers: int, n_requests: int) -> None:
    from django.utils import timezone

    from gradient.scheduling.services.offers import job_list
    from gradient.scheduling.services.passes import assignment_pass

    started = time.perf_counter()
    rows, keys = seed(depth, workers)
    seeded = time.perf_counter() - started
    print(f"depth {depth}: {depth} Queued builds, {workers} connected workers (seeded in {seeded:.1f} s)")
    ms, result = timed(lambda: assignment_pass(now=timezone.now()))
    print(f"  assignment pass, first (all offered to every worker): {ms:9.1f} ms, {result.offers} JobOffers")
    ms, result = timed(lambda: assignment_pass(now=timezone.now()))
    print(f"  assignment pass, steady state (nothing new):          {ms:9.1f} ms, {result.offers} JobOffers")
    ms, pages = timed(lambda: job_list(worker_id=rows[0].id, now=timezone.now()))
    print(
        f"  RequestJobList (one worker, {len(pages)} pages):{' ' * (20 - len(str(len(pages))))}{ms:9.1f} ms"
    )
    print(f"  RequestJob, worker scored nothing:       {summary(requests(rows[0].id, n_requests))}")
    score_everything(rows[1].id, keys)
    print(f"  RequestJob, worker scored every build: {summary(requests(rows[1].id, n_requests))}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--depths", type=int, nargs="+", default=[1000, 100000])
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    if min(args.depths) < args.requests * 2 or args.workers < 2:
        parser.error("every depth must hold 2 x --requests builds, and --workers must be at least 2")
    url = setup_django()
    print(f"machine: {describe_machine()}")
    print(f"database: {url}")
    for depth in args.depths:
        run_depth(depth, args.workers, args.requests)


if __name__ == "__main__":
    main()
