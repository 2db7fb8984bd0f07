"""schemathesis against /api/schema/, in-process on the WSGI app as a staff client: for every route,
generated requests (valid and invalid) never get a 500 and every answer matches the document.

The operations are parametrized by hand: schemathesis' own pytest loader does not run on pytest 9."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.contrib.auth.models import User
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from rest_framework.authtoken.models import Token
from schemathesis import GenerationMode, checks

from tests.factories import ProjectFactory

pytestmark = pytest.mark.django_db

# Not positive_data_acceptance: a well-formed body can still be refused for what it says (an unknown
# project, wrong credentials), which is a 400 and correct. Not negative_data_rejection: DRF trims
# surrounding whitespace before it checks max_length, so "\r" + 200 characters is a valid name of 200.
# Invalid requests are still generated (the negative mode) and must get no 500 and a documented answer.
CHECKS = [
    checks.not_a_server_error,
    checks.response_schema_conformance,
    checks.content_type_conformance,
    checks.status_code_conformance,
]
EXAMPLES = 10  # per operation and mode: the whole run stays around a minute on two cores

_app = get_wsgi_application()
_schema = schemathesis.openapi.from_wsgi("/api/schema/", _app)  # the view reads no table
_operations = {op.label: op for op in (result.ok() for result in _schema.get_all_operations())}


@pytest.fixture
def keep_the_test_connection() -> Iterator[None]:
    """Like Django's test client: a request must not close the connection holding the test's
    transaction."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.fixture
def staff_token(keep_the_test_connection: None) -> str:
    ProjectFactory(name="nixpkgs-ci")
    staff = User.objects.create_user("fuzz", password="pw-fuzz-1", is_staff=True)
    return Token.objects.create(user=staff).key


def test_the_document_has_every_route_of_the_contract() -> None:
    expected = {
        "POST /api/v1/auth/token",
        "POST /api/v1/users",
        "POST /api/v1/projects",
        "POST /api/v1/workers",
        "GET /api/v1/workers",
        "POST /api/v1/workers/{worker_id}/deactivate",
        "POST /api/v1/evaluations",
        "GET /api/v1/evaluations/{evaluation_id}",
        "POST /api/v1/evaluations/{evaluation_id}/cancel",
        "GET /api/v1/evaluations/{evaluation_id}/history",
        "GET /api/v1/builds/{build_id}",
        "GET /api/v1/builds/{build_id}/log",
        "POST /api/v1/clusters",
        "GET /api/v1/clusters/{cluster_id}",
        "POST /api/v1/clusters/{cluster_id}/abort",
    }
    assert expected <= set(_operations)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize("label", sorted(_operations))
def test_no_route_answers_500_or_outside_its_schema(
    label: str, mode: GenerationMode, staff_token: str
) -> None:
    headers = {"Authorization": f"Token {staff_token}"}

    @given(case=_operations[label].as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case: Any) -> None:
        case.call_and_validate(headers=headers, checks=CHECKS)

    try:
        check()
    except Unsatisfiable:
        pytest.skip("no invalid request can be made for this route (a bare path id)")
