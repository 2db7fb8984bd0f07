"""GET /api/v1/builds/{id}/log and the build's log_url and last_error (rest.md): the latest try's log,
?assignment= and ?offset= with X-Log-Offset and X-Log-Complete, 404 without a log, the build's read
permissions, 400 for bad parameters."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gradient.scheduling.models import DerivationBuild, EvaluationStatus
from gradient.scheduling.services import graph
from gradient.scheduling.services.logs import build_log_append
from gradient.scheduling.services.offers import promote_retries
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, build_id_of, drv, report, wire

pytestmark = pytest.mark.django_db


def client(user: User) -> APIClient:
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")
    return c


@pytest.fixture
def setup() -> dict[str, Any]:
    project = ProjectFactory(name="nixpkgs-ci")
    member = User.objects.create_user("member", password="pw-member-1")
    project.members.add(member)
    stranger = User.objects.create_user("stranger", password="pw-stranger-1")
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("hello")], now=timezone.now())
    worker = connected_worker([project])
    return {"member": member, "stranger": stranger, "worker": worker, "build": DerivationBuild.objects.get()}


def send(worker: Any, a: Any, offset: int, data: str) -> None:
    message = {
        "type": "BuildLog",
        "job_id": a.job_key,
        "assignment_id": str(a.assignment_id),
        "build_id": build_id_of(a),
        "offset": offset,
        "data": data,
    }
    build_log_append(worker_id=worker.id, message=wire(message), now=timezone.now())


def test_a_build_without_a_log_has_no_log_url_and_its_log_is_a_404(setup: dict[str, Any]) -> None:
    build = setup["build"]
    body = client(setup["member"]).get(f"/api/v1/builds/{build.id}").json()
    assert body["log_url"] is None and body["last_error"] == ""
    response = client(setup["member"]).get(f"/api/v1/builds/{build.id}/log")
    assert response.status_code == 404 and response.json()["detail"]
    assert client(setup["member"]).get(f"/api/v1/builds/{uuid.uuid4()}/log").status_code == 404
    assert client(setup["member"]).get("/api/v1/builds/not-a-uuid/log").status_code == 404


def test_a_failed_builds_log_and_error_are_on_the_build_and_earlier_tries_stay_readable(
    setup: dict[str, Any],
) -> None:
    worker, member, build = setup["worker"], setup["member"], setup["build"]
    first = ask(worker.id)
    assert first is not None
    send(worker, first, 0, "checking for gcc... no\n")
    report(worker.id, first, "JobFailed", error="builder failed: no compiler", kind="transient")
    promote_retries(now=timezone.now() + timedelta(hours=1))
    second = ask(worker.id)
    assert second is not None
    send(worker, second, 0, "checking for gcc... yes\n")

    body = client(member).get(f"/api/v1/builds/{build.id}").json()
    assert body["log_url"] == f"/api/v1/builds/{build.id}/log"
    assert body["last_error"] == "builder failed: no compiler"
    latest = client(member).get(body["log_url"])
    assert latest.status_code == 200
    assert latest["Content-Type"] == "text/plain; charset=utf-8"
    assert latest.content.decode() == "checking for gcc... yes\n"
    assert (latest["X-Log-Offset"], latest["X-Log-Complete"]) == ("0", "false")
    assert latest["X-Log-Assignment"] == str(second.assignment_id)
    earlier = client(member).get(f"{body['log_url']}?assignment={first.assignment_id}")
    assert earlier.content.decode() == "checking for gcc... no\n"
    assert earlier["X-Log-Complete"] == "true"
    tail = client(member).get(f"{body['log_url']}?offset=13")
    assert (tail.content.decode(), tail["X-Log-Offset"]) == ("gcc... yes\n", "13")
    beyond = client(member).get(f"{body['log_url']}?offset=1000")
    assert (beyond.status_code, beyond.content, beyond["X-Log-Offset"]) == (200, b"", "1000")
    unknown = client(member).get(f"{body['log_url']}?assignment={uuid.uuid4()}")
    assert unknown.status_code == 404


def test_a_text_only_client_gets_the_log_and_json_errors(setup: dict[str, Any]) -> None:
    worker, member, build = setup["worker"], setup["member"], setup["build"]
    a = ask(worker.id)
    send(worker, a, 0, "ok\n")
    response = client(member).get(f"/api/v1/builds/{build.id}/log", HTTP_ACCEPT="text/plain")
    assert (response.status_code, response.content) == (200, b"ok\n")
    bad = client(member).get(f"/api/v1/builds/{build.id}/log?offset=x", HTTP_ACCEPT="text/plain")
    assert bad.status_code == 400 and "offset" in bad.json()


@pytest.mark.parametrize(
    "query,field",
    [
        ("offset=-1", "offset"),
        ("offset=abc", "offset"),
        ("offset=1.5", "offset"),
        ("assignment=nope", "assignment"),
    ],
)
def test_bad_parameters_are_a_400_with_field_errors(setup: dict[str, Any], query: str, field: str) -> None:
    worker, member, build = setup["worker"], setup["member"], setup["build"]
    send(worker, ask(worker.id), 0, "x\n")
    response = client(member).get(f"/api/v1/builds/{build.id}/log?{query}")
    assert response.status_code == 400 and field in response.json()


def test_the_log_is_readable_by_whoever_may_read_the_build(setup: dict[str, Any]) -> None:
    worker, build = setup["worker"], setup["build"]
    send(worker, ask(worker.id), 0, "secret\n")
    assert client(setup["stranger"]).get(f"/api/v1/builds/{build.id}").status_code == 404
    assert client(setup["stranger"]).get(f"/api/v1/builds/{build.id}/log").status_code == 404
    assert APIClient().get(f"/api/v1/builds/{build.id}/log").status_code == 401
    staff = User.objects.create_user("staff", password="pw-staff-1", is_staff=True)
    assert client(staff).get(f"/api/v1/builds/{build.id}/log").status_code == 200


# --- ?lines= and ?q= (issue 34, item 4) --------------------------------------------------------------------


def _log_of_lines(setup: dict[str, Any], count: int) -> Any:
    """A log of `count` numbered lines, sent in pieces that split lines, as a worker streams it."""
    worker = setup["worker"]
    a = ask(worker.id)
    assert a is not None
    text = "".join(f"line {n}{' error: boom' if n % 50 == 0 else ''}\n" for n in range(1, count + 1))
    for start in range(0, len(text), 37):
        send(worker, a, start, text[start : start + 37])
    return a


def test_lines_a_to_b_answers_those_lines_of_an_open_log_and_of_a_sealed_one(setup: dict[str, Any]) -> None:
    from gradient.scheduling.services.logs import build_log_seal_pass

    a = _log_of_lines(setup, 300)
    c, path = client(setup["member"]), f"/api/v1/builds/{setup['build'].id}/log"
    for state in ("open", "sealed"):
        response = c.get(f"{path}?lines=120-122")
        assert response.status_code == 200, state
        assert response.content.decode() == "line 120\nline 121\nline 122\n"
        assert response["X-Log-Lines"] == "120-122"
        assert c.get(f"{path}?lines=299-").content.decode() == "line 299\nline 300 error: boom\n"
        assert c.get(f"{path}?lines=7").content.decode() == "line 7\n"
        assert c.get(f"{path}?lines=400-500")["X-Log-Lines"] == ""
        if state == "open":
            report(setup["worker"].id, a, "JobCompleted")
            assert build_log_seal_pass(now=timezone.now()) == 1


def test_q_answers_the_matching_lines_with_their_numbers_within_lines(setup: dict[str, Any]) -> None:
    _log_of_lines(setup, 300)
    c, path = client(setup["member"]), f"/api/v1/builds/{setup['build'].id}/log"
    found = c.get(f"{path}?q=ERROR")
    assert found.content.decode().splitlines() == [
        f"{n}:line {n} error: boom" for n in (50, 100, 150, 200, 250, 300)
    ]
    assert found["X-Log-Lines"] == "50-300" and "X-Log-More" not in found
    assert c.get(f"{path}?q=error&lines=60-160").content.decode() == (
        "100:line 100 error: boom\n150:line 150 error: boom\n"
    )


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("lines=0-3", "lines"),
        ("lines=9-3", "lines"),
        ("lines=a-b", "lines"),
        ("lines=1-200001", "lines"),
        ("q=", "q"),
        ("q=x&offset=3", "offset"),
    ],
)
def test_bad_lines_or_q_are_a_400_naming_the_parameter(setup: dict[str, Any], query: str, field: str) -> None:
    _log_of_lines(setup, 3)
    response = client(setup["member"]).get(f"/api/v1/builds/{setup['build'].id}/log?{query}")
    assert response.status_code == 400 and field in response.json()


def test_select_lines_reads_pieces_only_as_far_as_the_last_line_wanted() -> None:
    from gradient.scheduling.decisions.logs import LineQuery, select_lines

    read: list[str] = []

    def pieces() -> Any:
        for n in range(1, 1_000_000):
            read.append("x")
            yield f"l{n}\nl"  # each piece ends inside the next line

    assert list(select_lines(pieces(), LineQuery(first=3, last=4))) == [(3, "ll3"), (4, "ll4")]
    assert len(read) <= 5, "it stopped reading once past line 4"
    assert list(select_lines(["a\nb", "\nc"], LineQuery())) == [(1, "a"), (2, "b"), (3, "c")]
    assert list(select_lines(["a\n"], LineQuery())) == [(1, "a")], "a trailing newline opens no line"
    # A search counts the lines of pieces without a match instead of splitting them: same numbers.
    assert list(select_lines(["a\nb\n", "c\nerror\n", "d"], LineQuery(text="ERROR"))) == [(4, "error")]
    assert list(select_lines(["x\nxx er", "ror\ny"], LineQuery(text="error"))) == [(2, "xx error")]
