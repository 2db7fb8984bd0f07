"""The evaluation and build routes of rest.md: submit (with Idempotency-Key), read, cancel, builds; and
401, 403, 400, 404 and 409 where they apply."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from gradient.records.models import RecordEntry
from gradient.scheduling.models import DerivationBuild, Evaluation, EvaluationStatus
from gradient.scheduling.services import graph
from tests.factories import ProjectFactory
from tests.scheduling_helpers import drv
from tests.support.rest import client

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"project": "nixpkgs-ci", "repository": "sim:diamond", "commit": "abc123"}


@pytest.fixture
def setup():  # type: ignore[no-untyped-def]
    project = ProjectFactory(name="nixpkgs-ci")
    member = User.objects.create_user("member", password="pw-member-1")
    project.members.add(member)
    stranger = User.objects.create_user("stranger", password="pw-stranger-1")
    staff = User.objects.create_user("staff", password="pw-staff-1", is_staff=True)
    return project, member, stranger, staff


def test_a_member_submits_an_evaluation_and_reads_it_back(setup) -> None:  # type: ignore[no-untyped-def]
    _, member, _, _ = setup
    response = client(member).post(
        "/api/v1/evaluations", {**BODY, "wildcards": ["packages.*.*"]}, format="json"
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["status"] == "Queued" and body["project"] == "nixpkgs-ci" and body["builds"] == []
    evaluation = Evaluation.objects.get(id=body["id"])
    assert evaluation.wildcards == ["packages.*.*"] and evaluation.created_by == member
    read = client(member).get(f"/api/v1/evaluations/{body['id']}").json()
    assert set(read) >= {"id", "project", "status", "waiting_reason", "created_at", "builds"}
    history = client(member).get(f"/api/v1/evaluations/{body['id']}/history").json()
    assert history["header"]["spec"]["repository"] == "sim:diamond"
    assert [e["body"]["fact"] for e in history["entries"]] == ["status_changed"]


def test_an_idempotent_repeat_returns_the_same_evaluation_and_another_body_is_a_conflict(setup) -> None:  # type: ignore[no-untyped-def]
    _, member, _, _ = setup
    c = client(member)
    first = c.post("/api/v1/evaluations", BODY, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    again = c.post("/api/v1/evaluations", BODY, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    other = c.post(
        "/api/v1/evaluations", {**BODY, "commit": "def"}, format="json", HTTP_IDEMPOTENCY_KEY="k-1"
    )
    assert (first.status_code, again.status_code, other.status_code) == (201, 200, 409)
    assert first.json()["id"] == again.json()["id"]
    assert Evaluation.objects.count() == 1


def test_without_a_token_every_route_is_401(setup) -> None:  # type: ignore[no-untyped-def]
    anonymous = client(None)
    some = uuid.uuid4()
    assert anonymous.post("/api/v1/evaluations", BODY, format="json").status_code == 401
    assert anonymous.get("/api/v1/evaluations").status_code == 401
    assert anonymous.get(f"/api/v1/evaluations/{some}").status_code == 401
    assert anonymous.post(f"/api/v1/evaluations/{some}/cancel").status_code == 401
    assert anonymous.get(f"/api/v1/builds/{some}").status_code == 401


def test_a_stranger_may_neither_submit_to_nor_read_another_project(setup) -> None:  # type: ignore[no-untyped-def]
    _, member, stranger, _ = setup
    assert client(stranger).post("/api/v1/evaluations", BODY, format="json").status_code == 403
    created = client(member).post("/api/v1/evaluations", BODY, format="json").json()
    assert (
        client(stranger).get(f"/api/v1/evaluations/{created['id']}").status_code == 404
    )  # not 403: the id is not the stranger's to learn
    assert client(stranger).post(f"/api/v1/evaluations/{created['id']}/cancel").status_code == 404
    assert client(stranger).get("/api/v1/evaluations").json()["count"] == 0
    assert Evaluation.objects.get().status == "Queued"


def test_bad_input_is_a_400_with_field_errors_and_writes_nothing(setup) -> None:  # type: ignore[no-untyped-def]
    _, member, _, _ = setup
    c = client(member)
    cases = [
        ({}, {"project", "repository", "commit"}),
        ({**BODY, "project": "nope"}, {"project"}),
        ({**BODY, "wildcards": "packages.*"}, {"wildcards"}),
        ({**BODY, "wait_for_workers": "maybe"}, {"wait_for_workers"}),
    ]
    for body, fields in cases:
        response = c.post("/api/v1/evaluations", body, format="json")
        assert response.status_code == 400, body
        assert set(response.json()) == fields
    assert c.get("/api/v1/evaluations?status=Nonsense").status_code == 400
    assert Evaluation.objects.count() == 0


def test_only_staff_may_prioritize(setup) -> None:  # type: ignore[no-untyped-def]
    _, member, _, staff = setup
    assert (
        client(member).post("/api/v1/evaluations", {**BODY, "priority": True}, format="json").status_code
        == 403
    )
    assert (
        client(staff).post("/api/v1/evaluations", {**BODY, "priority": True}, format="json").status_code
        == 201
    )


def test_unknown_ids_are_404(setup) -> None:  # type: ignore[no-untyped-def]
    _, member, _, _ = setup
    for url in (
        f"/api/v1/evaluations/{uuid.uuid4()}",
        "/api/v1/evaluations/not-a-uuid",
        f"/api/v1/builds/{uuid.uuid4()}",
    ):
        assert client(member).get(url).status_code == 404
    assert client(member).post(f"/api/v1/evaluations/{uuid.uuid4()}/cancel").status_code == 404


def test_cancel_is_a_control_intent_and_the_evaluation_ends_aborted(setup) -> None:  # type: ignore[no-untyped-def]
    _, member, _, _ = setup
    created = client(member).post("/api/v1/evaluations", BODY, format="json").json()
    response = client(member).post(f"/api/v1/evaluations/{created['id']}/cancel")
    assert response.status_code == 202 and response.json()["status"] == "Aborted"
    entries = list(RecordEntry.objects.filter(record__job_key=f"eval:{created['id']}").order_by("revision"))
    kinds = [(e.kind, e.actor) for e in entries]
    assert ("control", "member") in kinds
    assert entries[-1].kind == "fact" and '"outcome":"cancelled"' in entries[-1].body
    again = client(member).post(f"/api/v1/evaluations/{created['id']}/cancel")
    assert again.status_code == 202 and "stays cancelled" in again.json()["message"]


def test_a_build_shows_its_dependencies_to_members_of_a_project_that_needs_it(setup) -> None:  # type: ignore[no-untyped-def]
    project, member, stranger, _ = setup
    evaluation = Evaluation.objects.create(
        project=project, repository="sim:x", commit="1", status=EvaluationStatus.BUILDING
    )
    graph.ingest_eval_result(
        evaluation=evaluation,
        derivations=[drv("lib"), drv("app", "lib", features=["big"])],
        now=timezone.now(),
    )
    app = DerivationBuild.objects.get(drv_path__endswith="app.drv")
    lib = DerivationBuild.objects.get(drv_path__endswith="lib.drv")
    body = client(member).get(f"/api/v1/builds/{app.id}").json()
    assert body["dependencies"] == [str(lib.id)]
    assert (
        body["required_features"] == ["big"]
        and body["system"] == "x86_64-linux"
        and body["status"] == "Created"
    )
    assert (
        client(stranger).get(f"/api/v1/builds/{app.id}").status_code == 404
    )  # not 403: the id is not the stranger's to learn
    detail = client(member).get(f"/api/v1/evaluations/{evaluation.id}").json()
    assert {b["drv_path"] for b in detail["builds"]} == {app.drv_path, lib.drv_path}


def test_lists_filter_by_status_and_paginate(setup) -> None:  # type: ignore[no-untyped-def]
    _, member, _, _ = setup
    c = client(member)
    for i in range(3):
        c.post("/api/v1/evaluations", {**BODY, "commit": f"c{i}"}, format="json")
    page = c.get("/api/v1/evaluations?limit=2").json()
    assert page["count"] == 3 and len(page["results"]) == 2 and page["next"]
    assert c.get("/api/v1/evaluations?status=Completed").json()["count"] == 0


def test_an_operator_cancels_evaluations_from_the_admin(setup) -> None:  # type: ignore[no-untyped-def]
    from django.test import Client

    _, member, _, staff = setup
    staff.is_superuser = True
    staff.save()
    created = client(member).post("/api/v1/evaluations", BODY, format="json").json()
    browser = Client()
    browser.force_login(staff)
    response = browser.post(
        "/admin/scheduling/evaluation/",
        # behind a confirmation page now (issue 16): this post confirms
        {"action": "cancel_evaluations", "_selected_action": [created["id"]], "confirmed": "yes"},
        follow=True,
    )
    assert response.status_code == 200 and b"Cancelled 1 evaluations" in response.content
    assert Evaluation.objects.get(id=created["id"]).status == "Aborted"
    assert RecordEntry.objects.filter(
        record__job_key=f"eval:{created['id']}", kind="control", actor="admin:staff"
    ).exists()


def test_the_build_list_says_nothing_of_another_projects_evaluations(setup) -> None:  # type: ignore[no-untyped-def]
    # Issue 36, finding 8: a build shared with another project was counted under `?project=<other>`.
    project, member, _, staff = setup
    other = ProjectFactory(name="other-ci")
    mine = Evaluation.objects.create(project=project, repository="sim:x", commit="1")
    theirs = Evaluation.objects.create(project=other, repository="sim:x", commit="1")
    shared = [drv("shared-lib"), drv("shared-app", "shared-lib")]
    graph.ingest_eval_result(evaluation=mine, derivations=shared, now=timezone.now())
    graph.ingest_eval_result(evaluation=theirs, derivations=[*shared, drv("their-own")], now=timezone.now())

    assert client(member).get("/api/v1/builds?project=nixpkgs-ci").json()["count"] == 2
    assert client(member).get("/api/v1/builds?project=other-ci").json()["count"] == 0
    assert client(member).get(f"/api/v1/builds?evaluation={theirs.id}").json()["count"] == 0
    assert client(staff).get("/api/v1/builds?project=other-ci").json()["count"] == 3
    # And the other way round, for a member of the other project.
    other_member = User.objects.create_user("other-member", password="pw-other-1")
    other.members.add(other_member)
    assert client(other_member).get("/api/v1/builds?project=other-ci").json()["count"] == 3
    assert client(other_member).get("/api/v1/builds?project=nixpkgs-ci").json()["count"] == 0
    assert client(other_member).get(f"/api/v1/builds?evaluation={mine.id}").json()["count"] == 0
    assert client(other_member).get("/api/v1/builds").json()["count"] == 3


# --- REST answers that say what the docs say (issue 34, item 5) -------------------------------------------


def test_cancelling_a_completed_evaluation_is_a_400_that_writes_nothing(setup) -> None:  # type: ignore[no-untyped-def]
    from gradient.scheduling import history

    _, member, _, _ = setup
    created = client(member).post("/api/v1/evaluations", BODY, format="json").json()
    history.evaluation_transition(
        evaluation_id=created["id"], to="Completed", expect=None, reason="done", now=timezone.now()
    )
    before = RecordEntry.objects.filter(record__job_key=f"eval:{created['id']}").count()

    response = client(member).post(f"/api/v1/evaluations/{created['id']}/cancel")

    assert response.status_code == 400 and "Completed" in str(response.json()["non_field_errors"])
    assert RecordEntry.objects.filter(record__job_key=f"eval:{created['id']}").count() == before
    assert Evaluation.objects.get(id=created["id"]).status == "Completed"


def test_a_trailing_slash_is_redirected_to_the_route_keeping_the_query(setup) -> None:  # type: ignore[no-untyped-def]
    _, member, _, _ = setup
    c = client(member)
    response = c.get("/api/v1/evaluations/?limit=1")
    assert (response.status_code, response["Location"]) == (308, "/api/v1/evaluations?limit=1")
    assert c.get("/api/v1/evaluations/?limit=1", follow=True).json()["count"] == 0
    assert c.get("/api/v1/no-such-route/").status_code == 404


def test_the_schema_says_lists_omit_builds_and_failed_builds(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, _, staff = setup
    schema = client(staff).get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    fields = schema["components"]["schemas"]["Evaluation"]["properties"]
    for name in ("builds", "failed_builds"):
        assert "Empty in lists" in fields[name]["description"], name
    page = schema["components"]["schemas"]["EvaluationPage"]["properties"]["results"]
    assert "failed_builds" in page["description"] and "omitted in lists" in page["description"]


def test_a_json_body_sent_as_a_form_is_told_the_body_must_be_json(setup) -> None:  # type: ignore[no-untyped-def]
    import json

    _, member, _, _ = setup
    response = client(member).post(
        "/api/v1/evaluations", json.dumps(BODY), content_type="application/x-www-form-urlencoded"
    )
    assert response.status_code == 400
    assert "The body must be JSON" in " ".join(response.json()["non_field_errors"])
    assert Evaluation.objects.count() == 0


def test_builds_carry_their_names_named_dependencies_and_an_absolute_log_link(setup) -> None:  # type: ignore[no-untyped-def]
    from gradient.scheduling.models import BuildLog
    from tests.factories import DispatchedJobFactory

    project, member, _, _ = setup
    evaluation = Evaluation.objects.create(
        project=project, repository="sim:x", commit="1", status=EvaluationStatus.BUILDING
    )
    graph.ingest_eval_result(
        evaluation=evaluation, derivations=[drv("lib"), drv("app", "lib")], now=timezone.now()
    )
    app = DerivationBuild.objects.get(drv_path__endswith="app.drv")
    lib = DerivationBuild.objects.get(drv_path__endswith="lib.drv")
    BuildLog.objects.create(build=app, assignment=DispatchedJobFactory(derivation_build=app))

    body = client(member).get(f"/api/v1/builds/{app.id}").json()

    assert body["name"] == app.name and body["dependencies"] == [str(lib.id)]
    assert body["dependency_builds"] == [{"id": str(lib.id), "name": lib.name, "status": lib.status}]
    assert body["log_url"] == f"/api/v1/builds/{app.id}/log"
    assert body["log_link"] == f"http://testserver/api/v1/builds/{app.id}/log"
    detail = client(member).get(f"/api/v1/evaluations/{evaluation.id}").json()
    assert {b["name"] for b in detail["builds"]} == {app.name, lib.name}
    listed = client(member).get(f"/api/v1/builds?evaluation={evaluation.id}").json()["results"]
    assert {b["name"] for b in listed} == {app.name, lib.name}
