"""Job records: what appending a fact costs on the scheduler's hot path, what folding a long history
costs, and how long a cancel waits while other connections append evidence as fast as they can.

    createdb -h 127.0.0.1 -U postgres gradient_bench
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gradient_bench .venv/bin/python manage.py migrate
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gradient_bench .venv/bin/python bench/records.py
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")

import django  # noqa: E402

django.setup()

from django.db import connection, transaction  # noqa: E402
from django.utils import timezone  # noqa: E402

from gradient.records.decisions.fold import fold  # noqa: E402
from gradient.records.schemas import (  # noqa: E402
    AssignmentClaimed,
    AssignmentClosed,
    AssignmentOutcome,
    Cancel,
    JobKind,
    ReportKind,
    RowStatus,
    StatusChanged,
    WorkerReport,
    job_key_for,
)
from gradient.records.selectors import record_read  # noqa: E402
from gradient.records.services import (  # noqa: E402
    commit_control,
    plan_default,
    record_append_facts,
    record_create,
)


def new_record() -> str:
    job_key = job_key_for(JobKind.EVALUATION, uuid.uuid4())
    record_create(
        job_key=job_key,
        spec={"bench": job_key},
        plan=plan_default(kind=JobKind.EVALUATION),
        created_by=None,
        idempotency_key=None,
        now=timezone.now(),
    )
    return job_key


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_append(n: int = 2000) -> None:
    keys = [new_record() for _ in range(50)]
    latencies = []
    started = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        with transaction.atomic():  # a state change's transaction, holding just its fact
            record_append_facts(
                job_key=keys[i % len(keys)],
                facts=[StatusChanged(status=RowStatus.BUILDING)],
                now=timezone.now(),
            )
        latencies.append((time.perf_counter() - t) * 1000)
    elapsed = time.perf_counter() - started
    p50, p99 = statistics.median(latencies), pct(latencies, 0.99)
    print(f"append one fact per transaction: {n / elapsed:,.0f}/s, p50 {p50:.2f} ms, p99 {p99:.2f} ms")


def bench_fold(entries: int = 1000) -> None:
    job_key = new_record()
    facts = []
    for i in range(entries // 4):
        a = uuid.uuid4()
        facts += [
            AssignmentClaimed(submission=i + 1, assignment_id=a, worker="w1", attempt=i + 1),
            WorkerReport(assignment_id=a, worker="w1", kind=ReportKind.ACCEPTED),
            WorkerReport(assignment_id=a, worker="w1", kind=ReportKind.UPDATE, summary="EvaluatingFlake"),
            AssignmentClosed(assignment_id=a, outcome=AssignmentOutcome.ABANDONED),
        ]
    record_append_facts(job_key=job_key, facts=facts, now=timezone.now())
    t = time.perf_counter()
    _, view = record_read(job_key=job_key)
    read_ms = (time.perf_counter() - t) * 1000
    runs = []
    for _ in range(20):
        t = time.perf_counter()
        fold(view.header, view.entries, timezone.now())
        runs.append((time.perf_counter() - t) * 1000)
    print(
        f"read {len(view.entries)} entries: {read_ms:.1f} ms; fold them: p50 {statistics.median(runs):.1f} ms"
    )


def bench_cancel_under_evidence(writers: int = 2, cancels: int = 20) -> None:
    latencies, tries = [], []
    for _ in range(cancels):
        job_key = new_record()
        stop = threading.Event()
        counts = [0] * writers

        def evidence(
            slot: int, job_key: str = job_key, stop: threading.Event = stop, counts: list[int] = counts
        ) -> None:
            try:
                while not stop.is_set():
                    with transaction.atomic():
                        record_append_facts(
                            job_key=job_key,
                            facts=[
                                WorkerReport(assignment_id=None, worker=f"w{slot}", kind=ReportKind.UPDATE)
                            ],
                            now=timezone.now(),
                        )
                    counts[slot] += 1
            finally:
                connection.close()

        threads = [threading.Thread(target=evidence, args=(s,)) for s in range(writers)]
        for thread in threads:
            thread.start()
        while min(counts) < 10:
            time.sleep(0.005)
        t = time.perf_counter()
        receipt = commit_control(job_key=job_key, intent=Cancel(), actor="bench", now=timezone.now())
        latencies.append((time.perf_counter() - t) * 1000)
        tries.append(receipt.tries)
        stop.set()
        for thread in threads:
            thread.join()
    print(
        f"cancel while {writers} connections append evidence: p50 {statistics.median(latencies):.1f} ms, "
        f"max {max(latencies):.1f} ms, tries p50 {statistics.median(tries):.0f} max {max(tries)}"
    )


if __name__ == "__main__":
    print(f"database: {connection.vendor} {connection.settings_dict['NAME']}")
    bench_append()
    bench_fold()
    bench_cancel_under_evidence()
