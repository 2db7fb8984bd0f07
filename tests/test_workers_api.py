"""The REST routes the workers app owns: token login, users, projects, workers (register, list,
deactivate); 401 without a token, 403 for non-staff, 400 with field errors, 404 for unknown ids."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gradient.scheduling.models import Project
from gradient.workers.models import Worker, WorkerSession
from gradient.workers.tokens import token_matches

pytestmark = pytest.mark.django_db

STAFF_ROUTES = [
    ("post", "/api/v1/users", {"username": "u", "password": "p"}),
    ("post", "/api/v1/projects", {"name": "p"}),
    ("get", "/api/v1/projects", None),
    ("post", "/api/v1/workers", {"name": "w", "projects": []}),
    ("get", "/api/v1/workers", None),
    ("post", f"/api/v1/workers/{uuid.uuid4()}/deactivate", None),
]


def _client(user: User | None) -> APIClient:
    client = APIClient()
    if user is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


@pytest.fixture
def staff() -> APIClient:
    return _client(User.objects.create_user("operator", password="operator-pw", is_staff=True))


@pytest.fixture
def submitter() -> APIClient:
    return _client(User.objects.create_user("submitter", password="submitter-pw"))


def _call(client: APIClient, method: str, path: str, body: Any) -> Any:
    return (
        getattr(client, method)(path, body, format="json")
        if body is not None
        else getattr(client, method)(path)
    )


def test_a_username_and_password_get_a_token_that_authenticates() -> None:
    User.objects.create_user("operator", password="operator-pw", is_staff=True)
    client = APIClient()

    response = client.post(
        "/api/v1/auth/token", {"username": "operator", "password": "operator-pw"}, format="json"
    )

    assert response.status_code == 200
    token = response.json()["token"]
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.get("/api/v1/workers").status_code == 200


def test_a_wrong_password_is_401_and_says_so() -> None:
    User.objects.create_user("operator", password="operator-pw")
    response = APIClient().post(
        "/api/v1/auth/token", {"username": "operator", "password": "wrong"}, format="json"
    )
    assert response.status_code == 401 and response["WWW-Authenticate"] == "Token"
    assert "Unable to log in" in response.json()["detail"]


@pytest.mark.parametrize("body", [{"username": "operator"}, {}, ["operator"]])
def test_bad_credentials_get_400_with_errors(body: Any) -> None:
    User.objects.create_user("operator", password="operator-pw")
    response = APIClient().post("/api/v1/auth/token", body, format="json")
    assert response.status_code == 400
    assert response.json()


@pytest.mark.parametrize(("method", "path", "body"), STAFF_ROUTES)
def test_every_staff_route_answers_401_without_a_token_and_403_to_a_non_staff_user(
    method: str, path: str, body: Any, submitter: APIClient
) -> None:
    assert _call(APIClient(), method, path, body).status_code == 401
    assert _call(_client(None), method, path, body).status_code == 401
    bad = APIClient()
    bad.credentials(HTTP_AUTHORIZATION="Token not-a-token")
    assert _call(bad, method, path, body).status_code == 401
    assert _call(submitter, method, path, body).status_code == 403


def test_staff_creates_a_project() -> None:
    client = _client(User.objects.create_user("op", password="x", is_staff=True))
    response = client.post("/api/v1/projects", {"name": "nixpkgs"}, format="json")
    assert response.status_code == 201
    body = response.json()
    assert body == {"id": str(Project.objects.get(name="nixpkgs").id), "name": "nixpkgs"}


@pytest.mark.parametrize("body", [{}, {"name": ""}, {"name": "x" * 201}, {"name": "taken"}, {"name": ["a"]}])
def test_a_bad_project_gets_400_with_field_errors(staff: APIClient, body: Any) -> None:
    Project.objects.create(name="taken")
    response = staff.post("/api/v1/projects", body, format="json")
    assert response.status_code == 400
    assert "name" in response.json()


def test_staff_creates_a_submitter_of_given_projects(staff: APIClient) -> None:
    Project.objects.create(name="alpha")
    Project.objects.create(name="beta")

    response = staff.post(
        "/api/v1/users", {"username": "ci", "password": "pw", "projects": ["beta", "alpha"]}, format="json"
    )

    assert response.status_code == 201
    user = User.objects.get(username="ci")
    assert response.json() == {
        "id": user.id,
        "username": "ci",
        "is_staff": False,
        "projects": ["alpha", "beta"],
    }
    assert user.check_password("pw")
    token = APIClient().post("/api/v1/auth/token", {"username": "ci", "password": "pw"}, format="json")
    assert token.status_code == 200


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"password": "pw"}, "username"),
        ({"username": "ci"}, "password"),
        ({"username": "operator", "password": "pw"}, "username"),
        ({"username": "bad name!", "password": "pw"}, "username"),
        ({"username": "ci", "password": "pw", "projects": ["nope"]}, "projects"),
        ({"username": "ci", "password": "pw", "projects": "alpha"}, "projects"),
        ({"username": "ci", "password": "pw", "is_staff": "maybe"}, "is_staff"),
    ],
)
def test_a_bad_user_gets_400_with_field_errors(staff: APIClient, body: dict[str, Any], field: str) -> None:
    response = staff.post("/api/v1/users", body, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert not User.objects.filter(username="ci").exists()


def test_registering_a_worker_returns_its_token_once_and_stores_only_a_hash(staff: APIClient) -> None:
    Project.objects.create(name="alpha")

    response = staff.post("/api/v1/workers", {"name": "builder-1", "projects": ["alpha"]}, format="json")

    assert response.status_code == 201
    body = response.json()
    assert set(body) == {"id", "token"}
    worker = Worker.objects.get(id=body["id"])
    assert worker.name == "builder-1" and list(worker.projects.values_list("name", flat=True)) == ["alpha"]
    assert body["token"] not in worker.token_hash and token_matches(body["token"], worker.token_hash)
    listed = staff.get("/api/v1/workers").json()
    assert "token" not in listed[0] and body["token"] not in str(listed)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"projects": []}, "name"),
        ({"name": "", "projects": []}, "name"),
        ({"name": "taken", "projects": []}, "name"),
        ({"name": "w", "projects": ["nope"]}, "projects"),
        ({"name": "w", "projects": [1, {}]}, "projects"),
    ],
)
def test_a_bad_worker_registration_gets_400_with_field_errors(
    staff: APIClient, body: dict[str, Any], field: str
) -> None:
    Worker.objects.create(name="taken", token_hash="x")
    response = staff.post("/api/v1/workers", body, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert Worker.objects.count() == 1


def test_a_body_that_is_not_a_json_object_gets_400(staff: APIClient) -> None:
    assert staff.post("/api/v1/workers", "[1, 2]", content_type="application/json").status_code == 400
    assert staff.post("/api/v1/workers", "{", content_type="application/json").status_code == 400


def test_the_worker_list_shows_sessions_and_capabilities(staff: APIClient) -> None:
    now = timezone.now()
    connected = Worker.objects.create(
        name="a",
        token_hash="x",
        architectures=["x86_64-linux"],
        system_features=["kvm"],
        zone="z1",
        last_seen=now,
    )
    Worker.objects.create(name="b", token_hash="y")
    WorkerSession.objects.create(
        worker=connected,
        channel_name="c",
        server_boot=uuid.uuid4(),
        opened_at=now,
        last_seen=now,
        draining=True,
    )

    rows = {row["name"]: row for row in staff.get("/api/v1/workers").json()}

    assert rows["a"]["connected"] is True and rows["a"]["draining"] is True
    assert rows["a"]["architectures"] == ["x86_64-linux"] and rows["a"]["system_features"] == ["kvm"]
    assert rows["a"]["zone"] == "z1" and rows["a"]["last_seen"] is not None
    assert rows["a"]["id"] == str(connected.id)
    assert (
        rows["b"]["connected"] is False and rows["b"]["draining"] is False and rows["b"]["last_seen"] is None
    )


def test_deactivating_a_worker_closes_its_open_session(staff: APIClient) -> None:
    now = timezone.now()
    worker = Worker.objects.create(name="a", token_hash="x")
    session = WorkerSession.objects.create(
        worker=worker, channel_name="c", server_boot=uuid.uuid4(), opened_at=now, last_seen=now
    )

    response = staff.post(f"/api/v1/workers/{worker.id}/deactivate")

    assert response.status_code == 200
    assert response.json()["active"] is False and response.json()["connected"] is False
    session.refresh_from_db()
    assert session.closed_at is not None and session.close_reason == "worker deactivated"
    assert staff.post(f"/api/v1/workers/{worker.id}/deactivate").status_code == 200


@pytest.mark.parametrize("worker_id", [str(uuid.uuid4()), "not-a-uuid"])
def test_an_unknown_worker_id_gets_404(staff: APIClient, worker_id: str) -> None:
    assert staff.post(f"/api/v1/workers/{worker_id}/deactivate").status_code == 404
    assert staff.get(f"/api/v1/workers/{worker_id}").status_code == 404


def test_the_schema_documents_the_routes(staff: APIClient) -> None:
    response = staff.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    for path in (
        "/api/v1/auth/token",
        "/api/v1/users",
        "/api/v1/projects",
        "/api/v1/workers",
        "/api/v1/workers/{worker_id}/deactivate",
    ):
        assert path in paths, path


def test_staff_sets_a_workers_projects_and_an_evaluation_parked_for_its_project_is_queued_again(
    staff: APIClient, submitter: APIClient
) -> None:
    from gradient.scheduling.services.waiting import refresh_waiting_state
    from tests.factories import EvaluationFactory, connected_worker

    demo = Project.objects.create(name="demo")
    rest_proj = Project.objects.create(name="rest-proj")
    worker = connected_worker([demo])
    evaluation = EvaluationFactory(project=rest_proj)
    refresh_waiting_state(now=timezone.now(), grace_secs=300)
    parked = staff.get(f"/api/v1/evaluations/{evaluation.id}").json()
    assert parked["status"] == "Waiting" and parked["waiting_reason"]["project"] == "rest-proj"

    path = f"/api/v1/workers/{worker.id}"
    assert submitter.patch(path, {"projects": ["rest-proj"]}, format="json").status_code == 403
    refused = staff.patch(path, {"projects": ["demo", "nope"]}, format="json")
    assert refused.status_code == 400 and "nope" in str(refused.json()["projects"])
    assert sorted(worker.projects.values_list("name", flat=True)) == ["demo"], "a 400 changes nothing"
    assert staff.patch(path, {}, format="json").status_code == 400
    assert staff.patch(f"/api/v1/workers/{uuid.uuid4()}", {"projects": []}, format="json").status_code == 404

    response = staff.patch(path, {"projects": ["demo", "rest-proj"]}, format="json")

    assert response.status_code == 200 and response.json()["projects"] == ["demo", "rest-proj"]
    refresh_waiting_state(now=timezone.now(), grace_secs=300)
    evaluation.refresh_from_db()
    assert (evaluation.status, evaluation.waiting_reason) == ("Queued", None)


def test_the_schema_documents_patching_a_workers_projects(staff: APIClient) -> None:
    schema = staff.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    patch = schema["paths"]["/api/v1/workers/{worker_id}"]["patch"]
    body = patch["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    assert "projects" in schema["components"]["schemas"][body]["properties"]
    assert "200" in patch["responses"]
