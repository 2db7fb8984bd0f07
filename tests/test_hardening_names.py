"""Names that look alike are refused (issue 17, finding 13): a control or format character (a zero-width
space, a right-to-left override, a soft hyphen, a BEL) in the name of a project, a worker or a user is
bad input, over REST and in the admin; letters of any script are fine."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gradient.scheduling.models import Project
from gradient.workers.models import Worker

pytestmark = pytest.mark.django_db

LOOKALIKES = ["c\u200bi", "ci\u202e", "c\u00adi", "c\x07i", "c\u2028i", "\ufeffci", "c\u2066i"]


@pytest.fixture
def staff() -> APIClient:
    user = User.objects.create_user("op", password="pw-op-1", is_staff=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


@pytest.mark.parametrize("name", LOOKALIKES)
def test_a_project_name_with_a_control_or_format_character_is_400(staff: APIClient, name: str) -> None:
    response = staff.post("/api/v1/projects", {"name": name}, format="json")
    assert response.status_code == 400 and "control or format" in response.json()["name"][0]
    assert not Project.objects.exists()


@pytest.mark.parametrize("name", LOOKALIKES)
def test_a_worker_name_with_a_control_or_format_character_is_400(staff: APIClient, name: str) -> None:
    response = staff.post("/api/v1/workers", {"name": name, "projects": []}, format="json")
    assert response.status_code == 400 and "control or format" in response.json()["name"][0]
    assert not Worker.objects.exists()


@pytest.mark.parametrize("name", LOOKALIKES)
def test_a_user_name_with_a_control_or_format_character_is_400(staff: APIClient, name: str) -> None:
    response = staff.post("/api/v1/users", {"username": name, "password": "pw-x-12345"}, format="json")
    assert response.status_code == 400 and "username" in response.json()
    assert not User.objects.filter(username=name).exists()


@pytest.mark.parametrize("name", ["ci", "nixpkgs-ci", "проект", "项目", "café"])
def test_names_of_any_script_are_fine(staff: APIClient, name: str) -> None:
    assert staff.post("/api/v1/projects", {"name": name}, format="json").status_code == 201
    assert staff.post("/api/v1/workers", {"name": name, "projects": [name]}, format="json").status_code == 201


@pytest.mark.parametrize(
    ("path", "model"), [("/admin/scheduling/project/add/", Project), ("/admin/workers/worker/add/", Worker)]
)
def test_the_admin_refuses_them_too(path: str, model: type) -> None:
    admin = User.objects.create_superuser("admin", password="pw-admin-1", email="a@b.c")
    client = Client()
    client.force_login(admin)
    response = client.post(path, {"name": "c\u200bi", "max_concurrent_builds": 1, "active": "on"})
    assert response.status_code == 200 and "control or format" in response.content.decode()
    assert not model.objects.exists()


# --- Look-alike names (issue 36, finding 7) -------------------------------------------------------------

CONFUSABLE = [
    "proj\u0410",
    "\uff50\uff52\uff4f\uff4aA",
    "\U0001d429\U0001d42b\U0001d428\U0001d423A",
    "PROJA",
    "proja",
]


@pytest.mark.parametrize("name", CONFUSABLE)
@pytest.mark.parametrize(("route", "model"), [("/api/v1/projects", Project), ("/api/v1/workers", Worker)])
def test_a_name_that_looks_like_an_existing_one_is_400(
    staff: APIClient, route: str, model: type, name: str
) -> None:
    assert staff.post(route, {"name": "projA"}, format="json").status_code == 201
    response = staff.post(route, {"name": name}, format="json")
    assert response.status_code == 400, response.content
    text = response.json()["name"][0]
    assert "looks the same as the existing 'projA'" in text or "several scripts" in text, text
    assert list(model.objects.values_list("name", flat=True)) == ["projA"]


@pytest.mark.parametrize("value", [123, 1.5, True, None, ["a"], {"a": 1}])
def test_a_name_is_a_string_only(staff: APIClient, value: object) -> None:
    for route in ("/api/v1/projects", "/api/v1/workers"):
        response = staff.post(route, {"name": value}, format="json")
        assert response.status_code == 400, (route, value, response.content)
    assert not Project.objects.exists() and not Worker.objects.exists()


def test_east_asian_scripts_may_join_latin_and_the_admin_refuses_a_lookalike_too(staff: APIClient) -> None:
    assert staff.post("/api/v1/projects", {"name": "ci-プロジェクト-项目"}, format="json").status_code == 201
    admin = User.objects.create_superuser("admin", password="pw-admin-1", email="a@b.c")
    client = Client()
    client.force_login(admin)
    response = client.post("/admin/scheduling/project/add/", {"name": "CI-プロジェクト-项目"})
    assert response.status_code == 200 and "looks the same as the existing" in response.content.decode()
    assert Project.objects.count() == 1
