"""The evaluation admin says what a waiting evaluation waits for, in words, and filters by it."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from gradient.scheduling.decisions.waiting import describe
from gradient.scheduling.models import EvaluationStatus
from tests.factories import EvaluationFactory

pytestmark = pytest.mark.django_db

NO_ARM = {
    "reason": "workers",
    "unmet": [{"architecture": "aarch64-linux", "required_features": ["kvm"], "builds": 3}],
    "connected_workers": 2,
    "available_architectures": ["x86_64-linux"],
}
NO_FETCH = {"reason": "eval_workers", "capability": "fetch", "connected_workers": 0}


@pytest.fixture
def operator_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return client


def _waiting(reason: dict[str, object], repository: str):  # type: ignore[no-untyped-def]
    return EvaluationFactory(
        repository=repository,
        status=EvaluationStatus.WAITING,
        waiting_reason=reason,
        waiting_since=timezone.now(),
    )


def test_the_list_shows_what_each_evaluation_waits_for_in_words(operator_client: Client) -> None:
    _waiting(NO_ARM, "sim:arm")
    running = EvaluationFactory(repository="sim:running", status=EvaluationStatus.BUILDING)
    page = operator_client.get(reverse("admin:scheduling_evaluation_changelist")).content.decode()
    assert "Waiting for" in page
    assert "no connected worker can build aarch64-linux with kvm (3 builds)" in page
    assert "architectures available: x86_64-linux" in page
    assert str(running.id) in page


def test_the_detail_page_shows_the_reason_in_words(operator_client: Client) -> None:
    evaluation = _waiting(NO_FETCH, "sim:fetch")
    page = operator_client.get(
        reverse("admin:scheduling_evaluation_change", args=[evaluation.id])
    ).content.decode()
    assert describe(NO_FETCH) in page
    assert "Waiting for a worker that can fetch" in page


def test_the_list_filters_by_waiting_reason(operator_client: Client) -> None:
    arm, fetch = _waiting(NO_ARM, "sim:arm"), _waiting(NO_FETCH, "sim:fetch")
    building = EvaluationFactory(repository="sim:building", status=EvaluationStatus.BUILDING)
    url = reverse("admin:scheduling_evaluation_changelist")
    unfiltered = operator_client.get(url).content.decode()
    assert "a worker that can build it (architecture, features)" in unfiltered  # the filter's choices

    page = operator_client.get(url, {"waiting_for": "workers"}).content.decode()

    assert str(arm.id) in page
    assert str(fetch.id) not in page and str(building.id) not in page
    page = operator_client.get(url, {"waiting_for": "eval_workers"}).content.decode()
    assert str(fetch.id) in page and str(arm.id) not in page
