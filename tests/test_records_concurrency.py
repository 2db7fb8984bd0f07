"""Optimistic commits, proved with real PostgreSQL connections racing: each thread has its own
connection, and the invariant is queried from the database afterwards."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from gradient.records.decisions.fold import Effect
from gradient.records.errors import RevisionConflict
from gradient.records.models import RecordEntry
from gradient.records.schemas import (
    Cancel,
    JobKind,
    Outcome,
    ReportKind,
    WorkerReport,
    decode_body,
    job_key_for,
)
from gradient.records.selectors import record_job
from gradient.records.services import (
    commit_control,
    plan_default,
    record_append_facts,
    record_commit,
    record_create,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("postgres_only")]


def _record() -> str:
    job_key = job_key_for(JobKind.EVALUATION, uuid.uuid4())
    record_create(
        job_key=job_key,
        spec={"commit": "c"},
        plan=plan_default(kind=JobKind.EVALUATION),
        created_by=None,
        idempotency_key=None,
        now=timezone.now(),
    )
    return job_key


def _evidence(n: int, writer: str) -> WorkerReport:
    return WorkerReport(assignment_id=None, worker=writer, kind=ReportKind.UPDATE, summary=f"{writer} #{n}")


def _in_thread(target: Callable[[], Any], results: list[Any]) -> threading.Thread:
    """Run `target` on a thread with its own database connection, closed when it ends."""

    def run() -> None:
        try:
            results.append(target())
        except Exception as exc:  # collected and asserted on by the test
            results.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def _wait_until(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


def test_two_connections_committing_at_the_same_revision_one_wins_and_the_database_refuses_the_other() -> (
    None
):
    job_key = _record()
    now = timezone.now()
    second_pid: list[int] = []
    first_updated, first_committed = threading.Event(), threading.Event()
    results: list[Any] = []

    def first() -> int:
        with transaction.atomic():
            revision = record_commit(
                job_key=job_key, expected_revision=0, entries=[_evidence(1, "first")], now=now
            )
            first_updated.set()
            # hold the transaction open until the second connection is blocked on our row in the database
            _wait_until(lambda: bool(second_pid), "the second connection")
            _wait_until(lambda: _waiting_on_a_lock(second_pid[0]), "the second connection to block")
        first_committed.set()
        return revision

    def second() -> int:
        pid = _backend_pid()
        first_updated.wait()
        second_pid.append(pid)
        return record_commit(job_key=job_key, expected_revision=0, entries=[_evidence(1, "second")], now=now)

    threads = [_in_thread(first, results), _in_thread(second, results)]
    for thread in threads:
        thread.join()
    assert first_committed.is_set(), results
    conflicts = [r for r in results if isinstance(r, RevisionConflict)]
    assert len(results) == 2 and 1 in results and len(conflicts) == 1, results
    bodies = list(RecordEntry.objects.filter(record__job_key=job_key).values_list("revision", "body"))
    assert len(bodies) == 1 and bodies[0][0] == 1 and '"first #1"' in bodies[0][1]


def _waiting_on_a_lock(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", [pid])
        return int(cursor.fetchone()[0]) > 0


def test_writers_racing_round_after_round_each_round_has_exactly_one_winner() -> None:
    job_key = _record()
    writers = 4
    for round_number in range(12):
        barrier = threading.Barrier(writers)
        results: list[Any] = []

        def commit(
            writer: int, expected: int = round_number, barrier: threading.Barrier = barrier
        ) -> tuple[str, int]:
            barrier.wait()
            revision = record_commit(
                job_key=job_key,
                expected_revision=expected,
                entries=[_evidence(expected, f"w{writer}")],
                now=timezone.now(),
            )
            return ("won", revision)

        threads = [_in_thread(lambda w=w: commit(w), results) for w in range(writers)]
        for thread in threads:
            thread.join()
        won = [r for r in results if isinstance(r, tuple)]
        lost = [r for r in results if isinstance(r, RevisionConflict)]
        assert len(won) == 1 and len(lost) == writers - 1, results
        assert won[0] == ("won", round_number + 1)
    revisions = list(RecordEntry.objects.filter(record__job_key=job_key).values_list("revision", flat=True))
    assert revisions == list(range(1, 13))
    assert record_job(job_key=job_key, now=timezone.now()).revision == 12


def test_commit_control_gets_its_cancel_in_while_other_threads_commit_evidence_in_a_tight_loop() -> None:
    job_key = _record()
    stop = threading.Event()
    counts = {"append": 0, "commit": 0, "conflicts": 0}

    def append_loop() -> int:
        n = 0
        while not stop.is_set():
            with transaction.atomic():  # the scheduler's way: facts inside its own transaction
                record_append_facts(job_key=job_key, facts=[_evidence(n, "append")], now=timezone.now())
            n += 1
            counts["append"] = n
        return n

    def commit_loop() -> int:
        n = 0
        while not stop.is_set():
            revision = record_job(job_key=job_key, now=timezone.now()).revision
            try:
                record_commit(
                    job_key=job_key,
                    expected_revision=revision,
                    entries=[_evidence(n, "commit")],
                    now=timezone.now(),
                )
            except RevisionConflict:
                counts["conflicts"] += 1
                continue
            n += 1
            counts["commit"] = n
        return n

    results: list[Any] = []
    threads = [_in_thread(append_loop, results), _in_thread(commit_loop, results)]
    try:
        # (the optimistic evidence writer may well starve against the appender: only the cancel may not)
        _wait_until(lambda: counts["append"] >= 20, "evidence to flow")
        before = dict(counts)
        receipt = commit_control(
            job_key=job_key, intent=Cancel(reason="stop it"), actor="api:bob", now=timezone.now()
        )
        _wait_until(lambda: counts["append"] >= before["append"] + 20, "evidence to keep flowing")
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not [r for r in results if isinstance(r, Exception)], results
    assert receipt.effect is Effect.CANCELLED and receipt.outcome is Outcome.CANCELLED
    cancel = RecordEntry.objects.get(record__job_key=job_key, revision=receipt.revision)
    assert isinstance(decode_body(cancel.schema, cancel.body), Cancel) and cancel.actor == "api:bob"
    assert RecordEntry.objects.filter(record__job_key=job_key, revision__gt=receipt.revision).exists()
    job = record_job(job_key=job_key, now=timezone.now())
    assert (
        job.outcome is Outcome.CANCELLED
        and job.revision == RecordEntry.objects.filter(record__job_key=job_key).count()
    )
