"""One hand-out cycle, counted: statements, commits and round trips per step (a regression guard).

    .venv/bin/python bench/cycle.py [--pending 1000] [--cycles 200] [--workers 100]

One evaluation, Building, with --pending Queued shared builds and --workers connected build workers.
Then, in this process and exactly as the /proto consumer does it (the job loop's functions on a
thread that keeps its connection, as the lanes do; "seen" and metrics noted in memory and written by
the presence flush every few seconds for every session at once; reports through the batch entry, here
batches of one), --cycles full cycles by one worker:

    RequestJob -> AssignJobResponse -> JobUpdate building -> JobUpdate build_output -> JobCompleted,
    and a WorkerMetrics heartbeat (in memory: no statement)

Per step it prints the statements Django sent (execute_wrapper); the commits (every write sent
outside a transaction is one, in autocommit, and so is every transaction); the connection health
checks (Django's `SELECT 1` when CONN_HEALTH_CHECKS is on); the round trips (statements, health
checks, and the BEGIN and COMMIT of each transaction); and the wall time p50. Counts, unlike times,
do not depend on the machine's load. The last line, in this form:

    cycle: <statements> statements, <commits> commits, <round trips> round trips per cycle; <ms> ms p50

Needs PostgreSQL (BENCH_DATABASE_URL, default postgres://postgres@127.0.0.1:5432/gradient_bench).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import describe_machine, percentile, setup_django  # noqa: E402
from queue_depth import seed  # noqa: E402

STEPS = ("RequestJob", "AssignJobResponse", "JobUpdate building", "JobUpdate build_output", "JobCompleted")
HEARTBEAT = "WorkerMetrics"
FLUSH = "presence flush (all sessions)"


class Counter:
    """Statements through Django's cursors (those outside a transaction are autocommits), health
    checks, and the COMMITs of transactions."""

    def __init__(self) -> None:
        self.statements = 0
        self.autocommits = 0
        self.health_checks = 0
        self.commits = 0

    def __call__(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        from django.db import connection

        self.statements += 1
        # A write outside a transaction is a commit of its own (and an fsync); a read is not written.
        reads = sql.lstrip().upper().startswith("SELECT")
        self.autocommits += int(connection.get_autocommit() and not reads)
        return execute(sql, params, many, context)

    def snapshot(self) -> tuple[int, int, int, int]:
        return (self.statements, self.autocommits, self.health_checks, self.commits)


def run(pending: int, cycles: int, workers: int) -> None:
    from django.db import connection
    from django.db.backends.postgresql.base import DatabaseWrapper

    from gradient.core.protocol import (
        AssignJobResponse,
        Building,
        BuildOutput,
        BuiltOutput,
        JobCompleted,
        JobUpdate,
        RequestJob,
        WorkerMetrics,
    )
    from gradient.workers import presence
    from gradient.workers.models import WorkerSession
    from gradient.workers.proto import dispatcher, jobloop
    from gradient.workers.services import SessionRef

    REPORT = object()  # a report, answer or log piece: through the batch entry
    flushed = [time.monotonic()]
    rows, _ = seed(pending, workers)
    worker = rows[0]
    session_id = WorkerSession.objects.filter(worker=worker).values_list("id", flat=True).get()
    session = SessionRef(session_id=session_id, worker_id=worker.id)

    counter = Counter()
    real_is_usable = DatabaseWrapper.is_usable

    def counted_is_usable(self: Any) -> bool:
        counter.health_checks += 1
        return bool(real_is_usable(self))

    real_commit = DatabaseWrapper.commit

    def counted_commit(self: Any) -> None:
        counter.commits += 1
        real_commit(self)

    DatabaseWrapper.is_usable = counted_is_usable  # type: ignore[method-assign]
    DatabaseWrapper.commit = counted_commit  # type: ignore[method-assign]

    def message(handler: Callable[..., Any], msg: Any) -> Any:
        """One message as the consumer handles it: "seen" noted in memory (the presence flush writes
        it, for every session of the process at once), then the job-loop call on a lane thread, which
        keeps its connection (no close_old_connections, so no health check). A report is a batch of
        one here (one worker); under load the batcher puts many sessions' reports in one commit."""
        presence.note_seen(session_id=session.session_id, worker_id=session.worker_id, now=_now())
        if handler is REPORT:
            [result] = dispatcher.reports_batch([(session, msg)])
            return result
        return handler(session=session, message=msg)

    def _now() -> Any:
        from django.utils import timezone

        return timezone.now()

    # per step and cycle: (statements, commits, health checks, round trips, ms)
    totals: dict[str, list[tuple[int, int, int, int, float]]] = defaultdict(list)

    def step(name: str, fn: Callable[[], Any]) -> Any:
        before = counter.snapshot()
        started = time.perf_counter()
        with connection.execute_wrapper(counter):
            value = fn()
        ms = (time.perf_counter() - started) * 1000
        statements, autocommits, checks, transactions = (
            a - b for a, b in zip(counter.snapshot(), before, strict=True)
        )
        commits = autocommits + transactions
        trips = statements + checks + 2 * transactions
        totals[name].append((statements, commits, checks, trips, ms))
        return value

    for _ in range(cycles):
        replies = step("RequestJob", lambda: message(jobloop.request_job, RequestJob(kind="build")))
        if not replies:
            raise RuntimeError("a RequestJob found nothing to hand out: raise --pending")
        assign = replies[0]
        spec = assign.job.builds[0]
        ids = {"job_id": assign.job_id, "assignment_id": assign.assignment_id}
        outputs = [BuiltOutput(name=o.name, path=o.path, nar_size=4096) for o in spec.outputs]
        building = Building(build_id=spec.build_id)
        output = BuildOutput(build_id=spec.build_id, outputs=outputs, substituted=False)
        for name, msg in (
            ("AssignJobResponse", AssignJobResponse(**ids, accepted=True)),
            ("JobUpdate building", JobUpdate(**ids, update=building)),
            ("JobUpdate build_output", JobUpdate(**ids, update=output)),
            ("JobCompleted", JobCompleted(**ids, elapsed_ms=5)),
        ):
            step(name, lambda m=msg: message(REPORT, m))
        step(HEARTBEAT, lambda: message(jobloop.worker_metrics, WorkerMetrics(cpu_usage_pct=1.0)))
        if time.monotonic() - flushed[0] >= presence.flush_every_secs():
            flushed[0] = time.monotonic()
            step(FLUSH, jobloop.presence_flush)

    print(describe_machine())
    print(f"{cycles} cycles, {pending} pending builds, {workers} connected workers")
    header = (
        f"  {'step':<28} {'statements':>10} {'commits':>8} {'health':>7} {'round trips':>12} {'p50 ms':>8}"
    )
    print(header)
    cycle_statements = cycle_commits = cycle_trips = 0.0
    cycle_ms = []
    for name in (*STEPS, HEARTBEAT, FLUSH):
        samples = totals[name]
        if not samples:
            continue
        statements = statistics.fmean(s[0] for s in samples)
        commits = statistics.fmean(s[1] for s in samples)
        checks = statistics.fmean(s[2] for s in samples)
        trips = statistics.fmean(s[3] for s in samples)
        p50 = percentile([s[4] for s in samples], 50)
        print(f"  {name:<28} {statements:>10.1f} {commits:>8.1f} {checks:>7.1f} {trips:>12.1f} {p50:>8.2f}")
        if name == FLUSH:  # once every few seconds for every session of the process, not per cycle
            flushes = len(samples)
            print(f"  ({flushes} flushes in {cycles} cycles: {flushes / cycles:.3f} per cycle, all sessions)")
            continue
        cycle_statements += statements
        cycle_commits += commits
        cycle_trips += trips
    for i in range(cycles):
        cycle_ms.append(sum(totals[name][i][4] for name in (*STEPS, HEARTBEAT)))
    messages = len(STEPS) + 1
    print(f"  commits per message on average: {cycle_commits / messages:.2f}")
    print(
        f"cycle: {cycle_statements:.0f} statements, {cycle_commits:.0f} commits, "
        f"{cycle_trips:.0f} round trips per cycle; {percentile(cycle_ms, 50):.1f} ms p50"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pending", type=int, default=1000)
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--workers", type=int, default=100)
    args = parser.parse_args()
    if args.pending < args.cycles:
        parser.error("--pending must be at least --cycles (each cycle builds one)")
    setup_django()
    run(args.pending, args.cycles, args.workers)


if __name__ == "__main__":
    main()
