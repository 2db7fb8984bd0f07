"""The cluster routes of rest.md: create (201 {id, status}), read with members and attempt history, and
abort (staff, 202); 401, 403, 400 and 404 where they apply."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import User

from gradient.clusters.models import ClusterJob, ClusterStatus
from gradient.records.selectors import record_job
from tests.clusters_helpers import make_cluster, queued_build, queued_evaluation, seat_worker, started
from tests.factories import ProjectFactory, WorkerFactory
from tests.support.rest import client

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def setup():  # type: ignore[no-untyped-def]
    project = ProjectFactory(name="nixpkgs-ci")
    member = User.objects.create_user("member", password="pw-member-1")
    project.members.add(member)
    stranger = User.objects.create_user("stranger", password="pw-stranger-1")
    staff = User.objects.create_user("staff", password="pw-staff-1", is_staff=True)
    return project, member, stranger, staff


def test_a_member_creates_a_cluster_of_its_jobs_and_reads_it_back(setup) -> None:  # type: ignore[no-untyped-def]
    project, member, _, _ = setup
    build, evaluation = queued_build(project), queued_evaluation(project)
    pinned = WorkerFactory(name="w-pinned")
    pinned.projects.set([project])  # a member pins only to a worker that serves its projects
    body = {
        "members": [
            {"build": str(build.id), "role": "server", "primary": True},
            {"evaluation": str(evaluation.id), "role": "client", "pin": "w-pinned"},
        ],
        "same_zone": True,
        "retry_budget": 3,
    }
    response = client(member).post("/api/v1/clusters", body, format="json")
    assert response.status_code == 201, response.content
    created = response.json()
    assert created["status"] == "Queued" and uuid.UUID(created["id"])
    read = client(member).get(f"/api/v1/clusters/{created['id']}").json()
    assert (read["same_zone"], read["attempts"], read["retry_budget"]) == (True, 0, 3)
    assert read["members"] == [
        {
            "role": "client",
            "index": 0,
            "evaluation": str(evaluation.id),
            "build": None,
            "primary": False,
            "pin": pinned.name,
        },
        {
            "role": "server",
            "index": 0,
            "evaluation": None,
            "build": str(build.id),
            "primary": True,
            "pin": None,
        },
    ]
    assert read["attempt_history"] == []
    assert (
        record_job(job_key=f"cluster:{created['id']}", now=ClusterJob.objects.get().created_at).status.value
        == "Queued"
    )


def test_the_attempt_history_lists_each_attempt_with_its_seats(setup) -> None:  # type: ignore[no-untyped-def]
    project, member, _, _ = setup
    cluster = make_cluster([("a", queued_build(project)), ("b", queued_build(project))])
    workers = [seat_worker(project), seat_worker(project)]
    claimed = started(cluster, workers)
    read = client(member).get(f"/api/v1/clusters/{cluster.id}").json()
    (attempt,) = read["attempt_history"]
    assert attempt["id"] == str(claimed.attempt_id) and attempt["started_at"] and attempt["outcome"] is None
    assert sorted((s["role"], s["index"], s["worker_id"]) for s in attempt["seats"]) == [
        ("a", 0, str(workers[0].id)),
        ("b", 0, str(workers[1].id)),
    ]
    assert read["status"] == "Running" and read["attempts"] == 1


@pytest.mark.parametrize(
    ("members", "field_text"),
    [
        ([], "members"),
        ([{"role": "r"}], "exactly one job"),
        ([{"role": "r", "build": "BUILD", "evaluation": "EVAL"}], "exactly one job"),
        ([{"role": "r", "build": str(uuid.UUID(int=1))}], "Unknown build"),
        ([{"role": "r", "evaluation": str(uuid.UUID(int=2))}], "Unknown evaluation"),
        ([{"role": "r", "build": "not-a-uuid"}], "UUID"),
        ([{"build": "BUILD"}], "role"),
        ([{"role": "r", "build": "BUILD", "pin": "nobody"}], "Unknown worker"),
    ],
)
def test_bad_input_is_a_400_with_field_errors(setup, members, field_text) -> None:  # type: ignore[no-untyped-def]
    project, _, _, staff = setup
    build, evaluation = queued_build(project), queued_evaluation(project)
    filled = [
        {
            k: (str(build.id) if v == "BUILD" else str(evaluation.id) if v == "EVAL" else v)
            for k, v in m.items()
        }
        for m in members
    ]
    response = client(staff).post("/api/v1/clusters", {"members": filled}, format="json")
    assert response.status_code == 400, response.content
    assert field_text in response.content.decode()
    assert not ClusterJob.objects.exists()


def test_a_job_already_in_a_cluster_is_a_400(setup) -> None:  # type: ignore[no-untyped-def]
    project, _, _, staff = setup
    build = queued_build(project)
    make_cluster([("a", build)])
    response = client(staff).post(
        "/api/v1/clusters", {"members": [{"role": "b", "build": str(build.id)}]}, format="json"
    )
    assert response.status_code == 400 and "already a member of a cluster" in response.content.decode()
    assert ClusterJob.objects.count() == 1


def test_a_negative_or_malformed_budget_is_a_400(setup) -> None:  # type: ignore[no-untyped-def]
    project, _, _, staff = setup
    member = {"role": "r", "build": str(queued_build(project).id)}
    for budget in (-1, "many"):
        response = client(staff).post(
            "/api/v1/clusters", {"members": [member], "retry_budget": budget}, format="json"
        )
        assert response.status_code == 400 and "retry_budget" in response.json()


def test_without_a_token_every_route_is_a_401(setup) -> None:  # type: ignore[no-untyped-def]
    project, _, _, _ = setup
    cluster = make_cluster([("a", queued_build(project))])
    anonymous = client(None)
    assert anonymous.post("/api/v1/clusters", {"members": []}, format="json").status_code == 401
    assert anonymous.get(f"/api/v1/clusters/{cluster.id}").status_code == 401
    assert anonymous.post(f"/api/v1/clusters/{cluster.id}/abort").status_code == 401


def test_a_stranger_may_neither_group_nor_read_another_projects_jobs(setup) -> None:  # type: ignore[no-untyped-def]
    project, _, stranger, _ = setup
    build = queued_build(project)
    response = client(stranger).post(
        "/api/v1/clusters", {"members": [{"role": "a", "build": str(build.id)}]}, format="json"
    )
    assert response.status_code == 400 and "Unknown build" in response.content.decode()  # as if none
    cluster = make_cluster([("a", build)])
    assert client(stranger).get(f"/api/v1/clusters/{cluster.id}").status_code == 404


def test_only_staff_may_prioritize_or_abort(setup) -> None:  # type: ignore[no-untyped-def]
    project, member, _, _ = setup
    body = {"members": [{"role": "a", "build": str(queued_build(project).id)}], "priority": True}
    assert client(member).post("/api/v1/clusters", body, format="json").status_code == 403
    cluster = make_cluster([("a", queued_build(project))])
    assert client(member).post(f"/api/v1/clusters/{cluster.id}/abort").status_code == 403
    assert ClusterJob.objects.get(id=cluster.id).status == ClusterStatus.QUEUED


def test_unknown_ids_are_a_404(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, _, staff = setup
    for path in (f"/api/v1/clusters/{uuid.uuid4()}", "/api/v1/clusters/not-a-uuid"):
        assert client(staff).get(path).status_code == 404
    assert client(staff).post(f"/api/v1/clusters/{uuid.uuid4()}/abort").status_code == 404


def test_staff_abort_a_cluster_through_its_record_and_it_ends_aborted(setup) -> None:  # type: ignore[no-untyped-def]
    project, _, _, staff = setup
    build = queued_build(project)
    cluster = make_cluster([("a", build)])
    response = client(staff).post(f"/api/v1/clusters/{cluster.id}/abort")
    assert response.status_code == 202, response.content
    assert response.json()["status"] == "Aborted"
    job = record_job(job_key=cluster.job_key, now=ClusterJob.objects.get(id=cluster.id).finished_at)
    assert [(c.intent, c.actor) for c in job.controls] == [("cancel", "staff")]
    build.refresh_from_db()
    assert build.status == "Queued"  # an evaluation outside the cluster needs it: spared, as cancel does


def test_the_schema_documents_the_cluster_routes(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, _, staff = setup
    schema = client(staff).get("/api/schema/", {"format": "json"}).json()
    assert {
        "/api/v1/clusters",
        "/api/v1/clusters/{cluster_id}",
        "/api/v1/clusters/{cluster_id}/abort",
    } <= set(schema["paths"])


def test_a_pin_says_nothing_of_a_worker_the_caller_may_not_see(setup) -> None:  # type: ignore[no-untyped-def]
    """Issue 36, finding 8: a pin to another project's worker answers as a pin to no worker at all; the
    caller's own project's worker, and any worker for staff, is taken."""
    project, member, _, staff = setup
    other = ProjectFactory(name="other-ci")
    other_member = User.objects.create_user("other-member", password="pw-other-1")
    other.members.add(other_member)
    mine, theirs = WorkerFactory(name="w-mine"), WorkerFactory(name="w-theirs")
    mine.projects.set([project])
    theirs.projects.set([other])

    def pin(user: User, worker: str, job_project=project):  # type: ignore[no-untyped-def]
        body = {"members": [{"role": "a", "build": str(queued_build(job_project).id), "pin": worker}]}
        return client(user).post("/api/v1/clusters", body, format="json")

    unknown, foreign = pin(member, "w-nobody"), pin(member, "w-theirs")
    assert unknown.status_code == foreign.status_code == 400
    assert unknown.json() == {"members": ["member 0: Unknown worker 'w-nobody' to pin to."]}
    assert foreign.json() == {"members": ["member 0: Unknown worker 'w-theirs' to pin to."]}
    assert pin(other_member, "w-mine", other).json() == {
        "members": ["member 0: Unknown worker 'w-mine' to pin to."]
    }
    assert not ClusterJob.objects.exists()
    assert pin(member, "w-mine").status_code == 201
    assert pin(other_member, "w-theirs", other).status_code == 201
    assert pin(staff, "w-theirs").status_code == 201
