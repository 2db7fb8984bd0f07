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
