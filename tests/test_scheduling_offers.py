"""Offers: full lists in pages of 1 000, deltas from the sent set, reset on each offer."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from django.utils import timezone

from gradient.scheduling.models import DerivationBuild, EvaluationStatus, SentCandidate, SentList, SentOffer
from gradient.scheduling.services import graph
from gradient.scheduling.services import offers as offer_service
from gradient.scheduling.services.offers import forget_sent
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, drv

pytestmark = pytest.mark.django_db


# The offers are the protocol's typed messages; these read them as their JSON objects.
def job_list(**kwargs: Any) -> Any:
    return msgspec.to_builtins(offer_service.job_list(**kwargs))


def job_offers(**kwargs: Any) -> Any:
    return msgspec.to_builtins(offer_service.job_offers(**kwargs))


def candidates_for_worker(*args: Any) -> Any:
    return msgspec.to_builtins(offer_service.candidates_for_worker(*args))


def test_the_job_list_comes_in_pages_of_a_thousand_and_the_last_is_final() -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(
        evaluation=evaluation, derivations=[drv(f"p{i}") for i in range(2500)], now=timezone.now()
    )
    worker = connected_worker([project])
    pages = job_list(worker_id=worker.id, now=timezone.now())
    assert [len(p["candidates"]) for p in pages] == [1000, 1000, 500]
    assert [p["is_final"] for p in pages] == [False, False, True]
    assert SentCandidate.objects.filter(worker=worker).count() == 2500


def test_an_empty_job_list_is_one_final_page() -> None:
    worker = connected_worker([ProjectFactory()])
    assert job_list(worker_id=worker.id, now=timezone.now()) == [
        {"type": "JobListChunk", "candidates": [], "is_final": True}
    ]


def test_build_candidates_carry_the_requirement_and_cached_input_nar_sizes() -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(
        evaluation=evaluation,
        derivations=[drv("dep", cached=True), drv("app", "dep", features=["big"])],
        now=timezone.now(),
    )
    worker = connected_worker([project], system_features=["big"])
    [page] = job_list(worker_id=worker.id, now=timezone.now())
    [candidate] = page["candidates"]
    assert candidate["kind"] == "build"
    assert candidate["requirement"] == {"architecture": "x86_64-linux", "required_features": ["big"]}
    assert candidate["required_paths"] == [{"path": f"/nix/store/{'dep':0>32}-dep", "nar_size": 1000}]
    assert candidate["drv_paths"][0].endswith("app.drv")


def test_offers_are_deltas_and_a_claimed_job_drops_out_of_the_sent_set() -> None:
    project = ProjectFactory()
    EvaluationFactory(project=project)
    worker = connected_worker([project])
    first = job_offers(worker_id=worker.id, now=timezone.now())
    assert len(first) == 1 and len(first[0]["candidates"]) == 1
    assert job_offers(worker_id=worker.id, now=timezone.now()) == []  # nothing new
    second = EvaluationFactory(project=project)
    [offer] = job_offers(worker_id=worker.id, now=timezone.now())
    assert [c["job_id"] for c in offer["candidates"]] == [second.job_key]
    assert ask(worker.id, "flake") is not None
    job_offers(worker_id=worker.id, now=timezone.now())
    assert SentCandidate.objects.filter(worker=worker).count() == 1


def test_returning_a_job_to_the_pool_puts_it_into_the_next_delta() -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project)
    worker = connected_worker([project])
    job_offers(worker_id=worker.id, now=timezone.now())
    forget_sent(evaluation.job_key)
    [offer] = job_offers(worker_id=worker.id, now=timezone.now())
    assert [c["job_id"] for c in offer["candidates"]] == [evaluation.job_key]


def test_a_worker_is_offered_only_what_it_can_run() -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(
        evaluation=evaluation, derivations=[drv("arm", system="aarch64-linux")], now=timezone.now()
    )
    x86 = connected_worker([project], architectures=["x86_64-linux"])
    stranger = connected_worker([ProjectFactory()], architectures=["aarch64-linux"])
    arm = connected_worker([project], architectures=["aarch64-linux"])
    assert job_list(worker_id=x86.id, now=timezone.now())[0]["candidates"] == []
    assert job_list(worker_id=stranger.id, now=timezone.now())[0]["candidates"] == []
    [c] = job_list(worker_id=arm.id, now=timezone.now())[0]["candidates"]
    assert c["job_id"] == DerivationBuild.objects.get().job_key


def test_build_offers_are_deltas_of_the_full_list_and_claimed_builds_drop_out() -> None:
    from gradient.scheduling import selectors

    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(
        evaluation=evaluation,
        derivations=[
            drv("a"),
            drv("b"),
            drv("c"),
            drv("kvm", features=["kvm"]),
            drv("arm", system="aarch64-linux"),
            drv("top", "a"),
        ],
        now=timezone.now(),
    )
    worker = connected_worker([project], architectures=["x86_64-linux"], system_features=["big"])
    state = selectors.worker_state(worker.id)
    assert state is not None
    full = [c["job_id"] for c in candidates_for_worker(state, timezone.now())]
    [offer] = job_offers(worker_id=worker.id, now=timezone.now())
    assert [c["job_id"] for c in offer["candidates"]] == full
    assert len(full) == 3  # a, b, c: not the kvm one, not the aarch64 one, not top (a is not built)
    assert job_offers(worker_id=worker.id, now=timezone.now()) == []
    claimed = ask(worker.id)
    assert claimed is not None
    assert job_offers(worker_id=worker.id, now=timezone.now()) == []
    sent = set(SentCandidate.objects.filter(worker=worker).values_list("job_id", flat=True))
    assert sent == set(full) - {claimed.job_key}
    returned = next(iter(sent))
    forget_sent(returned)
    [again] = job_offers(worker_id=worker.id, now=timezone.now())
    assert [c["job_id"] for c in again["candidates"]] == [returned]


def test_offers_within_one_pass_share_candidate_messages_and_say_the_same_as_a_full_list() -> None:
    from gradient.scheduling.services.offers import pass_cache

    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(
        evaluation=evaluation,
        derivations=[drv("dep", cached=True), drv("app", "dep"), drv("solo")],
        now=timezone.now(),
    )
    first, second, listed = (connected_worker([project]) for _ in range(3))
    now = timezone.now()
    with pass_cache() as cache:
        a = job_offers(worker_id=first.id, now=now)
        b = job_offers(worker_id=second.id, now=now)
    assert len(cache.builds) == DerivationBuild.objects.filter(status="Queued").count() == 2
    full = {c["job_id"]: c for c in job_list(worker_id=listed.id, now=now)[0]["candidates"]}
    for offers in (a, b):
        assert {c["job_id"]: c for c in offers[0]["candidates"]} == full
    app = next(c for c in a[0]["candidates"] if c["required_paths"])
    assert app["required_paths"][0]["nar_size"] == 1000, "a cached input path carries its NAR size"
    assert job_offers(worker_id=first.id, now=now) == [], "nothing new after the pass"


def test_workers_alike_sent_nothing_yet_share_one_first_offer_and_each_remembers_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    project, other = ProjectFactory(), ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("a"), drv("b")], now=timezone.now())
    made: list[object] = []
    real = offer_service._diffed_candidates

    def counted(state: Any, *args: Any, **kwargs: Any) -> Any:
        made.append(state.id)
        return real(state, *args, **kwargs)

    monkeypatch.setattr(offer_service, "_diffed_candidates", counted)
    fleet = [connected_worker([project]) for _ in range(3)]
    stranger = connected_worker([other])
    offered = [job_offers(worker_id=w.id, now=timezone.now()) for w in fleet]
    keys = {b.job_key for b in DerivationBuild.objects.filter(status="Queued")}
    assert len(keys) == 2
    for offer in offered:
        assert offer == offered[0] and {c["job_id"] for c in offer[0]["candidates"]} == keys
    assert made == [fleet[0].id], "made once for the three"
    [listed] = SentList.objects.all()
    assert listed.job_ids == [c["job_id"] for c in offered[0][0]["candidates"]], "stored once, in order"
    assert not SentCandidate.objects.exists(), "no row per worker and key"
    for w in fleet:  # each worker's sent set is what it was sent: its next delta is empty
        assert offer_service.sent_keys(w.id) == keys
        assert job_offers(worker_id=w.id, now=timezone.now()) == []
        # That delta wrote the keys still Queued as the worker's own rows.
        assert set(SentCandidate.objects.filter(worker=w).values_list("job_id", flat=True)) == keys
        assert not SentOffer.objects.filter(worker=w).exists()
    assert made[1:] == [w.id for w in fleet], "a worker sent something already gets its own delta"
    assert job_offers(worker_id=stranger.id, now=timezone.now()) == [], "another shape: its own offer"
    assert made[-1] == stranger.id
    monkeypatch.setattr(offer_service, "SHARED_FIRST_OFFER_SECS", 0.0)
    late = connected_worker([project])
    [offer] = job_offers(worker_id=late.id, now=timezone.now())
    assert {c["job_id"] for c in offer["candidates"]} == keys and made[-1] == late.id, "too old: made again"


@pytest.mark.django_db(transaction=True)
def test_a_shared_first_offer_is_one_list_and_forgetting_a_key_or_claiming_it_acts_on_it() -> None:
    """What a worker sent the shared first offer was sent is the list's keys: returning one of them to
    the pool takes it out of the list (the next delta offers it again), a claimed one is not written as
    the worker's row at its first delta, RescoreWait sees when the list was sent, and a new session
    starts with nothing sent."""
    from gradient.scheduling.services.assignment import _offered_passes_ago

    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(
        evaluation=evaluation, derivations=[drv("a"), drv("b"), drv("c")], now=timezone.now()
    )
    first, second, third = (connected_worker([project]) for _ in range(3))
    sent_at = timezone.now()
    for w in (first, second, third):
        job_offers(worker_id=w.id, now=sent_at)
    keys = {b.job_key for b in DerivationBuild.objects.all()}
    assert SentList.objects.count() == 1 and SentOffer.objects.count() == 3
    assert not SentCandidate.objects.exists()
    a, b, c = sorted(keys)
    times = offer_service.sent_times(second.id, [a, b, "build:00000000-0000-0000-0000-000000000000"])
    assert times.keys() == {a, b} and all(t == sent_at for t in times.values())
    assert _offered_passes_ago(second.id, [a], sent_at) == {a: 0}

    forget_sent(a)  # back in the pool: out of the list
    assert a not in SentList.objects.get().job_ids
    [again] = job_offers(worker_id=first.id, now=timezone.now())
    assert [x["job_id"] for x in again["candidates"]] == [a]
    assert offer_service.sent_keys(first.id) == keys

    claimed = ask(second.id)  # second is sent {b, c} now (a was forgotten); it claims the best of all
    assert claimed is not None
    delta = job_offers(worker_id=second.id, now=timezone.now())
    assert [x["job_id"] for offer in delta for x in offer["candidates"]] == sorted({a} - {claimed.job_key})
    rows = set(SentCandidate.objects.filter(worker=second).values_list("job_id", flat=True))
    assert claimed.job_key not in rows and rows == keys - {claimed.job_key}

    offer_service.forget_worker_offers(third.id)  # a new session of it
    assert offer_service.sent_keys(third.id) == set()


def test_an_empty_first_offer_is_made_once_per_shape_until_the_book_hears_of_a_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fleet connecting to an idle service (issue 31: 1 000 at once) is not 1 000 empty offers made one
    after the other on the offers lane; a change of the queue the book hears of makes it again, so the
    next worker of that shape is offered the new build."""
    from gradient.scheduling import book as queue_book

    monkeypatch.setattr(offer_service, "_empty_first_offers", {})
    monkeypatch.setattr(queue_book, "_book", queue_book.QueueBook())
    project = ProjectFactory()
    made: list[object] = []
    real = offer_service._diffed_candidates

    def counted(state: Any, *args: Any, **kwargs: Any) -> Any:
        made.append(state.id)
        return real(state, *args, **kwargs)

    monkeypatch.setattr(offer_service, "_diffed_candidates", counted)
    fleet = [connected_worker([project]) for _ in range(4)]
    assert [job_offers(worker_id=w.id, now=timezone.now()) for w in fleet] == [[]] * 4
    assert made == [fleet[0].id], "made once for the four"
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("new")], now=timezone.now())
    book = queue_book.book()
    assert book is not None
    book.changed()  # what the book's LISTEN thread does on the queue's NOTIFY
    late = connected_worker([project])
    [offer] = job_offers(worker_id=late.id, now=timezone.now())
    assert [c["job_id"] for c in offer["candidates"]] == [
        b.job_key for b in DerivationBuild.objects.filter(status="Queued")
    ]
    assert made[-1] == late.id


def test_without_a_book_an_empty_first_offer_is_made_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no book hears of the queue's changes (the embedded mode, Celery), nothing says when an
    empty offer is behind: it is not kept."""
    from gradient.scheduling import book as queue_book

    monkeypatch.setattr(offer_service, "_empty_first_offers", {})
    monkeypatch.setattr(queue_book, "_book", None)
    project = ProjectFactory()
    workers = [connected_worker([project]) for _ in range(2)]
    assert job_offers(worker_id=workers[0].id, now=timezone.now()) == []
    EvaluationFactory(project=project)
    [offer] = job_offers(worker_id=workers[1].id, now=timezone.now())
    assert len(offer["candidates"]) == 1


def test_a_fleets_offers_are_made_together_each_as_job_offers_would() -> None:
    """job_offers_batch (issue 31: the WorkerCapabilities of a fleet connecting at once): workers alike
    sent nothing share one first offer, pointed at in one statement whatever their number; a worker sent
    something already gets its own delta; a draining worker nothing; one result per worker, in order."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from gradient.workers.models import WorkerSession

    project, other = ProjectFactory(), ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(
        evaluation=evaluation, derivations=[drv(f"f{i}") for i in range(3)], now=timezone.now()
    )
    keys = {b.job_key for b in DerivationBuild.objects.filter(status="Queued")}
    offer_service._first_offers.clear()

    def batch(workers: list[Any]) -> tuple[list[Any], int]:
        with CaptureQueriesContext(connection) as queries:
            made = offer_service.job_offers_batch(worker_ids=[w.id for w in workers], now=timezone.now())
        return msgspec.to_builtins(made), len(queries.captured_queries)

    first, _ = batch([connected_worker([project])])  # makes the shared list
    few, few_statements = batch([connected_worker([project]) for _ in range(2)])
    many, many_statements = batch([connected_worker([project]) for _ in range(12)])
    assert many_statements == few_statements, "the statements do not grow with the fleet"
    for offers in first + few + many:
        [offer] = offers
        assert {c["job_id"] for c in offer["candidates"]} == keys
    assert SentList.objects.count() == 1 and SentOffer.objects.count() == 15
    assert not SentCandidate.objects.exists()

    veteran = connected_worker([project])
    assert job_offers(worker_id=veteran.id, now=timezone.now())  # sent its first offer alone
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("later")], now=timezone.now())
    later = DerivationBuild.objects.get(drv_path__endswith="later.drv").job_key
    draining = connected_worker([project])
    WorkerSession.objects.filter(worker=draining).update(draining=True)
    stranger = connected_worker([other])
    newcomer = connected_worker([project])
    made = msgspec.to_builtins(
        offer_service.job_offers_batch(
            worker_ids=[veteran.id, draining.id, stranger.id, newcomer.id], now=timezone.now()
        )
    )
    assert [[c["job_id"] for c in o["candidates"]] for o in made[0]] == [[later]], "its own delta"
    assert made[1] == [] and made[2] == []
    [offer] = made[3]
    # The shared first offer, made a moment ago (SHARED_FIRST_OFFER_SECS): `later` comes with its delta.
    assert {c["job_id"] for c in offer["candidates"]} == keys


def test_a_batch_of_job_lists_says_what_job_list_says_to_each_and_resets_each_sent_set() -> None:
    """job_list_batch (issue 31: RequestJobList as 1 000 workers' heartbeat fence): each worker gets the
    pages job_list would give it, its sent set becomes exactly those; a worker not connected gets none."""
    from gradient.workers.models import WorkerSession

    project, other = ProjectFactory(), ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(
        evaluation=evaluation, derivations=[drv(f"j{i}") for i in range(1500)], now=timezone.now()
    )
    alike = [connected_worker([project]) for _ in range(3)]
    stranger = connected_worker([other])
    gone = connected_worker([project])
    WorkerSession.objects.filter(worker=gone).update(closed_at=timezone.now())
    SentCandidate.objects.create(worker=stranger, job_id="build:stale", sent_at=timezone.now())
    job_offers(worker_id=alike[0].id, now=timezone.now())  # alike[0] was sent a first offer
    ids = [w.id for w in [*alike, stranger, gone]]

    made = msgspec.to_builtins(offer_service.job_list_batch(worker_ids=ids, now=timezone.now()))

    keys = {b.job_key for b in DerivationBuild.objects.filter(status="Queued")}
    for pages in made[:3]:
        assert [len(p["candidates"]) for p in pages] == [1000, 500]
        assert [p["is_final"] for p in pages] == [False, True]
        assert {c["job_id"] for p in pages for c in p["candidates"]} == keys
    assert made[3] == [{"type": "JobListChunk", "candidates": [], "is_final": True}]
    assert made[4] == []
    for w in alike:
        assert set(SentCandidate.objects.filter(worker=w).values_list("job_id", flat=True)) == keys
    assert not SentOffer.objects.filter(worker__in=alike).exists()
    assert not SentCandidate.objects.filter(worker=stranger).exists()
    assert made[0] == msgspec.to_builtins(offer_service.job_list(worker_id=alike[0].id, now=timezone.now()))


def test_an_empty_job_list_is_made_once_per_shape_until_the_book_hears_of_a_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Heartbeat fences of an idle fleet: the empty list of a shape is not made again for each worker
    while the book hears of no change; after one, the next list has the new build."""
    from gradient.scheduling import book as queue_book

    monkeypatch.setattr(offer_service, "_empty_lists", {})
    monkeypatch.setattr(queue_book, "_book", queue_book.QueueBook())
    project = ProjectFactory()
    made: list[object] = []
    real = offer_service.candidates_for_worker

    def counted(state: Any, now: Any) -> Any:
        made.append(state.id)
        return real(state, now)

    monkeypatch.setattr(offer_service, "candidates_for_worker", counted)
    fleet = [connected_worker([project]) for _ in range(3)]
    for w in fleet:
        [page] = msgspec.to_builtins(offer_service.job_list_batch(worker_ids=[w.id], now=timezone.now())[0])
        assert page == {"type": "JobListChunk", "candidates": [], "is_final": True}
    assert made == [fleet[0].id], "made once for the three"
    EvaluationFactory(project=project)
    book = queue_book.book()
    assert book is not None
    book.changed()
    [page] = msgspec.to_builtins(
        offer_service.job_list_batch(worker_ids=[fleet[1].id], now=timezone.now())[0]
    )
    assert len(page["candidates"]) == 1 and made[-1] == fleet[1].id
