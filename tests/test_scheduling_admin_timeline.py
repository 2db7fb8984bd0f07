"""The evaluation and shared-build pages of the admin show the job's record as a timeline."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from gradient.scheduling.services.evaluations import evaluation_create, evaluation_request_cancel
from tests.factories import DerivationBuildFactory, EvaluationFactory, ProjectFactory

pytestmark = pytest.mark.django_db(transaction=True)  # the control hook runs once the intent committed


@pytest.fixture
def operator_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return client


def test_the_evaluation_page_shows_facts_and_the_operators_cancel_on_its_timeline(
    operator_client: Client,
) -> None:
    evaluation, _ = evaluation_create(
        project=ProjectFactory(), repository="sim:diamond", commit="abc", now=timezone.now()
    )
    evaluation_request_cancel(evaluation_id=evaluation.id, actor="alice", now=timezone.now())
    page = operator_client.get(
        reverse("admin:scheduling_evaluation_change", args=[evaluation.id])
    ).content.decode()
    assert f"eval:{evaluation.id}" in page
    assert "status Queued: submitted" in page  # the fact, by the system
    assert "cancel requested" in page and "alice" in page  # the intent, by the operator


def test_a_job_made_outside_the_services_says_it_has_no_record(operator_client: Client) -> None:
    evaluation = EvaluationFactory(record=False)
    build = DerivationBuildFactory()
    for url in (
        reverse("admin:scheduling_evaluation_change", args=[evaluation.id]),
        reverse("admin:scheduling_derivationbuild_change", args=[build.id]),
    ):
        response = operator_client.get(url)
        assert (
            response.status_code == 200
            and "no record (made outside the services)" in response.content.decode()
        )
