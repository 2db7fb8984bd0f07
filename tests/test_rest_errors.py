"""Every REST route answers 401, 403, 400, 404 and 409 where it can, each with a JSON body, and such a
refusal changes nothing. One table per status; the happy paths are in each app's test_*_api.py."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from gradient.clusters.models import ClusterJob
from gradient.scheduling.models import Evaluation, Project
from gradient.workers.models import Worker
from tests.clusters_helpers import make_cluster, queued_build
from tests.factories import EvaluationFactory, ProjectFactory, WorkerFactory
from tests.support.rest import client

pytestmark = pytest.mark.django_db

UNKNOWN = "6f1c2a5e-0000-4000-8000-00000000dead"


@dataclass
class World:
    project: Project
    member: User
    stranger: User
    staff: User
    evaluation: Evaluation
    build: uuid.UUID
    cluster: ClusterJob
    worker: Worker

    def fill(self, path: str, unknown: str | None = None) -> str:
        ids = {
            "evaluation": str(self.evaluation.id),
            "build": str(self.build),
            "cluster": str(self.cluster.id),
            "worker": str(self.worker.id),
            "project": str(self.project.id),
        }
        if unknown is not None:
            ids = dict.fromkeys(ids, unknown)
        return path.format(**ids)


@pytest.fixture
def world() -> World:
    project = ProjectFactory(name="nixpkgs-ci")
    member = User.objects.create_user("member", password="pw-member-1")
    project.members.add(member)
    build = queued_build(project)
    return World(
        project=project,
        member=member,
        stranger=User.objects.create_user("stranger", password="pw-stranger-1"),
        staff=User.objects.create_user("staff", password="pw-staff-1", is_staff=True),
        evaluation=EvaluationFactory(project=project),
        build=build.id,
        cluster=make_cluster([("server", build)]),
        worker=WorkerFactory(),
    )


def call(c: APIClient, method: str, path: str, body: Any = None, **extra: Any) -> Any:
    return getattr(c, method.lower())(path, body, format="json", **extra)


def assert_json_error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.content)
    assert response["Content-Type"] == "application/json"
    body = response.json()
    assert isinstance(body, dict) and body
    if status != 400:
        assert isinstance(body["detail"], str) and body["detail"]
    return body


AUTHENTICATED_ROUTES = [
    ("GET", "/api/v1/users"),
    ("GET", "/api/v1/users/1"),
    ("POST", "/api/v1/users"),
    ("GET", "/api/v1/projects/{project}"),
    ("GET", "/api/v1/builds"),
    ("GET", "/api/v1/clusters"),
    ("GET", "/api/v1/projects"),
    ("POST", "/api/v1/projects"),
    ("GET", "/api/v1/workers"),
    ("POST", "/api/v1/workers"),
    ("GET", "/api/v1/workers/{worker}"),
    ("POST", "/api/v1/workers/{worker}/deactivate"),
    ("POST", "/api/v1/workers/{worker}/activate"),
    ("GET", "/api/v1/evaluations"),
    ("POST", "/api/v1/evaluations"),
    ("GET", "/api/v1/evaluations/{evaluation}"),
    ("POST", "/api/v1/evaluations/{evaluation}/cancel"),
    ("GET", "/api/v1/evaluations/{evaluation}/history"),
    ("GET", "/api/v1/builds/{build}"),
    ("POST", "/api/v1/clusters"),
    ("GET", "/api/v1/clusters/{cluster}"),
    ("POST", "/api/v1/clusters/{cluster}/abort"),
]


@pytest.mark.parametrize(("method", "path"), AUTHENTICATED_ROUTES)
def test_every_route_but_the_login_is_401_without_a_valid_token(world: World, method: str, path: str) -> None:
    assert_json_error(call(client(None), method, world.fill(path)), 401)
    forged = APIClient()
    forged.credentials(HTTP_AUTHORIZATION="Token 0000000000000000000000000000000000000000")
    assert_json_error(call(forged, method, world.fill(path)), 401)


STAFF_ROUTES = [
    ("GET", "/api/v1/users", None),
    ("GET", "/api/v1/users/1", None),
    ("GET", "/api/v1/projects/{project}", None),
    ("POST", "/api/v1/users", {"username": "x", "password": "pw-x-12345"}),
    ("GET", "/api/v1/projects", None),
    ("POST", "/api/v1/projects", {"name": "p"}),
    ("GET", "/api/v1/workers", None),
    ("POST", "/api/v1/workers", {"name": "w"}),
    ("GET", "/api/v1/workers/{worker}", None),
    ("POST", "/api/v1/workers/{worker}/deactivate", None),
    ("POST", "/api/v1/workers/{worker}/activate", None),
    ("POST", "/api/v1/clusters/{cluster}/abort", None),
]


@pytest.mark.parametrize(("method", "path", "body"), STAFF_ROUTES)
def test_a_staff_route_is_403_for_a_project_member(world: World, method: str, path: str, body: Any) -> None:
    assert_json_error(call(client(world.member), method, world.fill(path), body), 403)


# Another project's job answers 404, as an unknown id does: a 403 told an outsider the id exists (issue 36,
# finding 8). Submitting to a project one is not a member of stays 403 (the caller named the project).
MEMBER_ROUTES = [
    ("GET", "/api/v1/evaluations/{evaluation}", None, 404),
    ("POST", "/api/v1/evaluations/{evaluation}/cancel", None, 404),
    ("GET", "/api/v1/evaluations/{evaluation}/history", None, 404),
    ("GET", "/api/v1/builds/{build}", None, 404),
    ("GET", "/api/v1/clusters/{cluster}", None, 404),
    (
        "POST",
        "/api/v1/evaluations",
        {"project": "nixpkgs-ci", "repository": "sim:diamond", "commit": "c"},
        403,
    ),
]


@pytest.mark.parametrize(("method", "path", "body", "expected"), MEMBER_ROUTES)
def test_another_projects_job_is_404_and_changes_nothing(
    world: World, method: str, path: str, body: Any, expected: int
) -> None:
    before = Evaluation.objects.count(), world.evaluation.status
    assert_json_error(call(client(world.stranger), method, world.fill(path), body), expected)
    assert (Evaluation.objects.count(), Evaluation.objects.get(id=world.evaluation.id).status) == before


def test_a_member_may_not_group_another_projects_job_or_prioritize(world: World) -> None:
    # Another project's job is an unknown one: the same 400, not a 403 that says it exists (issue 36,
    # finding 8).
    other = queued_build(ProjectFactory(name="other"))
    foreign = call(
        client(world.member), "POST", "/api/v1/clusters", {"members": [{"build": str(other.id), "role": "a"}]}
    )
    unknown = call(
        client(world.member), "POST", "/api/v1/clusters", {"members": [{"build": UNKNOWN, "role": "a"}]}
    )
    assert_json_error(foreign, 400)
    assert json.dumps(foreign.json()).replace(str(other.id), "ID") == json.dumps(unknown.json()).replace(
        UNKNOWN, "ID"
    )
    mine = queued_build(world.project)
    prioritized = {"members": [{"build": str(mine.id), "role": "a"}], "priority": True}
    assert_json_error(call(client(world.member), "POST", "/api/v1/clusters", prioritized), 403)
    assert ClusterJob.objects.count() == 1


ID_ROUTES = [
    ("GET", "/api/v1/projects/{project}"),
    ("GET", "/api/v1/workers/{worker}"),
    ("POST", "/api/v1/workers/{worker}/deactivate"),
    ("POST", "/api/v1/workers/{worker}/activate"),
    ("GET", "/api/v1/evaluations/{evaluation}"),
    ("POST", "/api/v1/evaluations/{evaluation}/cancel"),
    ("GET", "/api/v1/evaluations/{evaluation}/history"),
    ("GET", "/api/v1/builds/{build}"),
    ("GET", "/api/v1/clusters/{cluster}"),
    ("POST", "/api/v1/clusters/{cluster}/abort"),
]


@pytest.mark.parametrize(("method", "path"), ID_ROUTES)
def test_an_unknown_or_malformed_id_is_404(world: World, method: str, path: str) -> None:
    for unknown in (UNKNOWN, "not-a-uuid"):
        assert_json_error(call(client(world.staff), method, world.fill(path, unknown)), 404)


BAD_BODIES = [
    ("/api/v1/auth/token", {"username": "staff"}, "password"),
    ("/api/v1/users", {"username": "bad name!", "password": "pw-1234567"}, "username"),
    ("/api/v1/users", {"username": "staff", "password": "pw-1234567"}, "username"),
    ("/api/v1/users", {"username": "new", "password": "pw-1234567", "projects": ["nope"]}, "projects"),
    ("/api/v1/projects", {}, "name"),
    ("/api/v1/projects", {"name": "nixpkgs-ci"}, "name"),
    ("/api/v1/workers", {"name": "w", "projects": ["nope"]}, "projects"),
    ("/api/v1/workers", {"name": "w", "projects": "nixpkgs-ci"}, "projects"),
    ("/api/v1/evaluations", {"project": "nope", "repository": "r", "commit": "c"}, "project"),
    ("/api/v1/evaluations", {"project": "nixpkgs-ci", "commit": "c"}, "repository"),
    (
        "/api/v1/evaluations",
        {"project": "nixpkgs-ci", "repository": "r", "commit": "c", "wildcards": "x"},
        "wildcards",
    ),
    ("/api/v1/clusters", {"members": []}, "members"),
    ("/api/v1/clusters", {"members": [{"role": "a", "build": UNKNOWN}]}, "members"),
    ("/api/v1/clusters", {"members": [{"role": "a", "evaluation": "x"}]}, "members"),
    (
        "/api/v1/clusters",
        {"members": [{"role": "a", "build": "{build}"}], "retry_budget": -1},
        "retry_budget",
    ),
]


@pytest.mark.parametrize(("path", "body", "field"), BAD_BODIES)
def test_bad_input_is_400_naming_the_field_and_changes_nothing(
    world: World, path: str, body: Any, field: str
) -> None:
    def counts() -> list[int]:
        return [m.objects.count() for m in (Project, User, Worker, Evaluation, ClusterJob)]

    before = counts()
    body = json.loads(json.dumps(body).replace("{build}", str(world.build)))
    errors = assert_json_error(call(client(world.staff), "POST", path, body), 400)
    assert field in errors
    assert counts() == before


@pytest.mark.parametrize("query", ["status=Nonsense", "limit=x", "offset=-1"])
def test_a_bad_list_filter_is_400(world: World, query: str) -> None:
    assert_json_error(client(world.staff).get(f"/api/v1/evaluations?{query}"), 400)


def test_a_job_already_in_a_cluster_is_400(world: World) -> None:
    body = {"members": [{"build": str(world.build), "role": "again"}]}
    errors = assert_json_error(call(client(world.staff), "POST", "/api/v1/clusters", body), 400)
    assert "already a member of a cluster" in str(errors)


def test_an_idempotency_key_reused_with_another_body_is_409_and_creates_nothing(world: World) -> None:
    c = client(world.member)
    body = {"project": "nixpkgs-ci", "repository": "sim:diamond", "commit": "c1"}
    assert call(c, "POST", "/api/v1/evaluations", body, HTTP_IDEMPOTENCY_KEY="k-1").status_code == 201
    count = Evaluation.objects.count()
    conflict = call(c, "POST", "/api/v1/evaluations", {**body, "commit": "c2"}, HTTP_IDEMPOTENCY_KEY="k-1")
    assert "Idempotency-Key" in assert_json_error(conflict, 409)["detail"]
    assert Evaluation.objects.count() == count
