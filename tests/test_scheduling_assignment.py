"""RequestJob: candidates for this worker only, scored, claimed, handed out; idle slots otherwise."""

from __future__ import annotations

import uuid
from datetime import timedelta

import msgspec
import pytest
from django.utils import timezone

from gradient.scheduling.models import (
    BuildAttempt,
    BuildStatus,
    CandidateScore,
    DerivationBuild,
    DispatchedJob,
    Evaluation,
    EvaluationStatus,
)
from gradient.scheduling.services import graph
from gradient.workers.models import IdleSlot, WorkerSession
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, build, build_id_of, diamond, drv, evaluate, job_json

pytestmark = pytest.mark.django_db


def test_a_worker_gets_the_queued_evaluation_of_its_project_with_all_three_steps() -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, repository="sim:diamond", commit="c0ffee")
    worker = connected_worker([project])
    a = ask(worker.id, "flake")
    assert a is not None and a.job_key == f"eval:{evaluation.id}"
    assert job_json(a)["steps"] == ["FetchFlake", "EvaluateFlake", "EvaluateDerivations"]
    assert job_json(a)["source"] == {
        "kind": "repository",
        "url": "sim:diamond",
        "commit": "c0ffee",
    }
    assert msgspec.to_builtins(a.message())["type"] == "AssignJob" and a.message().cluster is None
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.FETCHING
    row = DispatchedJob.objects.get(id=a.assignment_id)
    assert row.score == a.score.total and set(row.score_breakdown) >= {"WaitTime", "EstimatedTime", "Qos"}


def test_a_worker_never_gets_an_evaluation_of_a_project_it_is_not_authorized_for() -> None:
    EvaluationFactory(project=ProjectFactory())
    worker = connected_worker([ProjectFactory()])
    assert ask(worker.id, "flake") is None
    assert IdleSlot.objects.filter(worker=worker, kind="eval").exists()


def test_an_unanswered_request_is_remembered_as_an_idle_slot_and_an_assignment_clears_it() -> None:
    project = ProjectFactory()
    worker = connected_worker([project])
    assert ask(worker.id, "flake") is None
    assert IdleSlot.objects.filter(worker=worker, kind="eval").count() == 1
    EvaluationFactory(project=project)
    assert ask(worker.id, "flake") is not None
    assert not IdleSlot.objects.filter(worker=worker, kind="eval").exists()


def test_a_draining_or_disconnected_worker_gets_nothing() -> None:
    project = ProjectFactory()
    EvaluationFactory(project=project)
    draining = connected_worker([project])
    WorkerSession.objects.filter(worker=draining).update(draining=True)
    assert ask(draining.id, "flake") is None
    gone = connected_worker([project])
    WorkerSession.objects.filter(worker=gone).update(closed_at=timezone.now())
    assert ask(gone.id, "flake") is None
    assert DispatchedJob.objects.count() == 0


def _building_evaluation(project, derivations):  # type: ignore[no-untyped-def]
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=derivations, now=timezone.now())
    return evaluation


def test_a_build_for_an_architecture_no_worker_has_is_never_assigned() -> None:
    project = ProjectFactory()
    _building_evaluation(project, [drv("arm", system="aarch64-linux")])
    worker = connected_worker([project], architectures=["x86_64-linux"])
    assert ask(worker.id) is None
    assert DerivationBuild.objects.get().status == BuildStatus.QUEUED


def test_a_build_needs_every_required_feature_and_builtin_skips_the_system_check() -> None:
    project = ProjectFactory()
    _building_evaluation(project, [drv("kvm", features=["kvm"]), drv("fetch", system="builtin")])
    worker = connected_worker([project], architectures=["riscv64-linux"], system_features=[])
    a = ask(worker.id)
    assert a is not None and job_json(a)["requirement"]["architecture"] == "builtin"
    assert ask(worker.id) is None  # one slot by default, and kvm is unmet anyway
    kvm_worker = connected_worker([project], architectures=["x86_64-linux"], system_features=["kvm", "big"])
    b = ask(kvm_worker.id)
    assert b is not None and job_json(b)["requirement"]["required_features"] == ["kvm"]


def test_builds_are_handed_out_in_dependency_order() -> None:
    project = ProjectFactory()
    evaluation = _building_evaluation(project, diamond())
    worker = connected_worker([project], max_concurrent_builds=4)
    order = []
    while (a := ask(worker.id)) is not None:
        order.append(job_json(a)["builds"][0]["drv_path"].rsplit("-", 1)[1])
        build(worker.id, a)
        if len(order) > 10:
            break
    assert order[0] == "a.drv" and order[-1] == "d.drv" and sorted(order[1:3]) == ["b.drv", "c.drv"]
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.COMPLETED


def test_a_full_worker_gets_no_more_builds_and_keeps_no_idle_slot() -> None:
    project = ProjectFactory()
    _building_evaluation(project, [drv("x"), drv("y")])
    worker = connected_worker([project], max_concurrent_builds=1)
    assert ask(worker.id) is not None
    assert ask(worker.id) is None
    assert not IdleSlot.objects.filter(worker=worker).exists()


def test_the_claim_marks_the_build_building_with_a_running_attempt() -> None:
    project = ProjectFactory()
    _building_evaluation(project, [drv("solo")])
    worker = connected_worker([project])
    a = ask(worker.id)
    assert a is not None
    b = DerivationBuild.objects.get()
    assert (b.status, b.attempts) == (BuildStatus.BUILDING, 1)
    attempt = BuildAttempt.objects.get(build=b)
    assert (attempt.number, attempt.outcome, attempt.dispatched_job_id) == (1, "Running", a.assignment_id)


def test_the_worker_with_the_outputs_already_wins_over_a_worse_candidate_by_score() -> None:
    project = ProjectFactory()
    _building_evaluation(project, [drv("big"), drv("small")])
    worker = connected_worker([project])
    big = DerivationBuild.objects.get(drv_path__endswith="big.drv")
    small = DerivationBuild.objects.get(drv_path__endswith="small.drv")
    now = timezone.now()
    CandidateScore.objects.create(
        worker=worker, job_id=big.job_key, missing_count=9, missing_nar_size=50 * 2**30, updated_at=now
    )
    CandidateScore.objects.create(
        worker=worker, job_id=small.job_key, missing_count=0, missing_nar_size=0, updated_at=now
    )
    a = ask(worker.id)
    assert a is not None and a.job_key == small.job_key
    assert a.score.breakdown["EstimatedTime"] == 3600


def test_an_eval_only_worker_being_idle_splits_the_evaluation_into_fetch_and_a_cached_follow_up() -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, repository="sim:chain?n=2")
    fetcher = connected_worker([project], can_fetch=True, can_eval=True)
    evaluator = connected_worker([project], can_fetch=False, can_eval=True)
    assert ask(evaluator.id, "flake") is None  # it cannot fetch
    fetch = ask(fetcher.id, "flake")
    assert fetch is not None and job_json(fetch)["steps"] == ["FetchFlake"]
    from tests.scheduling_helpers import report, update

    update(fetcher.id, fetch, kind="fetching")
    update(
        fetcher.id,
        fetch,
        kind="fetch_result",
        flake_source="/nix/store/00000000000000000000000000000src-source",
    )
    report(fetcher.id, fetch, "JobCompleted", elapsed_ms=3)
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.QUEUED and evaluation.followup_pending
    follow = ask(evaluator.id, "flake")
    assert follow is not None and follow.job_key == fetch.job_key
    assert job_json(follow)["steps"] == ["EvaluateFlake", "EvaluateDerivations"]
    assert job_json(follow)["source"] == {
        "kind": "cached",
        "store_path": "/nix/store/00000000000000000000000000000src-source",
    }
    evaluate(evaluator.id, follow, [drv("one"), drv("two", "one")])
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.BUILDING and not evaluation.followup_pending


def test_a_fetch_only_job_completing_without_a_source_fails_the_evaluation() -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project)
    fetcher = connected_worker([project], can_fetch=True, can_eval=True)
    connected_worker([project], can_fetch=False, can_eval=True)
    fetch = ask(fetcher.id, "flake")
    assert fetch is not None and job_json(fetch)["steps"] == ["FetchFlake"]
    from tests.scheduling_helpers import report

    report(fetcher.id, fetch, "JobCompleted", elapsed_ms=3)
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.FAILED
    assert "without a flake_source" in evaluation.errors[-1]


def test_an_evaluation_whose_outputs_are_all_cached_completes_without_building() -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project)
    worker = connected_worker([project])
    a = ask(worker.id, "flake")
    assert a is not None
    evaluate(worker.id, a, [drv("c1", cached=True), drv("c2", "c1", cached=True)])
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.COMPLETED
    assert set(DerivationBuild.objects.values_list("status", flat=True)) == {BuildStatus.SUBSTITUTED}
    assert Evaluation.objects.get().finished_at is not None


def _every_candidate(state, now, scores):  # type: ignore[no-untyped-def]
    """Every build the worker may take, as scoring sees it with its scores (job key -> missing NAR size
    and count): what RequestJob would rank if it loaded everything."""
    from gradient.scheduling import selectors
    from gradient.scheduling.decisions.scoring import Candidate

    return [
        Candidate(
            job_id=b.job_key,
            kind="build",
            waited_secs=(now - b.queued_at).total_seconds(),
            prioritized=b.prioritized,
            missing_nar_size=scores[b.job_key][0] if b.job_key in scores else None,
            missing_count=scores[b.job_key][1] if b.job_key in scores else None,
        )
        for b in selectors.queued_builds(state, now)
    ]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_preselection_picks_the_same_build_as_scoring_every_pending_build(seed: int) -> None:
    """RequestJob loads only the builds that can win; the winner equals the full scoring's."""
    import random
    from datetime import timedelta

    from gradient.scheduling import selectors
    from gradient.scheduling.decisions.scoring import rank
    from gradient.scheduling.services.assignment import _worker_view

    rng = random.Random(seed)
    project = ProjectFactory()
    evaluation = _building_evaluation(project, [drv(f"p{i}") for i in range(700)])
    now = timezone.now()
    builds = list(DerivationBuild.objects.all())
    for b in builds:
        b.queued_at = now - timedelta(seconds=rng.choice([5, 50, 500, 5000, 50000]) + rng.random())
        b.prioritized = rng.random() < 0.01
    DerivationBuild.objects.bulk_update(builds, ["queued_at", "prioritized"])
    worker = connected_worker([project])
    for b in rng.sample(builds, 40):
        CandidateScore.objects.create(
            worker=worker,
            job_id=b.job_key,
            missing_count=1,
            missing_nar_size=rng.choice([0, 10**6, 10**10]),
            updated_at=now,
        )
    state = selectors.worker_state(worker.id)
    assert state is not None
    scores = {
        s.job_id: (s.missing_nar_size, s.missing_count) for s in CandidateScore.objects.filter(worker=worker)
    }
    everything = _every_candidate(state, now, scores)
    expected = rank(everything, _worker_view(state), selectors.pool_view(now))[0]
    from gradient.scheduling.services.assignment import request_job

    handed = request_job(worker_id=worker.id, protocol_kind="build", now=now)
    assert handed is not None and handed.job_key == expected.job_id
    assert evaluation.build_links.count() == 700


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_a_worker_that_scored_hundreds_gets_the_best_by_its_scores_from_the_best_few(seed: int) -> None:
    """A scoring worker's RequestJob loads the heads and only the best PRESELECT of its scored builds by
    their score (in SQL, on PostgreSQL): the winner, and the best of the scored ones in their order, are
    what scoring every pending build gives."""
    import random

    from django.db import connection

    from gradient.scheduling import selectors
    from gradient.scheduling.decisions.scoring import download_mbps, mean_wait_secs, rank
    from gradient.scheduling.services.assignment import _worker_view, request_job

    rng = random.Random(seed)
    project = ProjectFactory()
    _building_evaluation(project, [drv(f"s{i}") for i in range(600)])
    now = timezone.now()
    builds = list(DerivationBuild.objects.all())
    for b in builds:
        b.queued_at = now - timedelta(seconds=rng.choice([5, 50, 500, 5000]) + rng.random())
        b.prioritized = rng.random() < 0.02
    DerivationBuild.objects.bulk_update(builds, ["queued_at", "prioritized"])
    worker = connected_worker([project])
    # Most of the queue scored, the oldest builds needing the most: the best by score is no head.
    for b in builds[:450]:
        waited = (now - b.queued_at).total_seconds()
        CandidateScore.objects.create(
            worker=worker,
            job_id=b.job_key,
            missing_count=1,
            missing_nar_size=int(waited * 10**6) + rng.choice([0, 10**9, 10**11]),
            updated_at=now,
        )
    state = selectors.worker_state(worker.id)
    assert state is not None
    scores = {
        s.job_id: (s.missing_nar_size, s.missing_count) for s in CandidateScore.objects.filter(worker=worker)
    }
    view, pool = _worker_view(state), selectors.pool_view(now)
    everything = _every_candidate(state, now, scores)
    if connection.vendor == "postgresql":
        by_score = selectors.ScoredPreselect(mean_wait_secs(pool), download_mbps(view), 0)
        best = selectors._best_scored_heads(state, now, by_score, selectors.PRESELECT)
        assert len(best) == selectors.PRESELECT  # not all 450
        ranked_scored = [s.job_id for s in rank([c for c in everything if c.job_id in scores], view, pool)]
        assert [f"build:{row[0]}" for row in best] == ranked_scored[: selectors.PRESELECT]
    expected = rank(everything, view, pool)[0]
    handed = request_job(worker_id=worker.id, protocol_kind="build", now=now)
    assert handed is not None and handed.job_key == expected.job_id


def test_the_best_scored_builds_no_evaluation_wants_are_passed_over_for_those_behind_them() -> None:
    """The worker's 300 best-scored builds belong to an evaluation that ended (still Queued, wanted by
    none): the preselection, which checks only its best 256 against the evaluations at first, reads
    them all and finds the wanted ones behind, in scoring's order."""
    from django.db import connection

    from gradient.scheduling import selectors
    from gradient.scheduling.decisions.scoring import download_mbps, mean_wait_secs, rank
    from gradient.scheduling.services.assignment import _worker_view

    if connection.vendor != "postgresql":
        pytest.skip("the preselection in SQL is PostgreSQL's")
    project = ProjectFactory()
    ended = _building_evaluation(project, [drv(f"old{i}") for i in range(300)])
    _building_evaluation(project, [drv(f"new{i}") for i in range(80)])
    Evaluation.objects.filter(id=ended.id).update(status=EvaluationStatus.FAILED)
    worker = connected_worker([project])
    now = timezone.now()
    for i, b in enumerate(DerivationBuild.objects.order_by("drv_path")):
        # Every old build needs nothing (the best scores), the new ones more and more.
        needed = 0 if b.drv_path.split("-", 1)[-1].startswith("old") else (i + 1) * 10**8
        CandidateScore.objects.create(
            worker=worker, job_id=b.job_key, missing_count=1, missing_nar_size=needed, updated_at=now
        )
    state = selectors.worker_state(worker.id)
    assert state is not None
    scores = {
        s.job_id: (s.missing_nar_size, s.missing_count) for s in CandidateScore.objects.filter(worker=worker)
    }
    view, pool = _worker_view(state), selectors.pool_view(now)
    by_score = selectors.ScoredPreselect(mean_wait_secs(pool), download_mbps(view), 0)
    best = selectors._best_scored_heads(state, now, by_score, selectors.PRESELECT)
    wanted = [s.job_id for s in rank(_every_candidate(state, now, scores), view, pool)]
    assert len(wanted) == 80
    assert [f"build:{row[0]}" for row in best] == wanted[: selectors.PRESELECT]


def test_rescore_wait_holds_an_offered_unscored_build_back_for_up_to_four_passes(settings) -> None:  # type: ignore[no-untyped-def]
    from datetime import timedelta

    from gradient.scheduling.services.assignment import request_job
    from gradient.scheduling.services.offers import job_list

    settings.GRADIENT_SCHEDULER_PASS_INTERVAL_SECS = 5
    project = ProjectFactory()
    _building_evaluation(project, [drv("offered")])
    worker = connected_worker([project])
    offered_at = timezone.now()
    job_list(worker_id=worker.id, now=offered_at)  # the build is offered; the worker has not scored it
    CandidateScore.objects.create(  # but it is a worker that scores its offers
        worker=worker,
        job_id="build:00000000-0000-0000-0000-000000000000",
        missing_count=0,
        missing_nar_size=0,
        updated_at=offered_at,
    )
    for passes in (0, 3):
        at = offered_at + timedelta(seconds=5 * passes + 1)
        assert request_job(worker_id=worker.id, protocol_kind="build", now=at) is None, passes
    a = request_job(worker_id=worker.id, protocol_kind="build", now=offered_at + timedelta(seconds=21))
    assert a is not None, "after four passes without a score it is handed out anyway"


def test_a_scored_or_never_offered_build_is_not_held_back() -> None:
    from gradient.scheduling.services.offers import job_list

    project = ProjectFactory()
    _building_evaluation(project, [drv("scored")])
    worker = connected_worker([project])
    job_list(worker_id=worker.id, now=timezone.now())
    build_ = DerivationBuild.objects.get()
    CandidateScore.objects.create(
        worker=worker, job_id=build_.job_key, missing_count=0, missing_nar_size=0, updated_at=timezone.now()
    )
    assert ask(worker.id) is not None
    other = connected_worker([project])
    _building_evaluation(project, [drv("fresh")])
    assert ask(other.id) is not None, "never offered to this worker: nothing to wait for"
    silent = connected_worker([project])
    _building_evaluation(project, [drv("unscored")])
    job_list(worker_id=silent.id, now=timezone.now())
    assert ask(silent.id) is not None, "a worker that never scores is not held back"


def test_a_claimed_job_leaves_each_sent_set_with_the_next_offer_and_a_finished_one_the_scores() -> None:
    from gradient.scheduling.models import SentCandidate
    from gradient.scheduling.services.offers import job_list, job_offers

    project = ProjectFactory()
    _building_evaluation(project, [drv("claimed"), drv("other")])
    first, second = connected_worker([project]), connected_worker([project])
    now = timezone.now()
    for worker in (first, second):
        job_list(worker_id=worker.id, now=now)
        for b in DerivationBuild.objects.all():
            CandidateScore.objects.create(
                worker=worker, job_id=b.job_key, missing_count=0, missing_nar_size=0, updated_at=now
            )
    a = ask(first.id)
    assert a is not None
    # The claim deletes no sent rows (one per worker offered the build, on every claim); each worker's
    # next delta drops the builds no longer visible.
    for worker in (first, second):
        assert job_offers(worker_id=worker.id, now=timezone.now()) == []
    assert not SentCandidate.objects.filter(job_id=a.job_key).exists()
    assert CandidateScore.objects.filter(job_id=a.job_key).count() == 2, "scores stay while it runs"
    build(first.id, a)
    assert not CandidateScore.objects.filter(job_id=a.job_key).exists(), "finished: nobody's candidate"
    other = DerivationBuild.objects.exclude(id=build_id_of(a)).get()
    assert CandidateScore.objects.filter(job_id=other.job_key).count() == 2, "other jobs keep theirs"
    assert SentCandidate.objects.filter(job_id=other.job_key).count() == 2


def test_a_batch_of_requests_claims_distinct_builds_at_once_and_never_more_than_a_worker_has_slots() -> None:
    from gradient.scheduling.services.assignment import request_builds

    project = ProjectFactory()
    _building_evaluation(project, [drv(f"b{k}") for k in range(6)])
    one = connected_worker([project], max_concurrent_builds=1)
    two = connected_worker([project], max_concurrent_builds=2)
    busy = connected_worker([project], max_concurrent_builds=1)
    stranger = connected_worker([ProjectFactory()], max_concurrent_builds=1)
    assert ask(busy.id) is not None  # its one slot taken before the batch

    tried: list[uuid.UUID] = []
    asked = [one.id, two.id, two.id, busy.id, one.id, stranger.id]
    answers = request_builds(worker_ids=asked, now=timezone.now(), tried=tried)

    handed = {i: a for i, a in enumerate(answers) if a is not None}
    assert sorted(handed) == [0, 1, 2]  # `one` once, `two` twice; `busy` full, `stranger` unauthorized
    assert len({a.job_key for a in handed.values()}) == 3
    for index, a in handed.items():
        row = DispatchedJob.objects.get(id=a.assignment_id)
        assert (row.worker_id, row.finished_at, row.job_id) == (asked[index], None, a.job_key)
        b = DerivationBuild.objects.get(id=row.derivation_build_id)
        assert (b.status, b.attempts) == (BuildStatus.BUILDING, 1)
        assert BuildAttempt.objects.get(build=b).dispatched_job_id == a.assignment_id
    assert {a.assignment_id for a in handed.values()} <= set(tried)
    assert DerivationBuild.objects.filter(status=BuildStatus.QUEUED).count() == 2
    # A worker whose request went unanswered for want of work is an idle slot; a full one is not.
    assert IdleSlot.objects.filter(worker=stranger).exists()
    assert not IdleSlot.objects.filter(worker__in=[one, two, busy]).exists()


def test_stale_metrics_do_not_hold_a_worker_back() -> None:
    """Issue 34, item 9: CPU > 80 % reported a minute and more ago is unknown to scoring; the same
    report fresh keeps the build off the worker (ResourceSaturation)."""
    project = ProjectFactory()
    _building_evaluation(project, [drv("solo")])
    fresh = connected_worker([project], cpu_usage_pct=95.0, metrics_at=timezone.now())
    assert ask(fresh.id) is None
    stale = connected_worker([project], cpu_usage_pct=95.0, metrics_at=timezone.now() - timedelta(seconds=61))
    a = ask(stale.id)
    assert a is not None and job_json(a)["builds"][0]["drv_path"].endswith("-solo.drv")


@pytest.mark.django_db
def test_the_pool_view_is_the_mean_wait_of_the_last_hour_and_the_idle_fetchers() -> None:
    """selectors.pool_view's one statement (PostgreSQL) says what its definition says: the mean wait of
    the hand-outs of the last hour (an older one and one without a queued time left out), and how many
    open sessions of fetch-capable workers there are and how many of them run nothing."""
    from gradient.scheduling import selectors
    from tests.factories import DispatchedJobFactory

    now = timezone.now()
    busy = connected_worker(can_fetch=True)
    connected_worker(can_fetch=True)  # idle
    connected_worker(can_fetch=False)  # not a fetcher
    DispatchedJobFactory(
        worker=busy, queued_at=now - timedelta(seconds=30), dispatched_at=now - timedelta(seconds=10)
    )
    closed = DispatchedJobFactory(
        worker=busy, queued_at=now - timedelta(seconds=100), dispatched_at=now - timedelta(seconds=60)
    )
    closed.finished_at, closed.outcome = now, "completed"
    closed.save()
    DispatchedJobFactory(worker=busy, queued_at=None, dispatched_at=now - timedelta(seconds=5))
    old = DispatchedJobFactory(
        worker=busy, queued_at=now - timedelta(hours=3), dispatched_at=now - timedelta(hours=2)
    )
    old.finished_at, old.outcome = now, "completed"
    old.save()
    view = selectors._pool_view(now)
    assert view.mean_wait_secs == pytest.approx((20 + 40) / 2)
    assert (view.fetch_workers_total, view.fetch_workers_idle) == (2, 1)


def test_a_claim_batch_does_not_wait_for_the_pool_view_it_reads_again(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Once a second the pool view is read again; given a way to run it elsewhere (a serve's claim
    batches: another thread of the claims lane), the caller gets the one it had at once and the read
    happens there, one at a time; without one it is read in place, as before."""
    import time

    from gradient.scheduling import selectors
    from gradient.scheduling.decisions.scoring import PoolView

    reads: list[int] = []

    def read(now):  # type: ignore[no-untyped-def]
        reads.append(1)
        return PoolView(mean_wait_secs=float(len(reads)))

    monkeypatch.setattr(selectors, "_pool_view", read)
    monkeypatch.setattr(selectors, "_pool_cache", None)
    now = timezone.now()
    queued: list = []  # type: ignore[type-arg]
    first = selectors.pool_view(now, background=queued.append)
    assert first.mean_wait_secs == 1.0 and not queued, "nothing kept yet: read in place"
    assert selectors.pool_view(now, background=queued.append) is first and not queued, "fresh: kept"
    stale_at = time.monotonic() - 2 * selectors._POOL_CACHE_SECS
    monkeypatch.setattr(selectors, "_pool_cache", (stale_at, first))
    assert selectors.pool_view(now, background=queued.append) is first, "stale: the kept one at once"
    assert selectors.pool_view(now, background=queued.append) is first
    assert len(queued) == 1 and reads == [1], "one read again, elsewhere, not yet run"
    queued[0]()
    assert selectors.pool_view(now, background=queued.append).mean_wait_secs == 2.0
    monkeypatch.setattr(selectors, "_pool_cache", (stale_at, first))
    assert selectors.pool_view(now).mean_wait_secs == 3.0, "no way to read elsewhere: read in place"


@pytest.mark.django_db
def test_a_workers_state_in_one_statement_is_the_one_the_orm_reads() -> None:
    """selectors.worker_state's fixed statement (PostgreSQL) reads what worker_states reads with the
    ORM: the worker's row, its open session, draining or not, its projects; nothing for a worker whose
    session is closed or that is not active."""
    from gradient.scheduling import selectors

    now = timezone.now()
    projects = [ProjectFactory(), ProjectFactory()]
    worker = connected_worker(projects, cpu_count=12, architectures=["x86_64-linux", "aarch64-linux"])
    WorkerSession.objects.filter(worker=worker).update(draining=True)
    one = selectors.worker_state(worker.id, now)
    orm = selectors.worker_states([worker.id], now, orm=True)[worker.id]
    assert one is not None
    assert (one.session_id, one.draining, one.project_ids) == (orm.session_id, True, orm.project_ids)
    assert one.project_ids == frozenset(p.id for p in projects)
    fields = [f.attname for f in type(one.worker)._meta.concrete_fields]
    assert [getattr(one.worker, f) for f in fields] == [getattr(orm.worker, f) for f in fields]
    WorkerSession.objects.filter(worker=worker).update(closed_at=now)
    assert selectors.worker_state(worker.id, now) is None
    inactive = connected_worker(projects, active=False)
    assert selectors.worker_state(inactive.id, now) is None


@pytest.mark.django_db
def test_many_workers_states_in_one_statement_are_those_the_orm_reads() -> None:
    """selectors.worker_states' fixed statement (PostgreSQL; the batches of offers and job lists) reads
    what its ORM queries read; a worker without an open session or not active is left out."""
    from gradient.scheduling import selectors

    now = timezone.now()
    projects = [ProjectFactory(), ProjectFactory()]
    busy = connected_worker(projects, cpu_count=12, architectures=["x86_64-linux", "aarch64-linux"])
    plain = connected_worker([projects[0]])
    WorkerSession.objects.filter(worker=plain).update(draining=True)
    closed = connected_worker(projects)
    WorkerSession.objects.filter(worker=closed).update(closed_at=now)
    inactive = connected_worker(projects, active=False)
    ids = [busy.id, plain.id, closed.id, inactive.id, uuid.uuid4()]
    sql, orm = selectors.worker_states(ids, now), selectors.worker_states(ids, now, orm=True)
    assert set(sql) == set(orm) == {busy.id, plain.id}
    fields = [f.attname for f in type(sql[busy.id].worker)._meta.concrete_fields]
    for worker_id, state in sql.items():
        expected = orm[worker_id]
        assert (state.session_id, state.draining, state.project_ids) == (
            expected.session_id,
            expected.draining,
            expected.project_ids,
        )
        assert [getattr(state.worker, f) for f in fields] == [getattr(expected.worker, f) for f in fields]
