"""The console as an operator meets it (issue 24, items 3 and 7): jobs, workers and tries by name with
links, not UUIDs; done-messages that name the row with its status after the action, not before, and do
not capitalise its name."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from gradient.core.vocab import EvaluationStatus
from gradient.scheduling import history
from gradient.scheduling.models import Evaluation
from gradient.scheduling.services.evaluations import evaluation_create
from tests.factories import (
    DerivationBuildFactory,
    DispatchedJobFactory,
    EvaluationFactory,
    ProjectFactory,
    WorkerFactory,
    WorkerSessionFactory,
)

pytestmark = pytest.mark.django_db(transaction=True)  # control hooks run once the intent committed

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@pytest.fixture
def console() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return client


def visible(html: str) -> str:
    """The text a reader sees: no tags, attributes, scripts or folded JSON."""
    html = re.sub(r"<(script|style|details)\b.*?</\1>", "", html, flags=re.S)
    html = re.sub(r'<input[^>]*type="hidden"[^>]*>', "", html)
    return re.sub(r"<[^>]+>", " ", html)


def test_a_workers_jobs_and_the_assignment_list_name_their_jobs_and_link_them(console: Client) -> None:
    worker = WorkerFactory(name="builder-2")
    WorkerSessionFactory(worker=worker)
    build = DerivationBuildFactory(drv_path="/nix/store/" + "a" * 32 + "-hello-2.12.drv")
    DispatchedJobFactory(
        worker=worker, derivation_build=build, finished_at=timezone.now(), outcome="Succeeded"
    )
    DispatchedJobFactory(worker=worker, derivation_build=DerivationBuildFactory())  # running now
    page = console.get(reverse("admin:workers_worker_change", args=[worker.id])).content.decode()
    build_url = reverse("admin:scheduling_derivationbuild_change", args=[build.id])
    assert f'<a href="{build_url}">build hello-2.12</a>' in page
    assert "build:" not in visible(page)
    listing = console.get(reverse("admin:scheduling_dispatchedjob_changelist")).content.decode()
    assert "build hello-2.12" in listing and f'href="{build_url}"' in listing
    assert not UUID.search(visible(listing))


def test_the_evaluation_list_links_names_and_keeps_its_times_in_front(console: Client) -> None:
    evaluation, _ = evaluation_create(
        project=ProjectFactory(name="nixpkgs-ci"),
        repository="sim:diamond",
        commit="c0ffee",
        now=timezone.now(),
    )
    listing = console.get(reverse("admin:scheduling_evaluation_changelist")).content.decode()
    assert "sim:diamond@c0ffee" in listing
    assert not UUID.search(visible(listing))
    headers = [h.lower() for h in re.findall(r'<div class="text">(?:<a [^>]*>|<span>)([^<]+)<', listing)]
    assert headers.index("created") < headers.index("progress") and headers.index("evaluation") == 0
    assert Evaluation.objects.count() == 1 and str(evaluation.id) not in visible(listing)


def test_a_restart_says_where_the_new_evaluation_is_by_name_with_a_link_and_the_status_after_it(
    console: Client,
) -> None:
    evaluation, _ = evaluation_create(
        project=ProjectFactory(name="demo"), repository="sim:diamond", commit="c0ffee", now=timezone.now()
    )
    history.evaluation_transition(
        evaluation_id=evaluation.id,
        to=EvaluationStatus.FAILED,
        expect=None,
        reason="done",
        now=timezone.now(),
    )
    url = reverse("admin:scheduling_evaluation_operate", args=[evaluation.id, "restart_evaluations"])
    done = console.post(url, {"confirmed": "yes"}, follow=True).content.decode()
    successor = Evaluation.objects.exclude(id=evaluation.id).get()
    link = reverse("admin:scheduling_evaluation_change", args=[successor.id])
    assert f'restarted as <a href="{link}">sim:diamond@c0ffee</a>' in done
    assert "Evaluation “demo: sim:diamond@c0ffee (Failed)”: restarted" in done  # not “Demo: …”
    page = console.get(reverse("admin:scheduling_evaluation_change", args=[evaluation.id])).content.decode()
    assert f'restarted as <a href="{link}">sim:diamond@c0ffee</a> (Queued)' in page


def test_a_drained_workers_message_shows_its_state_after_the_drain_and_its_name_as_written(
    console: Client,
) -> None:
    worker = WorkerFactory(name="demo-a")
    WorkerSessionFactory(worker=worker)
    url = reverse("admin:workers_worker_operate", args=[worker.id, "drain_workers"])
    done = console.post(url, {"confirmed": "yes"}, follow=True).content.decode()
    assert "Worker “demo-a”" in done and "Demo-a" not in done


def test_errors_and_outputs_are_lists_and_a_finished_evaluation_has_no_empty_waiting_row(
    console: Client,
) -> None:
    """Issue 24, item 7: errors and outputs were shown as raw JSON lists, and "Waiting for:" stayed on the
    page of an evaluation that waits for nothing."""
    evaluation, _ = evaluation_create(
        project=ProjectFactory(), repository="sim:diamond", commit="c0ffee", now=timezone.now()
    )
    failed = "/nix/store/" + "b" * 32 + "-hello-2.12.1.drv"
    history.evaluation_transition(
        evaluation_id=evaluation.id,
        to=EvaluationStatus.FAILED,
        expect=None,
        reason="1 builds failed",
        now=timezone.now(),
        errors=[f"{failed}: FailedPermanent"],
    )
    page = console.get(reverse("admin:scheduling_evaluation_change", args=[evaluation.id])).content.decode()
    assert '<ul class="plain-list"><li>hello-2.12.1: FailedPermanent</li></ul>' in page
    assert '["' not in visible(page) and "Waiting for:" not in visible(page)
    waiting = EvaluationFactory(
        status=EvaluationStatus.WAITING,
        waiting_reason={"reason": "eval_workers", "capability": "evaluate", "connected_workers": 0},
    )
    shown = console.get(reverse("admin:scheduling_evaluation_change", args=[waiting.id])).content.decode()
    assert "Waiting for:" in visible(shown)  # the row is there while it waits
    build = DerivationBuildFactory(
        outputs=[{"name": "out", "path": "/nix/store/" + "c" * 32 + "-hello"}], required_features=["kvm"]
    )
    page = console.get(reverse("admin:scheduling_derivationbuild_change", args=[build.id])).content.decode()
    assert "<li>out: /nix/store/" in page and "<li>kvm</li>" in page
    assert "[{" not in visible(page)


def test_a_refused_add_says_why_and_what_to_do_instead(console: Client) -> None:
    response = console.get(reverse("admin:scheduling_evaluation_add"))
    assert response.status_code == 403
    text = response.content.decode()
    assert "read-only in the console" in text and "POST /api/v1/evaluations" in text
    assert "use the action on its page" in text


def test_the_admin_index_lists_the_scheduler_first_and_names_the_token_and_celery_tables(
    console: Client,
) -> None:
    text = visible(console.get(reverse("admin:index")).content.decode())
    assert text.index("Scheduling") < text.index("Accounts · users and groups")
    assert text.index("Job records") < text.index("Accounts · REST API tokens")
    assert "Periodic passes under Celery beat" in text
    assert "Knox" not in text and "Auth Token" not in text


def test_a_cluster_page_shows_its_times_like_every_other_page(console: Client) -> None:
    """Issue 24, item 4: cluster pages used Django's absolute format, other pages relative times."""
    from tests.factories import ClusterJobFactory

    cluster = ClusterJobFactory()
    page = console.get(reverse("admin:clusters_clusterjob_change", args=[cluster.id])).content.decode()
    assert re.search(r'<time datetime="[^"]+" title="[^"]+ UTC">[^<]+ ago</time>', page)
    listing = console.get(reverse("admin:clusters_clusterjob_changelist")).content.decode()
    assert re.search(r'<time datetime="[^"]+" title="[^"]+ UTC">[^<]+ ago</time>', listing)
