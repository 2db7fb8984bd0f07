"""Where a waiting job stands (spec/rest.md): the `queue` object of GET /api/v1/builds/{id} and
/api/v1/evaluations/{id}, an evaluation's `expected_finish`, and the schema that documents them."""

from __future__ import annotations

import random
from datetime import datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.db.models import F
from django.utils import timezone
from rest_framework.test import APIClient

from gradient.core.vocab import BuildAttemptOutcome
from gradient.scheduling import queue_position, selectors
from gradient.scheduling.decisions.scoring import Candidate, WorkerView, rank
from gradient.scheduling.models import BuildAttempt, DerivationBuild, Evaluation, EvaluationStatus
from gradient.scheduling.services import graph
from tests.factories import DerivationBuildFactory, EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, build, build_id_of, drv
from tests.support.rest import client

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def setup():  # type: ignore[no-untyped-def]
    project = ProjectFactory(name="nixpkgs-ci")
    member = User.objects.create_user("member", password="pw-member-1")
    project.members.add(member)
    staff = User.objects.create_user("staff", password="pw-staff-1", is_staff=True)
    return project, member, staff


def queued(project, *derivations):  # type: ignore[no-untyped-def]
    """An evaluation of `project` that needs these derivations (none depending on another): Queued
    builds, queued one second apart in the order given."""
    evaluation = Evaluation.objects.create(
        project=project, repository="sim:x", commit="1", status=EvaluationStatus.BUILDING
    )
    graph.ingest_eval_result(evaluation=evaluation, derivations=list(derivations), now=timezone.now())
    start = timezone.now() - timedelta(minutes=5)
    builds = []
    for i, d in enumerate(derivations):
        build = DerivationBuild.objects.get(drv_path=d["drv_path"])
        assert build.status == "Queued"
        DerivationBuild.objects.filter(id=build.id).update(queued_at=start + timedelta(seconds=i))
        builds.append(build)
    return evaluation, builds


def queue_of(c: APIClient, build: DerivationBuild) -> dict | None:  # type: ignore[type-arg]
    response = c.get(f"/api/v1/builds/{build.id}")
    assert response.status_code == 200, response.content
    return response.json()["queue"]  # type: ignore[no-any-return]


def test_positions_follow_the_hand_out_order_and_the_head_is_handed_out_next(setup) -> None:  # type: ignore[no-untyped-def]
    project, member, staff = setup
    worker = connected_worker([project])
    # Queued first, but no plain build's worker need have the feature: it is behind none of them.
    _, (big,) = queued(project, drv("big", features=["big-parallel"]))
    _, (b1, b2, b3, b4) = queued(project, drv("one"), drv("two"), drv("three"), drv("four"))
    assert client(staff).post(f"/api/v1/builds/{b3.id}/prioritize").status_code == 202
    c = client(member)
    order = [b3, b1, b2, b4]
    standings = [queue_of(c, b) for b in order]
    assert [s["position"] for s in standings] == [1, 2, 3, 4]  # type: ignore[index]
    assert all(s["ahead"] == s["position"] - 1 for s in standings)  # type: ignore[index]
    assert all((s["slots"], s["busy"]) == (1, 0) for s in standings)  # type: ignore[index]
    # Every worker that can build `big` can build the plain ones: the prioritized one is ahead of it.
    assert queue_of(c, big) == {
        **standings[1],
        "slots": 0,
        "expected_start": None,
        "expected_finish": None,
        "basis": "none",
    }

    a = ask(worker.id)
    assert a is not None and build_id_of(a) == str(b3.id)
    assert queue_of(c, b3) is None  # Building: no longer waiting
    after = [queue_of(c, b) for b in (b1, b2, b4)]
    assert [s["position"] for s in after] == [1, 2, 3]  # type: ignore[index]
    assert all((s["slots"], s["busy"]) == (1, 1) for s in after)  # type: ignore[index]


def test_waits_past_the_cap_tie_and_go_by_id(setup) -> None:  # type: ignore[no-untyped-def]
    project, member, _ = setup
    worker = connected_worker([project])
    _, builds = queued(project, drv("old-a"), drv("old-b"), drv("old-c"))
    # Far past the WaitTime cap (4000 mean waits of 60 s): every wait scores the same.
    long_ago = timezone.now() - timedelta(days=30)
    for i, b in enumerate(reversed(builds)):
        DerivationBuild.objects.filter(id=b.id).update(queued_at=long_ago + timedelta(hours=i))
    by_id = sorted(builds, key=lambda b: str(b.id))
    c = client(member)
    assert [queue_of(c, b)["position"] for b in by_id] == [1, 2, 3]  # type: ignore[index]
    a = ask(worker.id)
    assert a is not None and build_id_of(a) == str(by_id[0].id)


def test_the_estimate_rests_on_nothing_the_default_or_the_derivation(setup, settings) -> None:  # type: ignore[no-untyped-def]
    project, member, _ = setup
    settings.GRADIENT_ETA_DEFAULT_BUILD_SECS = 600
    c = client(member)
    _, (arm,) = queued(project, drv("arm-only", system="aarch64-linux"))
    none = queue_of(c, arm)
    assert none == {
        "position": 1,
        "ahead": 0,
        "slots": 0,
        "busy": 0,
        "expected_start": None,
        "expected_finish": None,
        "basis": "none",
    }

    connected_worker([project])
    _, (hello,) = queued(project, {**drv("hello-2.12"), "drv_path": f"/nix/store/{'a' * 32}-hello-2.12.drv"})
    default = queue_of(c, hello)
    assert default is not None and default["basis"] == "default" and default["slots"] == 1
    start, finish = (datetime.fromisoformat(default[k]) for k in ("expected_start", "expected_finish"))
    assert finish - start == timedelta(seconds=600)
    assert abs((start - timezone.now()).total_seconds()) < 30  # a free slot: it starts now

    # An earlier try of hello-2.12 (another store hash, the same name and system) took 100 s.
    earlier = DerivationBuildFactory(drv_path=f"/nix/store/{'z' * 32}-hello-2.12.drv", status="Completed")
    ended = timezone.now() - timedelta(hours=1)
    BuildAttempt.objects.create(
        build=earlier,
        number=1,
        outcome=BuildAttemptOutcome.BUILT,
        started_at=ended - timedelta(seconds=100),
        finished_at=ended,
    )
    derivation = queue_of(c, hello)
    assert derivation is not None and derivation["basis"] == "derivation"
    start, finish = (datetime.fromisoformat(derivation[k]) for k in ("expected_start", "expected_finish"))
    assert finish - start == timedelta(seconds=100)


def test_the_project_basis_when_only_other_derivations_of_the_project_ran(setup) -> None:  # type: ignore[no-untyped-def]
    project, member, _ = setup
    connected_worker([project])
    _, (ran, waiting) = queued(project, drv("ran"), drv("waiting"))
    ended = timezone.now() - timedelta(hours=1)
    DerivationBuild.objects.filter(id=ran.id).update(status="Completed")
    BuildAttempt.objects.create(
        build=ran,
        number=1,
        outcome=BuildAttemptOutcome.BUILT,
        started_at=ended - timedelta(seconds=42),
        finished_at=ended,
    )
    got = queue_of(client(member), waiting)
    assert got is not None and got["basis"] == "project" and got["position"] == 1
    start, finish = (datetime.fromisoformat(got[k]) for k in ("expected_start", "expected_finish"))
    assert finish - start == timedelta(seconds=42)


def test_evaluations_stand_in_their_own_order_and_a_building_one_says_when_it_ends(setup) -> None:  # type: ignore[no-untyped-def]
    project, member, _ = setup
    worker = connected_worker([project])
    first = EvaluationFactory(project=project)
    second = EvaluationFactory(project=project)
    Evaluation.objects.filter(id=second.id).update(priority=True)
    c = client(member)

    def read(e: Evaluation) -> dict:  # type: ignore[type-arg]
        response = c.get(f"/api/v1/evaluations/{e.id}")
        assert response.status_code == 200, response.content
        return response.json()  # type: ignore[no-any-return]

    assert read(second)["queue"]["position"] == 1 and read(first)["queue"]["position"] == 2
    assert read(first)["queue"]["ahead"] == 1 and read(first)["queue"]["slots"] == 1
    assert read(first)["queue"]["basis"] == "default" and read(first)["expected_finish"] is None
    a = ask(worker.id, "flake")
    assert a is not None and a.job_key == second.job_key

    building, _ = queued(project, drv("x1"), drv("x2"))
    body = read(building)
    assert body["queue"] is None and body["expected_finish"] is not None
    listed = c.get("/api/v1/evaluations").json()["results"]
    assert all(e["queue"] is None for e in listed)


def test_the_schema_documents_the_queue_object(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, staff = setup
    schema = client(staff).get("/api/schema/", {"format": "json"}).json()
    components = schema["components"]["schemas"]
    assert set(components["Queue"]["properties"]) == {
        "position",
        "ahead",
        "slots",
        "busy",
        "expected_start",
        "expected_finish",
        "basis",
    }
    for holder in ("Build", "Evaluation"):
        assert "queue" in components[holder]["properties"], holder
    assert "expected_finish" in components["Evaluation"]["properties"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_positions_are_the_ranking_of_a_worker_without_scores(setup, seed) -> None:  # type: ignore[no-untyped-def]
    """Against scoring.rank itself: prioritized or not, waits below and past the cap, equal wait starts."""
    project, _, _ = setup
    rng = random.Random(seed)
    names = [f"r{seed}-{i}" for i in range(10)]
    _, builds = queued(project, *(drv(n) for n in names))
    now = timezone.now()
    starts = [now - timedelta(days=30), now - timedelta(days=20), now - timedelta(seconds=90)]
    for b in builds:
        start = rng.choice([*starts, now - timedelta(seconds=rng.randint(1, 3600 * 3))])
        DerivationBuild.objects.filter(id=b.id).update(queued_at=start, prioritized=rng.random() < 0.3)
    fresh = list(DerivationBuild.objects.filter(id__in=[b.id for b in builds]))
    pool = selectors.pool_view(now)
    ranked = rank(
        [
            Candidate(
                job_id=b.job_key,
                kind="build",
                waited_secs=(now - (b.queued_at or b.created_at)).total_seconds(),
                prioritized=b.prioritized,
            )
            for b in fresh
        ],
        WorkerView(),
        pool,
    )
    expected = {s.job_id: i + 1 for i, s in enumerate(ranked)}
    got = {b.job_key: queue_position.build_position(b, now, [project.id]) for b in fresh}
    assert got == expected


def ended_try(name: str, secs: float, *, hash_char: str = "z") -> None:
    """An earlier, ended try of a derivation of `name` (another store hash) that took `secs`."""
    earlier = DerivationBuildFactory(drv_path=f"/nix/store/{hash_char * 32}-{name}.drv", status="Completed")
    ended = timezone.now() - timedelta(hours=1)
    BuildAttempt.objects.create(
        build=earlier,
        number=1,
        outcome=BuildAttemptOutcome.BUILT,
        started_at=ended - timedelta(seconds=secs),
        finished_at=ended,
    )


def test_a_builds_eta_falls_as_the_jobs_ahead_of_it_finish(setup) -> None:  # type: ignore[no-untyped-def]
    project, _, _ = setup
    worker = connected_worker([project])  # one build slot
    _, (b1, b2, b3, last) = queued(project, drv("one"), drv("two"), drv("three"), drv("last"))
    ended_try("last", 100.0)

    def delay() -> float:
        now = timezone.now()
        standing = queue_position.build_queue(DerivationBuild.objects.get(id=last.id), now)
        assert standing is not None and standing.basis == "derivation"
        assert standing.expected_start is not None
        return (standing.expected_start - now).total_seconds()

    delays = [delay()]  # 3 ahead, the slot free: the first takes it, two turn over, then half of one
    for expected_id in (b1.id, b2.id, b3.id):
        a = ask(worker.id)
        assert a is not None and build_id_of(a) == str(expected_id)
        delays.append(delay())
        build(worker.id, a)
        # Each took 100 s (the project's builds now say what the ones ahead last: their mean).
        BuildAttempt.objects.filter(build_id=expected_id).update(
            started_at=F("finished_at") - timedelta(seconds=100)
        )
    delays.append(delay())  # nothing ahead, the slot free: now
    assert delays == [250.0, 250.0, 150.0, 50.0, 0.0]


def building(project, *derivations):  # type: ignore[no-untyped-def]
    """A Building evaluation of `project` whose graph is these derivations."""
    evaluation = Evaluation.objects.create(
        project=project, repository="sim:x", commit="1", status=EvaluationStatus.BUILDING
    )
    graph.ingest_eval_result(evaluation=evaluation, derivations=list(derivations), now=timezone.now())
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.BUILDING
    return evaluation


def test_an_evaluations_expected_finish_follows_its_critical_path(setup, settings) -> None:  # type: ignore[no-untyped-def]
    project, _, _ = setup
    settings.GRADIENT_ETA_DEFAULT_BUILD_SECS = 60
    worker = connected_worker([project], max_concurrent_builds=8)
    # A chain c1 <- c2 <- c3 <- c4 and two builds on their own: 4 builds one after another on 8 slots.
    evaluation = building(
        project, drv("c1"), drv("c2", "c1"), drv("c3", "c2"), drv("c4", "c3"), drv("s1"), drv("s2")
    )

    def minutes_left() -> float:
        now = timezone.now()
        finish = queue_position.evaluation_expected_finish(evaluation, now)
        assert finish is not None
        return (finish - now).total_seconds() / 60

    assert minutes_left() == 4.0
    handed = {}
    while (a := ask(worker.id)) is not None:
        handed[build_id_of(a)] = a
    names = {str(b.id): b.name for b in DerivationBuild.objects.filter(id__in=[*handed])}
    assert sorted(names.values()) == ["c1", "s1", "s2"]
    for build_id, a in handed.items():
        build(worker.id, a)
        # Each try took 60 s, as the default said: the project's history keeps the typical time.
        BuildAttempt.objects.filter(build_id=build_id).update(
            started_at=F("finished_at") - timedelta(seconds=60)
        )
    # The chain's head and the two on their own are built: three builds left, one after another.
    assert minutes_left() == 3.0
    for _ in range(3):
        (a,) = [a for a in [ask(worker.id)] if a is not None]
        build(worker.id, a)
        BuildAttempt.objects.filter(build_id=build_id_of(a)).update(
            started_at=F("finished_at") - timedelta(seconds=60)
        )
        assert minutes_left() == float(
            len(
                DerivationBuild.objects.filter(
                    evaluation_links__evaluation_id=evaluation.id,
                    status__in=["Created", "Queued", "Building"],
                )
            )
        )


def test_the_work_over_few_slots_outweighs_a_short_critical_path(setup, settings) -> None:  # type: ignore[no-untyped-def]
    project, _, _ = setup
    settings.GRADIENT_ETA_DEFAULT_BUILD_SECS = 60
    connected_worker([project], max_concurrent_builds=2)
    evaluation = building(project, *(drv(f"w{i}") for i in range(6)), drv("top", "w0"))
    now = timezone.now()
    # A chain of 2, but 7 builds on 2 slots: 4 waves.
    assert queue_position.evaluation_expected_finish(evaluation, now) == now + timedelta(minutes=4)


def test_unknown_without_history_and_without_a_default(setup, settings) -> None:  # type: ignore[no-untyped-def]
    project, member, _ = setup
    settings.GRADIENT_ETA_DEFAULT_BUILD_SECS = 0
    connected_worker([project])
    evaluation, (waiting,) = queued(project, drv("neverbuilt"))
    got = queue_of(client(member), waiting)
    assert got is not None and (got["position"], got["slots"]) == (1, 1)
    assert (got["expected_start"], got["expected_finish"], got["basis"]) == (None, None, "none")
    assert (
        queue_position.evaluation_expected_finish(Evaluation.objects.get(id=evaluation.id), timezone.now())
        is None
    )
    ended_try("neverbuilt", 30.0)  # one try of its name ended: now there is a basis
    got = queue_of(client(member), waiting)
    assert got is not None and got["basis"] == "derivation" and got["expected_start"] is not None
