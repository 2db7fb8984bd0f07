"""What a waiting job waits for (issue 33, item 2): the slots that can run it, how many are busy and until
when (each running job's start plus its typical duration), and the cluster holding any of them (its
members running there, or a reservation keeping free ones for it). REST carries it as `busy_slots` beside
the `queue` object; the console's "where it stands" says it in words; a slot held for a waiting cluster
takes no single job, so the estimate counts it busy."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from gradient.clusters.models import ClusterAttempt, ClusterReservation
from gradient.core.vocab import BuildAttemptOutcome, JobKind
from gradient.scheduling import queue_position
from gradient.scheduling.models import BuildAttempt, DerivationBuild, DispatchedJob, Evaluation, Project
from gradient.workers.models import Worker
from tests.factories import ClusterJobFactory, EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, drv
from tests.support.rest import client
from tests.test_scheduling_queue_position import queued

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def project() -> Project:
    return ProjectFactory(name="slots-ci")


@pytest.fixture
def member(project: Project) -> User:
    user = User.objects.create_user("member", password="pw-member-1")
    project.members.add(user)
    return user


def project_try(project: Project, name: str, secs: float) -> None:
    """An ended try of a derivation of `name` (a store hash of its own) that an evaluation of `project`
    needed: the project's history."""
    path = f"/nix/store/{'h' * 32}-{name}.drv"
    _, (done,) = queued(project, {**drv(name), "drv_path": path})
    DerivationBuild.objects.filter(id=done.id).update(status="Completed")
    ended = timezone.now() - timedelta(hours=1)
    BuildAttempt.objects.create(
        build=done,
        number=1,
        outcome=BuildAttemptOutcome.BUILT,
        started_at=ended - timedelta(seconds=secs),
        finished_at=ended,
    )


def busy_slots(member: User, build: DerivationBuild) -> dict:  # type: ignore[type-arg]
    response = client(member).get(f"/api/v1/builds/{build.id}")
    assert response.status_code == 200, response.content
    return response.json()["busy_slots"]  # type: ignore[no-any-return]


def at(text: str | None) -> datetime:
    assert text is not None
    return datetime.fromisoformat(text)


def started(worker: Worker, ago_secs: float) -> DispatchedJob:
    """The worker takes the head of its queue; its claim is moved `ago_secs` into the past."""
    a = ask(worker.id)
    assert a is not None
    DispatchedJob.objects.filter(id=a.assignment_id).update(
        dispatched_at=timezone.now() - timedelta(seconds=ago_secs)
    )
    return DispatchedJob.objects.get(id=a.assignment_id)


def test_a_busy_slot_frees_at_its_jobs_start_plus_that_derivations_typical_time(
    project: Project, member: User
) -> None:
    project_try(project, "long", 100.0)
    project_try(project, "short", 10.0)
    one, other = connected_worker([project]), connected_worker([project])
    _, (long, short, waiting) = queued(project, drv("long"), drv("short"), drv("waiting"))
    first = started(one, 30.0)  # long: 100 s, 30 s of them gone
    second = started(other, 4.0)  # short: 10 s, 4 s gone
    assert (first.derivation_build_id, second.derivation_build_id) == (long.id, short.id)
    got = busy_slots(member, waiting)
    assert (got["held"], got["holders"]) == (0, [])
    assert at(got["next_free"]) == second.dispatched_at + timedelta(seconds=10)
    assert at(got["busy_until"]) == first.dispatched_at + timedelta(seconds=100)
    # The queue object itself is as spec/rest.md has it.
    queue = client(member).get(f"/api/v1/builds/{waiting.id}").json()["queue"]
    assert (queue["slots"], queue["busy"], queue["position"]) == (2, 2, 1)


def test_without_history_a_busy_slot_frees_after_the_default_and_not_at_all_without_one(
    project: Project,
    member: User,
    settings,  # type: ignore[no-untyped-def]
) -> None:
    settings.GRADIENT_ETA_DEFAULT_BUILD_SECS = 600
    worker = connected_worker([project])
    _, (running, waiting) = queued(project, drv("first"), drv("second"))
    row = started(worker, 60.0)
    assert row.derivation_build_id == running.id
    got = busy_slots(member, waiting)
    assert at(got["next_free"]) == at(got["busy_until"]) == row.dispatched_at + timedelta(seconds=600)
    settings.GRADIENT_ETA_DEFAULT_BUILD_SECS = 0
    got = busy_slots(member, waiting)
    assert (got["next_free"], got["busy_until"]) == (None, None)
    # Nothing busy, nothing to free; and null once the build is not Queued.
    assert client(member).get(f"/api/v1/builds/{running.id}").json()["busy_slots"] is None


def test_a_reservation_holds_free_slots_for_a_waiting_cluster_and_the_estimate_counts_them_busy(
    project: Project, member: User
) -> None:
    project_try(project, "waiting", 100.0)
    worker = connected_worker([project])
    _, (waiting,) = queued(project, drv("waiting"))
    now = timezone.now()
    free = queue_position.build_queue(DerivationBuild.objects.get(id=waiting.id), now)
    assert free is not None and free.expected_start == now  # a free slot: now
    cluster = ClusterJobFactory()
    expires = now + timedelta(minutes=30)
    ClusterReservation.objects.create(
        cluster_job=cluster,
        seats=[{"role": "a", "index": 0, "kind": "build", "worker_id": str(worker.id)}],
        created_at=now,
        expires_at=expires,
    )
    got = busy_slots(member, waiting)
    assert got["held"] == 1
    assert got["holders"] == [
        {"cluster": str(cluster.id), "slots": 1, "running": False, "until": got["holders"][0]["until"]}
    ]
    assert at(got["holders"][0]["until"]) == expires
    held = queue_position.build_queue(DerivationBuild.objects.get(id=waiting.id), now)
    assert held is not None and held.busy == 0 and held.held == 1
    assert held.expected_start == now + timedelta(seconds=50)  # as a busy slot: halfway through


def running_member(worker: Worker, build: DerivationBuild) -> object:
    """An open assignment of `build` on `worker` as a member of a running cluster attempt."""
    cluster = ClusterJobFactory(status="Running")
    attempt = ClusterAttempt.objects.create(cluster_job=cluster, number=1, created_at=timezone.now())
    DerivationBuild.objects.filter(id=build.id).update(status="Building")
    DispatchedJob.objects.create(
        kind=JobKind.BUILD,
        job_id=build.job_key,
        derivation_build=build,
        worker=worker,
        cluster_attempt=attempt,
        dispatched_at=timezone.now() - timedelta(seconds=5),
    )
    return cluster.id


def test_a_slot_running_a_clusters_member_names_the_cluster(project: Project, member: User) -> None:
    worker = connected_worker([project])
    _, (member_build, waiting) = queued(project, drv("member"), drv("waiting"))
    cluster = running_member(worker, member_build)
    got = busy_slots(member, waiting)
    assert got["holders"] == [{"cluster": str(cluster), "slots": 1, "running": True, "until": None}]
    assert got["held"] == 0


def test_an_evaluations_busy_slots_in_its_own_route_and_not_in_lists(project: Project, member: User) -> None:
    connected_worker([project])
    running = EvaluationFactory(project=project)
    waiting = EvaluationFactory(project=project)
    worker = Worker.objects.get()
    a = ask(worker.id, "flake")
    assert a is not None and a.job_key == running.job_key
    row = DispatchedJob.objects.get(id=a.assignment_id)
    c = client(member)
    body = c.get(f"/api/v1/evaluations/{waiting.id}").json()
    assert body["queue"]["busy"] == 1
    # No evaluation of the project ended yet: the default evaluation time (GRADIENT_ETA_DEFAULT_EVAL_SECS).
    assert at(body["busy_slots"]["next_free"]) == row.dispatched_at + timedelta(seconds=300)
    listed = c.get("/api/v1/evaluations").json()["results"]
    assert {e["id"]: e["busy_slots"] for e in listed} == {str(running.id): None, str(waiting.id): None}
    assert Evaluation.objects.get(id=running.id).status != "Queued"


@pytest.fixture
def operator() -> Client:
    c = Client()
    c.force_login(User.objects.create_user("op", password="pw-op-1", is_staff=True))
    return c


def test_the_console_says_until_when_the_slots_are_busy_and_who_holds_them(
    project: Project, operator: Client
) -> None:
    project_try(project, "long", 100.0)
    project_try(project, "short", 10.0)
    one, other = connected_worker([project]), connected_worker([project])
    _, (_, _, waiting) = queued(project, drv("long"), drv("short"), drv("waiting"))
    started(one, 30.0)
    started(other, 4.0)
    url = reverse("admin:scheduling_derivationbuild_change", args=[waiting.id])
    text = operator.get(url).content.decode()
    assert "2 of 2 slots busy, the first expected to free" in text and ", the last " in text

    third = connected_worker([project])
    cluster = ClusterJobFactory()
    now = timezone.now()
    ClusterReservation.objects.create(
        cluster_job=cluster,
        seats=[{"role": "a", "index": 0, "kind": "build", "worker_id": str(third.id)}],
        created_at=now,
        expires_at=now + timedelta(minutes=30),
    )
    text = operator.get(url).content.decode()
    link = reverse("admin:clusters_clusterjob_change", args=[str(cluster.id)])
    assert "2 of 3 slots busy" in text
    assert f'1 free one held for <a href="{link}">a cluster</a> waiting to be placed, until' in text
