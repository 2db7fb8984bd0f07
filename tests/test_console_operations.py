"""The operator's console is safe by construction (issue 16): every scheduler-owned model is read-only
in the admin, for superusers too; every change an operator makes is an action, behind a confirmation
page, that calls the services and appends a control intent naming the operator; the same actions in
REST answer 202. Each test reads the record afterwards."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.auth.models import User
from django.test import Client, RequestFactory
from django.urls import reverse
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gradient.core.vocab import BuildStatus, EvaluationStatus
from gradient.records.selectors import record_job
from gradient.records.services import records_check
from gradient.scheduling import history
from gradient.scheduling.models import BuildAttempt, DerivationBuild, Evaluation, EvaluationBuild
from gradient.scheduling.services.evaluations import evaluation_create
from gradient.workers.models import Worker
from tests.factories import (
    DerivationBuildFactory,
    DispatchedJobFactory,
    ProjectFactory,
    WorkerFactory,
    WorkerSessionFactory,
)

pytestmark = pytest.mark.django_db(transaction=True)  # control hooks run once the intent committed

OWNED_APPS = {"scheduling", "workers", "clusters", "records", "recovery"}
EDITABLE = {"scheduling.project", "workers.worker"}  # a project; a worker's name and projects


@pytest.fixture
def root() -> User:
    return User.objects.create_superuser("root", "root@example.com", "pw")


@pytest.fixture
def console(root: User) -> Client:
    client = Client()
    client.force_login(root)
    return client


def api(user: User) -> APIClient:
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")
    return c


def _owned() -> list[tuple[str, admin.ModelAdmin]]:
    return [
        (f"{model._meta.app_label}.{model._meta.model_name}", model_admin)
        for model, model_admin in admin.site._registry.items()
        if model._meta.app_label in OWNED_APPS
        and f"{model._meta.app_label}.{model._meta.model_name}" not in EDITABLE
    ]


def _finished(status: str = EvaluationStatus.COMPLETED, **fields: object) -> Evaluation:
    evaluation, _ = evaluation_create(
        project=ProjectFactory(), repository="sim:diamond", commit="c0ffee", now=timezone.now(), **fields
    )
    history.evaluation_transition(
        evaluation_id=evaluation.id, to=status, expect=None, reason="done", now=timezone.now()
    )
    return Evaluation.objects.get(id=evaluation.id)


def _controls(job_key: str) -> list[tuple[str, str]]:
    return [(c.intent, c.actor) for c in record_job(job_key=job_key, now=timezone.now()).controls]


# --- Read-only -------------------------------------------------------------------------------------------


def test_every_scheduler_owned_model_refuses_add_change_and_delete_for_a_superuser(
    console: Client, root: User
) -> None:
    owned = _owned()
    assert len(owned) >= 15  # every table of docs/architecture.md's apps but projects and workers
    request = RequestFactory().get("/admin/")
    request.user = root
    for name, model_admin in owned:
        meta = model_admin.model._meta
        add = console.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_add"))
        assert add.status_code == 403, name
        assert not model_admin.has_add_permission(request), name
        assert not model_admin.has_change_permission(request), name
        assert not model_admin.has_delete_permission(request), name
        assert "delete_selected" not in model_admin.get_actions(request), name
        listing = console.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist"))
        assert listing.status_code == 200, name
        add_url = reverse(f"admin:{meta.app_label}_{meta.model_name}_add")
        assert f'href="{add_url}"' not in listing.content.decode(), name


def test_an_evaluations_page_is_a_view_and_a_status_edit_is_refused(console: Client) -> None:
    evaluation = _finished()
    url = reverse("admin:scheduling_evaluation_change", args=[evaluation.id])
    page = console.get(url).content.decode()
    assert 'name="_save"' not in page and 'name="status"' not in page and "deletelink" not in page
    refused = console.post(url, {"status": EvaluationStatus.QUEUED, "finished_at": ""})
    assert refused.status_code == 403
    assert Evaluation.objects.get(id=evaluation.id).status == EvaluationStatus.COMPLETED
    delete = console.post(
        reverse("admin:scheduling_evaluation_delete", args=[evaluation.id]), {"post": "yes"}
    )
    assert delete.status_code == 403 and Evaluation.objects.filter(id=evaluation.id).exists()


def test_a_workers_name_and_projects_stay_editable_and_nothing_it_reports(console: Client) -> None:
    worker = WorkerFactory(name="old-name", cpu_usage_pct=12.5)
    url = reverse("admin:workers_worker_change", args=[worker.id])
    page = console.get(url).content.decode()
    assert 'name="name"' in page and 'name="projects"' in page and 'name="_save"' in page
    assert 'name="cpu_usage_pct"' not in page and 'name="active"' not in page
    assert "12.5 %" in page  # metrics as a view
    console.post(
        url,
        {
            "name": "new-name",
            "cpu_usage_pct": "99",
            "active": "",
            "sessions-TOTAL_FORMS": 0,
            "sessions-INITIAL_FORMS": 0,
        },
    )
    worker.refresh_from_db()
    assert worker.name == "new-name" and worker.cpu_usage_pct == 12.5 and worker.active


def test_check_records_flags_a_status_change_without_its_fact() -> None:
    evaluation = _finished()
    Evaluation.objects.filter(id=evaluation.id).update(status=EvaluationStatus.QUEUED, finished_at=None)
    report = records_check(now=timezone.now(), settle=False)
    assert evaluation.job_key in [p.job_key for p in report.problems]


# --- The actions, from the console ---------------------------------------------------------------------


def _operate(console: Client, app_model: str, pk: object, name: str) -> str:
    url = reverse(f"admin:{app_model}_operate", args=[pk, name])
    asked = console.get(url)
    assert asked.status_code == 200 and "Yes, " in asked.content.decode()
    return console.post(url, {"confirmed": "yes"}, follow=True).content.decode()


def test_restart_from_the_console_makes_a_successor_with_lineage_in_the_record(console: Client) -> None:
    evaluation = _finished(EvaluationStatus.FAILED)
    page = console.get(reverse("admin:scheduling_evaluation_change", args=[evaluation.id])).content.decode()
    assert "operate/restart_evaluations/" in page  # the button on its page

    _operate(console, "scheduling_evaluation", evaluation.id, "restart_evaluations")

    job = record_job(job_key=evaluation.job_key, now=timezone.now())
    assert [(c.intent, c.actor) for c in job.controls] == [("resubmit", "admin:root")]
    assert job.successor is not None and not job.pending_resubmit
    successor = Evaluation.objects.get(id=job.successor.split(":", 1)[1])
    assert (successor.repository, successor.commit, successor.status) == ("sim:diamond", "c0ffee", "Queued")
    new = record_job(job_key=successor.job_key, now=timezone.now())
    assert (new.supersedes, new.generation) == (evaluation.job_key, 2)
    assert Evaluation.objects.get(id=evaluation.id).status == EvaluationStatus.FAILED  # the verdict stays


def test_a_running_evaluation_is_not_restarted_and_nothing_changes(console: Client) -> None:
    evaluation, _ = evaluation_create(
        project=ProjectFactory(), repository="sim:chain", commit="1", now=timezone.now()
    )
    url = reverse("admin:scheduling_evaluation_operate", args=[evaluation.id, "restart_evaluations"])
    console.post(url, {"confirmed": "yes"})
    assert Evaluation.objects.count() == 1 and _controls(evaluation.job_key) == []


def test_prioritize_an_evaluation_from_the_console(console: Client) -> None:
    evaluation, _ = evaluation_create(
        project=ProjectFactory(), repository="sim:chain", commit="1", now=timezone.now()
    )
    build = DerivationBuildFactory(status=BuildStatus.QUEUED)
    EvaluationBuild.objects.create(evaluation=evaluation, build=build)
    _operate(console, "scheduling_evaluation", evaluation.id, "prioritize_evaluations")
    assert Evaluation.objects.get(id=evaluation.id).priority
    assert DerivationBuild.objects.get(id=build.id).prioritized
    assert _controls(evaluation.job_key) == [("prioritize", "admin:root")]


def test_cancel_from_the_evaluations_page_asks_first(console: Client) -> None:
    evaluation, _ = evaluation_create(
        project=ProjectFactory(), repository="sim:chain", commit="1", now=timezone.now()
    )
    url = reverse("admin:scheduling_evaluation_operate", args=[evaluation.id, "cancel_evaluations"])
    assert "Yes, cancel it" in console.get(url).content.decode()
    assert Evaluation.objects.get(id=evaluation.id).status == EvaluationStatus.QUEUED
    console.post(url, {"confirmed": "yes"})
    assert Evaluation.objects.get(id=evaluation.id).status == EvaluationStatus.ABORTED
    assert _controls(evaluation.job_key) == [("cancel", "admin:root")]  # as every console action (issue 34)


def _failed_build_of(evaluation: Evaluation) -> tuple[DerivationBuild, DerivationBuild]:
    failed = DerivationBuildFactory(status=BuildStatus.FAILED_PERMANENT, attempts=3, last_error="boom")
    dependent = DerivationBuildFactory(status=BuildStatus.DEPENDENCY_FAILED)
    dependent.dependency_edges.create(dependency=failed)
    EvaluationBuild.objects.create(evaluation=evaluation, build=failed)
    EvaluationBuild.objects.create(evaluation=evaluation, build=dependent)
    return failed, dependent


def test_rebuild_a_failed_build_from_the_console(console: Client) -> None:
    evaluation = _finished(EvaluationStatus.FAILED)
    failed, dependent = _failed_build_of(evaluation)
    _operate(console, "scheduling_derivationbuild", failed.id, "rebuild_builds")
    failed.refresh_from_db()
    dependent.refresh_from_db()
    assert (failed.status, failed.attempts, failed.last_error) == (BuildStatus.QUEUED, 0, "")
    assert dependent.status == BuildStatus.CREATED  # waits for it again
    assert _controls(evaluation.job_key) == [("rebuild", "admin:root")]
    body = record_job(job_key=evaluation.job_key, now=timezone.now())
    assert body.outcome.value == "failed"  # the evaluation's verdict stays


def test_prioritize_a_queued_build_from_the_console(console: Client) -> None:
    evaluation, _ = evaluation_create(
        project=ProjectFactory(), repository="sim:chain", commit="1", now=timezone.now()
    )
    build = DerivationBuildFactory(status=BuildStatus.QUEUED)
    EvaluationBuild.objects.create(evaluation=evaluation, build=build)
    _operate(console, "scheduling_derivationbuild", build.id, "prioritize_builds")
    assert DerivationBuild.objects.get(id=build.id).prioritized
    assert _controls(evaluation.job_key) == [("prioritize", "admin:root")]


def _worker_running(evaluation: Evaluation) -> Worker:
    worker = WorkerFactory(name="builder-1")
    WorkerSessionFactory(worker=worker)
    build = DerivationBuildFactory(status=BuildStatus.BUILDING)
    EvaluationBuild.objects.create(evaluation=evaluation, build=build)
    DispatchedJobFactory(worker=worker, derivation_build=build)
    return worker


def test_drain_and_deactivate_a_worker_from_the_console(console: Client) -> None:
    evaluation, _ = evaluation_create(
        project=ProjectFactory(), repository="sim:chain", commit="1", now=timezone.now()
    )
    history.evaluation_transition(
        evaluation_id=evaluation.id, to=EvaluationStatus.BUILDING, expect=None, reason="x", now=timezone.now()
    )
    worker = _worker_running(evaluation)
    _operate(console, "workers_worker", worker.id, "drain_workers")
    assert worker.sessions.get().draining
    _operate(console, "workers_worker", worker.id, "deactivate_workers")
    worker.refresh_from_db()
    assert not worker.active and worker.sessions.get().closed_at is not None
    assert _controls(evaluation.job_key) == [
        ("drain_worker", "admin:root"),
        ("deactivate_worker", "admin:root"),
    ]
    timeline = console.get(reverse("admin:scheduling_evaluation_change", args=[evaluation.id])).content
    assert b"drain requested for worker builder-1" in timeline


# --- The same actions in REST ----------------------------------------------------------------------------


@pytest.fixture
def staff() -> User:
    return User.objects.create_user("ops", password="pw-ops-12345", is_staff=True)


def test_restart_in_rest_answers_202_with_the_successor(staff: User) -> None:
    evaluation = _finished()
    response = api(staff).post(f"/api/v1/evaluations/{evaluation.id}/restart")
    assert response.status_code == 202, response.content
    body = response.json()
    successor = Evaluation.objects.get(id=body["successor"])
    assert body["records"] == [evaluation.job_key]
    assert _controls(evaluation.job_key) == [("resubmit", "ops")]
    assert record_job(job_key=successor.job_key, now=timezone.now()).supersedes == evaluation.job_key
    again = api(staff).post(f"/api/v1/evaluations/{evaluation.id}/restart")
    assert again.status_code == 400 and "non_field_errors" in again.json()
    assert Evaluation.objects.count() == 2


def test_rest_refuses_what_does_not_apply_and_changes_nothing(staff: User) -> None:
    evaluation, _ = evaluation_create(
        project=ProjectFactory(), repository="sim:chain", commit="1", now=timezone.now()
    )
    queued = DerivationBuildFactory(status=BuildStatus.QUEUED)
    assert api(staff).post(f"/api/v1/evaluations/{evaluation.id}/restart").status_code == 400
    assert api(staff).post(f"/api/v1/builds/{queued.id}/rebuild").status_code == 400
    assert api(staff).post("/api/v1/builds/not-an-id/rebuild").status_code == 404
    assert _controls(evaluation.job_key) == []
    assert DerivationBuild.objects.get(id=queued.id).status == BuildStatus.QUEUED


def test_prioritize_rebuild_and_drain_in_rest_answer_202_and_sign_the_record(staff: User) -> None:
    evaluation, _ = evaluation_create(
        project=ProjectFactory(), repository="sim:chain", commit="1", now=timezone.now()
    )
    history.evaluation_transition(
        evaluation_id=evaluation.id, to=EvaluationStatus.BUILDING, expect=None, reason="x", now=timezone.now()
    )
    failed, _ = _failed_build_of(evaluation)
    queued = DerivationBuildFactory(status=BuildStatus.QUEUED)
    EvaluationBuild.objects.create(evaluation=evaluation, build=queued)
    worker = _worker_running(evaluation)
    c = api(staff)
    assert c.post(f"/api/v1/evaluations/{evaluation.id}/prioritize").status_code == 202
    assert c.post(f"/api/v1/builds/{queued.id}/prioritize").status_code == 202
    assert c.post(f"/api/v1/builds/{failed.id}/rebuild").status_code == 202
    drained = c.post(f"/api/v1/workers/{worker.id}/drain")
    assert drained.status_code == 202 and drained.json()["records"] == [evaluation.job_key]
    assert c.post(f"/api/v1/workers/{worker.id}/deactivate").status_code == 200
    assert [intent for intent, _ in _controls(evaluation.job_key)] == [
        "prioritize",
        "prioritize",
        "rebuild",
        "drain_worker",
        "deactivate_worker",
    ]
    assert {actor for _, actor in _controls(evaluation.job_key)} == {"ops"}
    assert Evaluation.objects.get(id=evaluation.id).priority
    assert DerivationBuild.objects.get(id=failed.id).status == BuildStatus.QUEUED


def test_a_submitter_may_restart_its_own_projects_evaluation_but_not_prioritize_or_rebuild() -> None:
    evaluation = _finished()
    member = User.objects.create_user("member", password="pw-member-1")
    evaluation.project.members.add(member)
    c = api(member)
    assert c.post(f"/api/v1/evaluations/{evaluation.id}/prioritize").status_code == 403
    assert c.post(f"/api/v1/builds/{DerivationBuildFactory().id}/rebuild").status_code == 403
    assert c.post(f"/api/v1/evaluations/{evaluation.id}/restart").status_code == 202
    stranger = User.objects.create_user("stranger", password="pw-stranger-1")
    assert api(stranger).post(f"/api/v1/evaluations/{evaluation.id}/restart").status_code == 404


def test_the_actions_are_in_the_openapi_schema(staff: User) -> None:
    paths = api(staff).get("/api/schema/", HTTP_ACCEPT="application/json").json()["paths"]
    for route in (
        "/api/v1/evaluations/{evaluation_id}/restart",
        "/api/v1/evaluations/{evaluation_id}/prioritize",
        "/api/v1/builds/{build_id}/rebuild",
        "/api/v1/builds/{build_id}/prioritize",
        "/api/v1/workers/{worker_id}/drain",
    ):
        assert "202" in paths[route]["post"]["responses"], route


# --- Restart and its failed builds (issue 24, item 5) ----------------------------------------------------


def test_restart_says_which_failed_builds_it_would_fail_on_and_offers_to_rebuild_them(
    console: Client,
) -> None:
    evaluation = _finished(EvaluationStatus.FAILED)
    failed, dependent = _failed_build_of(evaluation)
    url = reverse("admin:scheduling_evaluation_operate", args=[evaluation.id, "restart_evaluations"])
    asked = console.get(url).content.decode()
    assert "still failed" in asked and failed.name in asked
    assert 'name="option"' in asked and "Also rebuild its failed builds" in asked

    done = console.post(url, {"confirmed": "yes", "option": "yes"}, follow=True).content.decode()
    assert "rebuilt first" in done
    failed.refresh_from_db(), dependent.refresh_from_db()
    assert (failed.status, failed.attempts) == (BuildStatus.QUEUED, 0)
    assert dependent.status == BuildStatus.CREATED
    # one action, two intents on the record: the rebuild, then the restart
    assert _controls(evaluation.job_key) == [("rebuild", "admin:root"), ("resubmit", "admin:root")]
    job = record_job(job_key=evaluation.job_key, now=timezone.now())
    assert job.successor is not None


def test_restart_rebuilds_the_failed_builds_unless_unticked_and_lands_on_the_new_evaluation(
    console: Client,
) -> None:
    evaluation = _finished(EvaluationStatus.FAILED)
    failed, _ = _failed_build_of(evaluation)
    url = reverse("admin:scheduling_evaluation_operate", args=[evaluation.id, "restart_evaluations"])
    asked = console.get(url).content.decode()
    assert 'id="operation-option" checked' in asked, "the rebuild is ticked unless the operator unticks it"
    assert "untick" in asked

    # What the ticked box sends, as a browser submits the form.
    done = console.post(url, {"confirmed": "yes", "option": "yes"})

    job = record_job(job_key=evaluation.job_key, now=timezone.now())
    assert job.successor is not None
    successor_id = job.successor.split(":", 1)[1]
    new_page = reverse("admin:scheduling_evaluation_change", args=[successor_id])
    assert (done.status_code, done["Location"]) == (302, new_page), "the result page is the new evaluation"
    assert DerivationBuild.objects.get(id=failed.id).status == BuildStatus.QUEUED


def test_restart_without_rebuilding_says_the_new_evaluation_will_fail_again(console: Client) -> None:
    evaluation = _finished(EvaluationStatus.FAILED)
    failed, _ = _failed_build_of(evaluation)
    url = reverse("admin:scheduling_evaluation_operate", args=[evaluation.id, "restart_evaluations"])
    done = console.post(url, {"confirmed": "yes"}, follow=True).content.decode()
    assert "still FailedPermanent" in done and "fails on them again" in done
    assert DerivationBuild.objects.get(id=failed.id).status == BuildStatus.FAILED_PERMANENT
    assert _controls(evaluation.job_key) == [("resubmit", "admin:root")]


def test_a_restart_with_nothing_failed_offers_no_rebuild(console: Client) -> None:
    evaluation = _finished(EvaluationStatus.COMPLETED)
    url = reverse("admin:scheduling_evaluation_operate", args=[evaluation.id, "restart_evaluations"])
    asked = console.get(url).content.decode()
    assert 'name="option"' not in asked and "still failed" not in asked


def test_restart_in_rest_rebuilds_the_failed_builds_first_when_asked(staff: User) -> None:
    evaluation = _finished(EvaluationStatus.FAILED)
    failed, _ = _failed_build_of(evaluation)
    response = api(staff).post(
        f"/api/v1/evaluations/{evaluation.id}/restart", {"rebuild_failed": True}, format="json"
    )
    assert response.status_code == 202, response.content
    assert "rebuilt first" in response.json()["message"]
    assert DerivationBuild.objects.get(id=failed.id).status == BuildStatus.QUEUED
    assert _controls(evaluation.job_key) == [("rebuild", "ops"), ("resubmit", "ops")]


def test_a_submitter_may_restart_but_not_rebuild_with_it() -> None:
    project = ProjectFactory()
    member = User.objects.create_user("ci", password="pw-ci-12345")
    project.members.add(member)
    evaluation = _finished(EvaluationStatus.FAILED)
    Evaluation.objects.filter(id=evaluation.id).update(project=project)
    _failed_build_of(evaluation)
    response = api(member).post(
        f"/api/v1/evaluations/{evaluation.id}/restart", {"rebuild_failed": True}, format="json"
    )
    assert response.status_code == 403
    assert _controls(evaluation.job_key) == []


def test_a_rebuilt_builds_tries_are_numbered_across_the_rebuild(console: Client) -> None:
    """Issue 24, item 5: a rebuilt build's two tries both read "attempt 1"."""
    build = DerivationBuildFactory(status=BuildStatus.FAILED_PERMANENT)
    worker = WorkerFactory(name="builder-7")
    start = timezone.now() - timezone.timedelta(minutes=10)
    for minutes in (0, 5):  # the first try, then the try after a rebuild (attempts start at 1 again)
        BuildAttempt.objects.create(
            build=build,
            worker=worker,
            number=1,
            outcome="Failed",
            started_at=start + timezone.timedelta(minutes=minutes),
            finished_at=start + timezone.timedelta(minutes=minutes + 1),
        )
    page = console.get(reverse("admin:scheduling_derivationbuild_change", args=[build.id])).content.decode()
    assert "1 (after a rebuild)" in page
    assert (
        "attempt 1 on builder-7 (Failed)" in page and str(build.id) not in page.split("attempts")[-1][:2000]
    )
