"""The project members' read-only web view (gradient/member.py, issue 34 item 3): a submitter signs in at
/my/ and reads its projects' evaluations, builds and logs under REST's authorization; another
project's are refused; nothing there changes anything."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from gradient.scheduling.models import DerivationBuild, Evaluation, EvaluationStatus
from gradient.scheduling.services import graph
from tests.factories import EvaluationFactory, ProjectFactory
from tests.scheduling_helpers import drv

pytestmark = pytest.mark.django_db


@pytest.fixture
def world() -> dict[str, object]:
    mine, theirs = ProjectFactory(name="rest-proj"), ProjectFactory(name="secret")
    ci = User.objects.create_user("ci", password="pw-ci-12345")
    mine.members.add(ci)
    evaluation = EvaluationFactory(
        project=mine,
        repository="sim:diamond",
        commit="c0ffee",
        status=EvaluationStatus.WAITING,
        waiting_reason={"reason": "eval_workers", "capability": "eval", "connected_workers": 0},
    )
    building = EvaluationFactory(project=mine, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=building, derivations=[drv("hello")], now=timezone.now())
    other = EvaluationFactory(project=theirs, repository="sim:hidden", commit="beef")
    return {"ci": ci, "evaluation": evaluation, "building": building, "other": other}


def _signed_in(user: object) -> Client:
    client = Client()
    client.force_login(user)  # type: ignore[arg-type]
    return client


def test_a_submitter_signs_in_at_my_and_lands_on_its_evaluations(world: dict[str, object]) -> None:
    client = Client()
    assert client.get("/my/")["Location"].startswith("/my/login/")
    signed = client.post("/my/login/", {"username": "ci", "password": "pw-ci-12345"})
    assert (signed.status_code, signed["Location"]) == (302, "/my/")
    page = client.get("/my/").content.decode()
    assert "sim:diamond@c0ffee" in page and "rest-proj" in page
    assert "Waiting for a worker that can eval" in page, "waiting in words, as the console says it"
    assert "sim:hidden" not in page, "another project's evaluation is not listed"


def test_a_wrong_password_shows_the_form_again(world: dict[str, object]) -> None:
    response = Client().post("/my/login/", {"username": "ci", "password": "nope"})
    assert response.status_code == 200 and "did not match" in response.content.decode()


def test_an_evaluation_its_builds_and_a_builds_page_are_readable_by_a_member(
    world: dict[str, object],
) -> None:
    client = _signed_in(world["ci"])
    building = world["building"]
    assert isinstance(building, Evaluation)
    page = client.get(f"/my/evaluations/{building.id}/").content.decode()
    build = DerivationBuild.objects.get()
    assert f"/my/builds/{build.id}/" in page and build.name in page
    build_page = client.get(f"/my/builds/{build.id}/").content.decode()
    assert build.drv_path in build_page and "No log yet." in build_page


def test_another_projects_evaluation_and_build_are_refused_and_unknown_ids_are_404(
    world: dict[str, object],
) -> None:
    client = _signed_in(world["ci"])
    other = world["other"]
    assert isinstance(other, Evaluation)
    assert client.get(f"/my/evaluations/{other.id}/").status_code == 403
    stranger_build = DerivationBuild.objects.create(drv_path="/nix/store/" + "1" * 32 + "-x.drv", system="x")
    assert client.get(f"/my/builds/{stranger_build.id}/").status_code == 403
    assert client.get("/my/evaluations/not-a-uuid/").status_code == 404
    assert client.get("/my/builds/00000000-0000-0000-0000-000000000000/").status_code == 404


def test_the_view_offers_no_change(world: dict[str, object]) -> None:
    client = _signed_in(world["ci"])
    evaluation = world["evaluation"]
    assert isinstance(evaluation, Evaluation)
    page = client.get(f"/my/evaluations/{evaluation.id}/").content.decode()
    assert "<form" not in page.split("</header>", 1)[1], "no form on the page but the header's sign-out"
    assert client.post(f"/my/evaluations/{evaluation.id}/").status_code == 405
    assert Evaluation.objects.get(id=evaluation.id).status == EvaluationStatus.WAITING
