"""The book of a serve process (gradient.scheduling.book): the queue's heads kept in memory, the change
feed that marks them old, and the claim that checks again what the book may have got wrong."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

from gradient.core.vocab import BuildStatus, EvaluationStatus
from gradient.scheduling import book as queue_book
from gradient.scheduling.models import DerivationBuild, DispatchedJob, Evaluation
from gradient.scheduling.selectors import BuildRef
from gradient.scheduling.services import assignment, graph, lifecycle
from gradient.scheduling.services.assignment import request_builds
from gradient.scheduling.services.lifecycle import ClaimTerms
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import drv

# --- The book alone ------------------------------------------------------------------------------------


def _rows(n: int, start: int = 0) -> list[BuildRef]:
    now = timezone.now()
    return [
        BuildRef(id=uuid.UUID(int=k + 1), queued_at=now, created_at=now, prioritized=False) for k in range(n)
    ]


def test_the_book_reads_a_shape_once_and_again_when_half_is_gone_when_old_or_when_told() -> None:
    book = queue_book.QueueBook(max_age=60.0)
    reads: list[int] = []
    rows = _rows(8)

    def load(n: int) -> list[BuildRef]:
        reads.append(n)
        return list(rows)

    assert book.heads("x", 4, load) == rows
    assert book.heads("x", 4, load) == rows and reads == [4]  # kept
    book.gone([rows[0].id, rows[1].id, rows[2].id])
    assert [r.id for r in book.heads("x", 4, load)] == [r.id for r in rows[3:]] and reads == [4]
    assert book.heads("x", 8, load) and reads == [4, 8]  # asked for more than it read: read again
    # Read again with the claimed ones still gone: a read that began before their claim committed saw
    # them Queued.
    assert [r.id for r in book.heads("x", 8, load)] == [r.id for r in rows[3:]]
    book.gone([r.id for r in rows[3:6]])  # 6 of 8 gone: read again
    book.heads("x", 8, load)
    assert reads == [4, 8, 8]
    book.changed()  # a build became Queued somewhere
    book.heads("x", 8, load)
    assert reads == [4, 8, 8, 8]
    book.heads("y", 8, load)  # another kind of worker: its own entry
    assert reads == [4, 8, 8, 8, 8]

    old = queue_book.QueueBook(max_age=0.0)
    old.heads("x", 4, load)
    old.heads("x", 4, load)
    assert reads[-2:] == [4, 4]  # too old at once: every batch reads


def test_a_half_gone_or_old_entry_is_read_again_in_the_background_while_its_rows_left_are_taken() -> None:
    book = queue_book.QueueBook(max_age=60.0)
    reads: list[int] = []
    queued: list[object] = []  # calls handed to the background, run when the test says
    rows = _rows(32)
    claimed: set[uuid.UUID] = set()  # committed claims: no longer Queued in the database

    def load(n: int) -> list[BuildRef]:
        reads.append(n)
        return [r for r in rows if r.id not in claimed][:n]

    def claim(some: list[BuildRef], into: queue_book.QueueBook = book) -> None:
        claimed.update(r.id for r in some)
        into.gone(r.id for r in some)

    def background(call: object) -> None:
        queued.append(call)

    def run_background() -> None:
        while queued:
            queued.pop(0)()  # type: ignore[operator]

    def ids(some: list[BuildRef]) -> list[uuid.UUID]:
        return [r.id for r in some]

    assert book.heads("x", 8, load, background) == rows[:8] and reads == [8]  # none yet: read at once
    claim(rows[:5])  # 5 of 8 gone
    left = book.heads("x", 8, load, background)
    assert ids(left) == ids(rows[5:8]) and reads == [8]  # what is left, at once
    assert len(queued) == 1
    assert book.heads("x", 8, load, background) == left and len(queued) == 1  # one read at a time
    queued.pop()()  # type: ignore[operator]  # the read behind sees rows 5-12 Queued ...
    assert reads == [8, 8]
    book.gone([rows[5].id])  # ... and row 5 was claimed meanwhile, before the entry was stored:
    # (a read that began before a claim committed sees it Queued; stored gone all the same)
    late = book.heads("x", 8, load, background)
    assert ids(late) == ids(rows[6:13]) and not queued

    book.changed()  # something may be ahead of the entry: read at once, not in the background
    book.heads("x", 8, load, background)
    assert reads == [8, 8, 8] and not queued
    claim(rows[:14])  # nothing left: read at once too
    assert ids(book.heads("x", 8, load, background)) == ids(rows[14:22])
    assert reads == [8, 8, 8, 8] and not queued

    old = queue_book.QueueBook(max_age=0.0)
    old.heads("x", 8, load, background)

    def load_then_changed(n: int) -> list[BuildRef]:
        found = load(n)
        old.changed()  # announced while the read behind was under way
        return found

    assert old.heads("x", 8, load_then_changed, background) == rows[14:22] and len(queued) == 1  # too old
    run_background()  # stored as old: it began before the change
    old.heads("x", 8, load, background)
    assert len(reads) == 7 and not queued  # read at once after the change

    def stopping(call: object) -> None:
        raise RuntimeError("cannot schedule new futures after shutdown")

    stopped = queue_book.QueueBook(max_age=60.0)
    stopped.heads("x", 8, load, stopping)
    claim(rows[14:19], stopped)
    count = len(reads)
    assert ids(stopped.heads("x", 8, load, stopping)) == ids(rows[19:27])  # no thread: read at once
    assert len(reads) == count + 1

    def failing(n: int) -> list[BuildRef]:
        raise RuntimeError("the database is away")

    broken = queue_book.QueueBook(max_age=60.0)
    broken.heads("x", 8, load, background)
    claim(rows[19:24], broken)
    broken.heads("x", 8, failing, background)
    run_background()  # failed: logged, and the entry forgotten
    count = len(reads)
    assert ids(broken.heads("x", 8, load, background)) == ids(rows[24:32])
    assert len(reads) == count + 1 and not queued  # the next batch read it itself

    behind = queue_book.QueueBook(max_age=60.0)
    behind.heads("x", 4, load, background)
    claim(rows[24:27], behind)
    newest: list[object] = []

    def load_while_changed(n: int) -> list[BuildRef]:
        found = load(n)
        behind.changed()  # announced while this read was under way ...
        behind.heads("x", 4, load)  # ... and read at once by a batch
        newest.append(behind._entries["x"])
        return found

    behind.heads("x", 4, load_while_changed, background)  # half gone: a read behind is queued
    run_background()
    assert newest and behind._entries["x"] is newest[0]  # the older read behind did not replace it


# --- The change feed (PostgreSQL) ------------------------------------------------------------------------


@pytest.fixture
def listening() -> Iterator[psycopg.Connection]:
    params = dict(connection.get_connection_params())
    keep = {"dbname", "user", "password", "host", "port"}
    with psycopg.connect(**{k: v for k, v in params.items() if k in keep}, autocommit=True) as conn:
        conn.execute(f"LISTEN {queue_book.CHANNEL}")
        yield conn


def _notified(conn: psycopg.Connection, timeout: float = 2.0) -> bool:
    return any(True for _ in conn.notifies(timeout=timeout, stop_after=1))


@pytest.mark.django_db(transaction=True)
def test_a_statement_that_queues_a_build_announces_it_and_a_claim_does_not(
    listening: psycopg.Connection,
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the change feed is PostgreSQL's")
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("a"), drv("b")], now=timezone.now())
    assert _notified(listening), "the ingest queued builds"

    worker = connected_worker([project], max_concurrent_builds=2)
    answers = request_builds(worker_ids=[worker.id], now=timezone.now(), tried=[])
    assert answers[0] is not None
    assert not _notified(listening, timeout=0.5), "a claim takes a build out of the queue: nothing ahead"

    queued = DerivationBuild.objects.get(status=BuildStatus.QUEUED)
    DerivationBuild.objects.filter(id=queued.id).update(prioritized=True)
    assert _notified(listening), "a Queued build prioritized"

    other = EvaluationFactory(project=ProjectFactory(), status=EvaluationStatus.BUILDING)
    still_queued = "a" if queued.drv_path.endswith("-a.drv") else "b"
    graph.ingest_eval_result(evaluation=other, derivations=[drv(still_queued)], now=timezone.now())
    assert _notified(listening), "a Queued build now wanted by another project's evaluation"


@pytest.mark.django_db(transaction=True)
def test_the_listener_of_a_serve_process_marks_the_book_old_on_each_change() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the change feed is PostgreSQL's")
    book = queue_book.enable_here()
    assert book is not None
    try:
        loaded = threading.Event()

        def load(n: int) -> list[BuildRef]:
            loaded.set()
            return _rows(4)

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the listener's first LISTEN marks it old once
            before = book.loads
            book.heads("x", 4, load)
            book.heads("x", 4, load)
            if book.loads == before + 1:
                break
            time.sleep(0.1)
        before = book.loads
        project = ProjectFactory()
        evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
        graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("a")], now=timezone.now())
        while time.monotonic() < deadline and book.loads == before:
            book.heads("x", 4, load)
            time.sleep(0.05)
        assert book.loads == before + 1, "the notification reached the book"
    finally:
        queue_book.disable()


# --- A book behind: the claim decides ---------------------------------------------------------------------


@pytest.fixture(autouse=True)
def reads_behind_held(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The book's reads in the background (a serve's claims lane: another thread, another connection,
    which would not see this test's uncommitted rows) are held, never run: what each test asserts is
    what its batches read themselves."""
    held: list[object] = []
    monkeypatch.setattr(assignment, "_in_background", held.append)
    return held


def _building(project, names):  # type: ignore[no-untyped-def]
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv(n) for n in names], now=timezone.now())
    return evaluation


def _claim(build: DerivationBuild, worker_id: uuid.UUID) -> bool:
    claim = lifecycle.build_claim(
        build=build, worker_id=worker_id, job={"stale": True}, terms=ClaimTerms(), assignment_id=uuid.uuid4()
    )
    return bool(lifecycle.claim_builds(claims=[claim], now=timezone.now()))


@pytest.mark.django_db
def test_a_claim_from_a_book_behind_loses_when_no_evaluation_of_the_workers_projects_wants_it() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the batch claim statement is PostgreSQL's")
    mine, theirs = ProjectFactory(), ProjectFactory()
    evaluation = _building(mine, ["a", "b"])
    _building(theirs, ["c"])
    worker = connected_worker([mine], max_concurrent_builds=4)
    a, b = (DerivationBuild.objects.get(drv_path__contains=f"-{n}.drv") for n in ("a", "b"))
    c = DerivationBuild.objects.get(drv_path__contains="-c.drv")

    assert not _claim(c, worker.id), "another project's build"
    Evaluation.objects.filter(id=evaluation.id).update(status=EvaluationStatus.ABORTED)
    assert not _claim(a, worker.id), "its only evaluation was aborted"
    Evaluation.objects.filter(id=evaluation.id).update(status=EvaluationStatus.BUILDING)
    assert _claim(a, worker.id)
    assert not _claim(a, worker.id), "claimed already"
    assert DispatchedJob.objects.filter(derivation_build=b).count() == 0
    assert DerivationBuild.objects.get(id=c.id).status == BuildStatus.QUEUED


@pytest.mark.django_db
def test_requests_answered_from_a_book_behind_still_get_the_builds_that_are_left() -> None:
    project = ProjectFactory()
    _building(project, [f"b{k}" for k in range(6)])
    workers = [connected_worker([project]) for _ in range(3)]
    book = queue_book.enable()
    try:
        first = request_builds(worker_ids=[workers[0].id], now=timezone.now(), tried=[])
        assert first[0] is not None
        # Taken behind the book's back (another process's claims): the book still holds them.
        for b in DerivationBuild.objects.filter(status=BuildStatus.QUEUED).order_by("queued_at", "id")[:3]:
            DerivationBuild.objects.filter(id=b.id).update(status=BuildStatus.BUILDING)
        answers = request_builds(worker_ids=[w.id for w in workers[1:]], now=timezone.now(), tried=[])
        assert all(a is not None for a in answers), "the two builds left went out"
        assert len({a.job_key for a in answers if a is not None}) == 2
        assert not DerivationBuild.objects.filter(status=BuildStatus.QUEUED).exists()
        assert book.loads >= 1
    finally:
        queue_book.disable()


@pytest.mark.django_db
def test_a_request_whose_claims_all_lost_is_asked_again_and_one_with_no_work_left_is_not() -> None:
    from gradient.core.protocol import AssignJob
    from gradient.scheduling.services.assignment import ASK_AGAIN, hand_out_builds

    project = ProjectFactory()
    _building(project, ["p", "q", "r"])
    first, second = connected_worker([project]), connected_worker([project])
    queue_book.enable()
    try:
        [handed] = hand_out_builds(worker_ids=[first.id], now=timezone.now())
        assert isinstance(handed, AssignJob)
        # The two left are taken behind the book's back, as another process's batch takes them.
        DerivationBuild.objects.filter(status=BuildStatus.QUEUED).update(status=BuildStatus.BUILDING)
        assert hand_out_builds(worker_ids=[second.id], now=timezone.now()) == [ASK_AGAIN]
        assert hand_out_builds(worker_ids=[second.id], now=timezone.now()) == [None], "nothing left"
    finally:
        queue_book.disable()


@pytest.mark.django_db
def test_the_batchs_one_statement_reads_the_workers_as_the_orm_does() -> None:
    from gradient.scheduling import selectors

    project, other = ProjectFactory(), ProjectFactory()
    _building(project, ["w1", "w2", "w3"])
    busy = connected_worker([project, other], max_concurrent_builds=3)
    idle = connected_worker([other])
    gone = connected_worker([project])
    for _ in range(2):
        assert request_builds(worker_ids=[busy.id], now=timezone.now(), tried=[])[0] is not None
    DispatchedJob.objects.filter(worker=busy).update(missing_nar_size=10**12)  # large transfers
    gone.active = False
    gone.save(update_fields=["active"])
    ids = [busy.id, idle.id, gone.id, uuid.uuid4()]

    states, open_builds = selectors.workers_of_batch(ids)
    orm_states = selectors.worker_states(ids, orm=True)
    assert set(states) == set(orm_states) == {busy.id, idle.id}
    for worker_id, state in states.items():
        expected = orm_states[worker_id]
        assert (state.session_id, state.draining, state.project_ids) == (
            expected.session_id,
            expected.draining,
            expected.project_ids,
        )
        assert state.worker.architectures == expected.worker.architectures
        assert state.worker.system_features == expected.worker.system_features
        assert state.worker.max_concurrent_builds == expected.worker.max_concurrent_builds
    assert open_builds == selectors.open_builds_of(list(states))
    assert open_builds[busy.id] == selectors.OpenBuilds(2, 2)


@pytest.mark.django_db
def test_a_batch_claims_job_payload_is_the_one_made_from_the_whole_build_row() -> None:
    """The claim batch reads only the payload's columns of its chosen builds (one fixed-text statement):
    the AssignJob's job and the assignment row's copy are what jobs.build_job makes of the full row."""
    import msgspec

    from gradient.scheduling import jobs

    project = ProjectFactory()
    _building(project, ["p0", "p1"])
    DerivationBuild.objects.update(timeout_secs=77, max_silent_secs=11, required_features=["kvm"])
    workers = [connected_worker([project], system_features=["kvm"]) for _ in range(2)]
    for worker, enabled in zip(workers, (False, True), strict=True):
        book = queue_book.enable() if enabled else None
        try:
            [answer] = request_builds(worker_ids=[worker.id], now=timezone.now(), tried=[])
        finally:
            if book is not None:
                queue_book.disable()
        assert answer is not None
        build = DerivationBuild.objects.get(id=uuid.UUID(answer.job_key.removeprefix("build:")))
        expected = msgspec.to_builtins(jobs.build_job(build))
        assert msgspec.to_builtins(answer.job) == expected
        assert expected["builds"][0]["timeout_secs"] == 77 and expected["requirement"][
            "required_features"
        ] == ["kvm"]
        assert DispatchedJob.objects.get(id=answer.assignment_id).job == expected


@pytest.mark.django_db
def test_two_live_serves_each_prefer_their_own_builds_among_the_first_heads_only() -> None:
    """With several live serve processes, a process's batch prefers, within the first heads it could
    reach, the builds of its residue (build id modulo the live processes): the processes' claims spread;
    the heads past that window keep their order. Alone, or outside a serve with a book, nothing moves."""
    from gradient.recovery.models import ServerBoot
    from gradient.runtime import boot
    from gradient.scheduling.services import assignment

    now = timezone.now()
    refs = _rows(12)
    assert assignment._prefer_own(refs, 0, 1, 12) == refs
    spread = assignment._prefer_own(refs, 1, 2, 6)
    window = [r for r in refs[:6] if r.id.int % 2 == 1] + [r for r in refs[:6] if r.id.int % 2 == 0]
    assert spread == window + refs[6:]

    boots = [
        ServerBoot.objects.create(hostname="h", pid=p, started_at=now, last_heartbeat=now) for p in (1, 2)
    ]
    ServerBoot.objects.create(hostname="h", pid=3, started_at=now, last_heartbeat=now, stopped_at=now)
    previous = boot.current_boot()
    assignment._share = None
    try:
        boot.set_current_boot(max(b.id for b in boots))
        assert assignment._process_share(now) == (0, 1)  # no book: not a serve
        queue_book.enable()
        try:
            assert assignment._process_share(now) == (1, 2)
            boot.set_current_boot(min(b.id for b in boots))
            assert assignment._process_share(now) == (0, 2)
        finally:
            queue_book.disable()
    finally:
        boot.set_current_boot(previous)
        assignment._share = None


def test_an_entry_read_at_once_is_read_with_what_the_caller_needs_and_whole_in_the_background() -> None:
    book = queue_book.QueueBook(max_age=60.0)
    reads: list[int] = []
    queued: list[object] = []
    rows = _rows(32)

    def load(n: int) -> list[BuildRef]:
        reads.append(n)
        return rows[:n]

    def background(call: object) -> None:
        queued.append(call)

    def ids(some: list[BuildRef]) -> list[uuid.UUID]:
        return [r.id for r in some]

    # None yet: the caller's four at once, the whole sixteen on their way.
    assert book.heads("x", 16, load, background, first=4) == rows[:4]
    assert reads == [4] and len(queued) == 1
    book.gone([rows[0].id])
    # Meanwhile what the quick read left, with no other read.
    assert ids(book.heads("x", 16, load, background, first=4)) == ids(rows[1:4])
    assert reads == [4] and len(queued) == 1
    queued.pop()()  # type: ignore[operator]
    assert reads == [4, 16]
    # The whole read, the one claimed meanwhile still gone.
    assert ids(book.heads("x", 16, load, background, first=4)) == ids(rows[1:16]) and reads == [4, 16]

    book.changed()  # announced: read at once again, the caller's part first
    assert ids(book.heads("x", 16, load, background, first=4)) == ids(rows[1:4])
    assert reads == [4, 16, 4] and len(queued) == 1
    queued.pop()()  # type: ignore[operator]
    assert reads == [4, 16, 4, 16]

    # Where nothing can read in the background, the whole read is made at once.
    alone = queue_book.QueueBook(max_age=60.0)
    assert alone.heads("x", 16, load, None, first=4) == rows[:16] and reads[-1] == 16


def test_a_large_entry_is_read_again_once_three_quarters_are_gone_a_small_one_at_half() -> None:
    """Each read ranks every head again: a large entry waits until a quarter is left (each head read and
    ranked 1.33 times on average instead of twice); a small one still keeps half as its runway."""
    for size, read_again_below in (
        (1024, 256),
        (2 * queue_book.RUNWAY, 256),
        (queue_book.RUNWAY, 128),
        (8, 4),
    ):
        book = queue_book.QueueBook()
        loads: list[int] = []

        def load(n: int, size: int = size, loads: list[int] = loads) -> list[BuildRef]:
            loads.append(n)
            return _rows(size)

        rows = book.heads("x", size, load)
        book.gone(r.id for r in rows[: size - read_again_below])
        assert len(book.heads("x", size, load)) == read_again_below and len(loads) == 1, size
        book.gone([rows[size - read_again_below].id])  # one fewer: read again, what is gone kept gone
        assert len(book.heads("x", size, load)) == read_again_below - 1
        assert len(loads) == 2, (size, loads)


def test_what_is_left_of_an_entry_keeps_its_order_as_claims_take_rows_anywhere() -> None:
    book = queue_book.QueueBook()
    rows = _rows(8)
    book.heads("x", 8, lambda n: rows, first=None)
    book._recent.clear()
    book.gone([rows[0].id, rows[5].id, uuid.UUID(int=999)])  # one it never held among them
    assert book.heads("x", 8, lambda n: rows) == [rows[i] for i in (1, 2, 3, 4, 6, 7)]
    book.gone([rows[2].id])
    assert book.heads("x", 8, lambda n: rows) == [rows[i] for i in (1, 3, 4, 6, 7)]
    book.gone([rows[2].id])  # gone already: nothing changes
    assert book.heads("x", 8, lambda n: rows) == [rows[i] for i in (1, 3, 4, 6, 7)]
