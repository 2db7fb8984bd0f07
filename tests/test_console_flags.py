"""Issue 34, item 9 (item 7's "red ✖ icons for ordinary 'no' values"): the console shows no boolean
icons; a yes/no value is said in words ("not yet", "any zone", "no"), since Django's red ✖ reads as an
error where "no" is only an answer."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from gradient.records.models import JobRecord
from gradient.scheduling.models import CandidateScore, DerivationBuild
from gradient.scheduling.services import graph
from gradient.scheduling.services.evaluations import evaluation_create
from gradient.workers.models import WorkerSession
from tests.clusters_helpers import make_cluster, queued_build
from tests.factories import ProjectFactory, connected_worker
from tests.scheduling_helpers import drv

pytestmark = pytest.mark.django_db(transaction=True)  # the record's control hooks, as the console runs

ICONS = ("icon-no.svg", "icon-yes.svg")


@pytest.fixture
def console() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return client


def _page(console: Client, url: str) -> str:
    response = console.get(url)
    assert response.status_code == 200, url
    text = response.content.decode()
    assert not [icon for icon in ICONS if icon in text], f"{url} shows a boolean icon"
    return text


def test_no_list_or_page_of_the_scheduler_shows_a_boolean_icon_and_each_no_is_a_word(console: Client) -> None:
    project = ProjectFactory()
    worker = connected_worker([project])
    evaluation, _ = evaluation_create(project=project, repository="sim:one", commit="abc", now=timezone.now())
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("hello")], now=timezone.now())
    build = DerivationBuild.objects.get()
    CandidateScore.objects.create(
        worker=worker,
        job_id=build.job_key,
        missing_count=1,
        missing_nar_size=10,
        outputs_present=False,
        updated_at=timezone.now(),
    )
    cluster = make_cluster([("server", queued_build(project))])
    record = JobRecord.objects.get(job_key=evaluation.job_key)
    session = WorkerSession.objects.get(worker=worker)

    clusters = _page(console, reverse("admin:clusters_clusterjob_changelist"))
    assert "any zone" in clusters and "normal" in clusters
    cluster_page = _page(console, reverse("admin:clusters_clusterjob_change", args=[cluster.id]))
    assert "any zone" in cluster_page
    records = _page(console, reverse("admin:records_jobrecord_changelist"))
    assert "not yet" in records
    _page(console, reverse("admin:records_jobrecord_change", args=[record.pk]))
    builds = _page(console, reverse("admin:scheduling_derivationbuild_changelist"))
    assert '<td class="field-drv_lost">no</td>' in builds
    scores = _page(console, reverse("admin:scheduling_candidatescore_changelist"))
    assert '<td class="field-outputs_present_flag">no</td>' in scores
    sessions = _page(console, reverse("admin:workers_workersession_changelist"))
    assert '<td class="field-draining_flag">no</td>' in sessions
    _page(console, reverse("admin:workers_workersession_change", args=[session.id]))
    worker_page = _page(console, reverse("admin:workers_worker_change", args=[worker.id]))
    assert "field-active_flag" in worker_page
    evaluation_page = _page(console, reverse("admin:scheduling_evaluation_change", args=[evaluation.id]))
    assert '<td class="field-named_flag">' in evaluation_page  # the shared builds it needs, inline
    _page(console, reverse("admin:scheduling_derivationbuild_change", args=[build.id]))
    assert '<td class="field-primary_flag">' in cluster_page  # its members, inline
