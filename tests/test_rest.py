"""What every REST route shares: JSON error bodies (never an HTML page), throttling, and an OpenAPI
document that validates with every error response described."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import RequestFactory, override_settings
from rest_framework.authtoken.models import Token
from rest_framework.exceptions import ValidationError
from rest_framework.test import APIClient

from gradient.rest import exception_handler, server_error

pytestmark = pytest.mark.django_db


def _client(user: User | None = None) -> APIClient:
    client = APIClient()
    if user is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def test_an_unknown_route_under_the_api_is_a_json_404() -> None:
    response = _client().get("/api/v1/no-such-thing")
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json" and response.json() == {"detail": "No such route."}


def test_an_unknown_page_outside_the_api_keeps_the_html_404() -> None:
    response = _client().get("/no-such-page")
    assert response.status_code == 404 and response["Content-Type"].startswith("text/html")


def test_a_server_error_under_the_api_answers_in_json() -> None:
    response = server_error(RequestFactory().get("/api/v1/evaluations"))
    assert response.status_code == 500 and response["Content-Type"] == "application/json"


def test_an_unsupported_method_and_a_malformed_body_are_json_errors() -> None:
    staff = _client(User.objects.create_user("op", password="pw-op-1", is_staff=True))
    wrong_method = staff.delete("/api/v1/projects")
    assert wrong_method.status_code == 405 and "detail" in wrong_method.json()
    malformed = staff.post("/api/v1/projects", "{", content_type="application/json")
    assert malformed.status_code == 400 and "detail" in malformed.json()


def test_a_members_error_is_reported_under_the_member_and_field_it_concerns() -> None:
    staff = _client(User.objects.create_user("op", password="pw-op-1", is_staff=True))
    response = staff.post("/api/v1/clusters", {"members": [{"role": "a"}]}, format="json")
    assert response.status_code == 400
    assert "exactly one job" in response.json()["members"]["0"]["non_field_errors"][0]


def test_an_error_about_the_whole_body_is_an_object_with_non_field_errors() -> None:
    response = exception_handler(ValidationError("Nothing to do."), {})
    assert response is not None and response.data == {"non_field_errors": ["Nothing to do."]}


@override_settings(GRADIENT_API_THROTTLE_USER="3/minute")
def test_a_user_over_the_rate_gets_429_with_retry_after() -> None:
    staff = _client(User.objects.create_user("op", password="pw-op-1", is_staff=True))
    codes = [staff.get("/api/v1/projects").status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    refused = staff.get("/api/v1/projects")
    assert "Retry-After" in refused and "throttled" in refused.json()["detail"].lower()


@override_settings(GRADIENT_API_THROTTLE_ANON="2/minute")
def test_anonymous_clients_are_throttled_by_address() -> None:
    codes = [
        _client().post("/api/v1/auth/token", {"username": "x", "password": "y"}).status_code for _ in range(3)
    ]
    assert codes == [401, 401, 429]  # wrong credentials (issue 34), then the throttle


@override_settings(GRADIENT_API_THROTTLE_USER="")
def test_an_empty_rate_turns_the_throttle_off() -> None:
    staff = _client(User.objects.create_user("op", password="pw-op-1", is_staff=True))
    assert {staff.get("/api/v1/projects").status_code for _ in range(20)} == {200}


def test_the_openapi_document_validates_without_warnings(tmp_path: Any) -> None:
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yaml"))


def test_every_operation_describes_its_errors_with_a_json_body() -> None:
    document = _client().get("/api/schema/", HTTP_ACCEPT="application/json").json()
    for path, item in document["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            assert "429" in responses, (method, path)
            if path != "/api/v1/auth/token":
                assert {"401", "403"} <= set(responses), (method, path)
            if "{" in path:
                assert "404" in responses, (method, path)
            if "requestBody" in operation:
                assert "400" in responses, (method, path)
            for code, response in responses.items():
                assert response["description"], (method, path, code)
                if code.startswith("4"):
                    assert "application/json" in response["content"], (method, path, code)
    assert {"Error", "FieldErrors", "ControlReceipt", "EvaluationPage"} <= set(
        document["components"]["schemas"]
    )
