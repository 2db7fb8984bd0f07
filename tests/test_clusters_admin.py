"""The admin lists cluster jobs, shows each with its members and attempts (seats, outcome, timing), and
aborts after a confirmation page by appending the abort intent to each cluster's record."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from gradient.clusters.models import ClusterJob, ClusterStatus
from gradient.core.vocab import BuildStatus
from gradient.records.selectors import record_job
from tests.clusters_helpers import cluster_only_build, make_cluster, queued_build, seat_worker, started
from tests.factories import ProjectFactory

pytestmark = pytest.mark.django_db(transaction=True)  # the control hook runs once the intent committed


@pytest.fixture
def operator_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return client


def test_the_cluster_list_and_page_show_members_and_attempts_with_their_seats(
    operator_client: Client,
) -> None:
    project = ProjectFactory()
    cluster = make_cluster([("server", queued_build(project)), ("client", queued_build(project))])
    workers = [seat_worker(project), seat_worker(project)]
    started(cluster, workers)
    listing = operator_client.get(reverse("admin:clusters_clusterjob_changelist"))
    assert listing.status_code == 200 and str(cluster.id) in listing.content.decode()
    page = operator_client.get(
        reverse("admin:clusters_clusterjob_change", args=[cluster.id])
    ).content.decode()
    assert "server" in page and "client" in page
    # seats go in (role, index) order: client on the first worker, server on the second
    assert f"client[0] on {workers[0].id}" in page and f"server[0] on {workers[1].id}" in page
    attempt_page = operator_client.get(
        reverse("admin:clusters_clusterattempt_change", args=[cluster.attempt_rows.get().id])
    )
    assert attempt_page.status_code == 200


def test_abort_asks_for_confirmation_first_and_then_appends_the_intent(operator_client: Client) -> None:
    project = ProjectFactory()
    cluster = make_cluster([("a", queued_build(project))])
    url = reverse("admin:clusters_clusterjob_changelist")
    asked = operator_client.post(url, {"action": "abort_clusters", "_selected_action": [str(cluster.id)]})
    assert asked.status_code == 200 and "Yes, abort them" in asked.content.decode()
    assert ClusterJob.objects.get(id=cluster.id).status == ClusterStatus.QUEUED
    done = operator_client.post(
        url,
        {"action": "abort_clusters", "_selected_action": [str(cluster.id)], "confirmed": "yes"},
        follow=True,
    )
    assert done.status_code == 200
    assert ClusterJob.objects.get(id=cluster.id).status == ClusterStatus.ABORTED
    job = record_job(job_key=cluster.job_key, now=ClusterJob.objects.get(id=cluster.id).finished_at)
    assert [(c.intent, c.actor) for c in job.controls] == [("cancel", "admin:root")]


def test_the_cluster_page_shows_its_record_as_a_timeline_with_the_operators_intent(
    operator_client: Client,
) -> None:
    project = ProjectFactory()
    cluster = make_cluster([("a", queued_build(project))])
    operator_client.post(
        reverse("admin:clusters_clusterjob_changelist"),
        {"action": "abort_clusters", "_selected_action": [str(cluster.id)], "confirmed": "yes"},
    )
    page = operator_client.get(
        reverse("admin:clusters_clusterjob_change", args=[cluster.id])
    ).content.decode()
    assert "Record (timeline)" in page and f"cluster:{cluster.id}" in page
    assert "cancel requested" in page and "admin:root" in page


def test_the_abort_confirmation_names_the_shared_build_it_spares_and_what_ends_aborted(
    operator_client: Client,
) -> None:
    """Issue 24, item 2: a member build that evaluations outside the cluster need is spared (requeued and
    built on its own), and the confirmation page says so before anything happens."""
    project = ProjectFactory()
    shared = queued_build(project)
    lone = cluster_only_build()
    cluster = make_cluster([("server", shared), ("client", lone)])
    url = reverse("admin:clusters_clusterjob_operate", args=[cluster.id, "abort_clusters"])
    asked = operator_client.get(url).content.decode()
    assert f"server[0]: build {shared.name} is spared: evaluations outside this cluster need it" in asked
    assert f"client[0]: build {lone.name} ends Aborted" in asked
    operator_client.post(url, {"confirmed": "yes"})
    shared.refresh_from_db(), lone.refresh_from_db()
    assert (shared.status, lone.status) == (BuildStatus.QUEUED, BuildStatus.ABORTED)
