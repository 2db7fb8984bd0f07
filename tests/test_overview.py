"""The console's live overview: staff only, and its JSON follows the scheduler (a worker connects)."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from gradient.clusters.models import ClusterReservation
from gradient.scheduling.models import EvaluationStatus
from gradient.workers.models import IdleSlot, WorkerSession
from tests.factories import ClusterJobFactory, ClusterMemberFactory, EvaluationFactory, WorkerFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_user("op", password="pw-op-1", is_staff=True))
    return client


def test_the_admin_index_links_to_the_overview_and_the_overview_renders(operator_client: Client) -> None:
    assert reverse("console-overview") in operator_client.get(reverse("admin:index")).content.decode()
    page = operator_client.get(reverse("console-overview"))
    assert page.status_code == 200
    text = page.content.decode()
    assert "Live overview" in text and 'id="overview-snapshot"' in text
    assert reverse("console-overview-json") in text  # the page polls it


def test_only_staff_reach_the_overview() -> None:
    anonymous = Client()
    member = Client()
    member.force_login(User.objects.create_user("member", password="pw-member-1"))
    for client in (anonymous, member):
        for name in ("console-overview", "console-overview-json"):
            response = client.get(reverse(name))
            assert response.status_code == 302 and reverse("admin:login") in response["Location"]


def test_the_json_changes_when_a_worker_connects(operator_client: Client) -> None:
    before = operator_client.get(reverse("console-overview-json")).json()
    assert before["workers"] == []
    worker = WorkerFactory(name="builder-1", zone="eu-1")
    now = timezone.now()
    WorkerSession.objects.create(
        worker=worker,
        channel_name="c",
        server_boot="00000000-0000-0000-0000-000000000001",
        opened_at=now,
        last_seen=now,
    )
    IdleSlot.objects.create(worker=worker, kind="build", recorded_at=now)
    after = operator_client.get(reverse("console-overview-json")).json()
    assert [(w["name"], w["zone"], w["draining"]) for w in after["workers"]] == [("builder-1", "eu-1", False)]
    assert after["idle_slots"] == {"eval": 0, "build": 1}


def test_a_stale_idle_slot_is_not_counted(operator_client: Client) -> None:
    IdleSlot.objects.create(
        worker=WorkerFactory(), kind="eval", recorded_at=timezone.now() - timezone.timedelta(seconds=60)
    )
    assert operator_client.get(reverse("console-overview-json")).json()["idle_slots"]["eval"] == 0


def test_queues_waiting_reasons_clusters_and_the_reservation_are_shown(operator_client: Client) -> None:
    EvaluationFactory()  # Queued
    reason = {"reason": "eval_workers", "capability": "evaluate", "connected_workers": 0}
    EvaluationFactory(status=EvaluationStatus.WAITING, waiting_reason=reason)
    EvaluationFactory(status=EvaluationStatus.WAITING, waiting_reason=reason)
    cluster = ClusterJobFactory(
        waiting_reason={"code": "too_few_workers", "needed": 2, "seatable_workers": 1},
        waiting_since=timezone.now(),
    )
    ClusterJobFactory(status="Running")
    now = timezone.now()
    ClusterReservation.objects.create(
        cluster_job=cluster, seats=[], created_at=now, expires_at=now + timezone.timedelta(minutes=5)
    )
    snapshot = operator_client.get(reverse("console-overview-json")).json()
    assert snapshot["queued"] == {"eval": 1, "build": 0}
    [group] = snapshot["waiting_evaluations"]
    assert group["reason"] == "eval_workers" and group["count"] == 2
    assert "Waiting for a worker that can evaluate" in group["example"]
    assert snapshot["clusters"]["running"] == 1 and snapshot["clusters"]["queued"] == 1
    assert [(c["id"], c["code"], c["why"]) for c in snapshot["clusters"]["waiting"]] == [
        (
            str(cluster.id),
            "too_few_workers",
            "Too few workers: 2 distinct workers needed, 1 could seat a member.",
        )
    ]
    assert snapshot["reservation"]["cluster"] == str(cluster.id)


def test_the_overview_names_clusters_and_draws_every_time_relative_with_the_exact_utc_time_on_hover(
    operator_client: Client,
) -> None:
    """Issue 24, items 3 and 4: the overview showed raw ISO times with microseconds ("Updated", "last
    seen") and a waiting cluster by its UUID."""
    cluster = ClusterJobFactory(waiting_reason={"code": "too_few_workers"}, waiting_since=timezone.now())
    ClusterMemberFactory(cluster_job=cluster, role="server")
    ClusterMemberFactory(cluster_job=cluster, role="client")
    ClusterMemberFactory(cluster_job=cluster, role="client")
    now = timezone.now()
    ClusterReservation.objects.create(
        cluster_job=cluster, seats=[], created_at=now, expires_at=now + timezone.timedelta(minutes=5)
    )
    snapshot = operator_client.get(reverse("console-overview-json")).json()
    [waiting] = snapshot["clusters"]["waiting"]
    assert waiting["name"] == "cluster 2 client + server"
    assert snapshot["reservation"]["name"] == "cluster 2 client + server"
    page = operator_client.get(reverse("console-overview")).content.decode()
    script = page[page.index("function draw(s)") :]
    # every time cell goes through when(): relative text, exact UTC in the title; no ISO text is drawn
    assert 'when(cell(tr, ""), w.last_seen)' in script and "cell(tr, w.last_seen)" not in script
    assert 'when(cell(tr, ""), c.waiting_since)' in script and 'text("ov-at", s.at)' not in script
    assert "cell(tr, c.name, c.url)" in script and "cell(tr, c.id, c.url)" not in script
    assert str(cluster) == "cluster 2 client + server (Queued)"
