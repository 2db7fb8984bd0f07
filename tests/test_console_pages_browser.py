"""The pages an operator reads, in a real browser (Playwright on Debian's Chromium, headless) against a
live server: the overview, an evaluation with a failed build (and its restart), a build, a worker (and
its drain) and a cluster (abort on its own page). Nothing is edited by hand: there is no status field to
edit, and the add page is refused. Screenshots go to artifacts/screenshots/ (GRADIENT_SCREENSHOTS
overrides); docs/operators.md shows them. Skipped without Chromium or Playwright."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from gradient.clusters.models import ClusterJob, ClusterStatus
from gradient.core.vocab import BuildStatus, EvaluationStatus
from gradient.records.selectors import record_job
from gradient.scheduling import history
from gradient.scheduling.models import BuildAttempt, DerivationBuild, Evaluation, EvaluationBuild
from gradient.scheduling.services.evaluations import evaluation_create
from tests.clusters_helpers import make_cluster, queued_build
from tests.factories import (
    DerivationBuildFactory,
    DispatchedJobFactory,
    EvaluationFactory,
    ProjectFactory,
    WorkerFactory,
    WorkerSessionFactory,
)
from tests.test_console_browser import CHROMIUM, SHOTS, page, sign_in, sync_api

__all__ = ["page"]  # the browser fixture of the console's tests

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)"),
]


def _shot(page: Any, name: str) -> None:
    page.screenshot(path=str(SHOTS / name), full_page=True)


def _evaluation_with_a_failed_build() -> tuple[Evaluation, DerivationBuild, DerivationBuild]:
    now = timezone.now()
    evaluation, _ = evaluation_create(
        project=ProjectFactory(name="nixpkgs-ci"), repository="sim:diamond", commit="4f2a9c1e" * 5, now=now
    )
    history.evaluation_transition(
        evaluation_id=evaluation.id, to=EvaluationStatus.BUILDING, expect=None, reason="evaluated", now=now
    )
    worker = WorkerFactory(name="builder-1")
    done = DerivationBuildFactory(
        drv_path="/nix/store/" + "a" * 32 + "-openssl-3.0.13.drv",
        status=BuildStatus.COMPLETED,
        finished_at=now,
    )
    failed = DerivationBuildFactory(
        drv_path="/nix/store/" + "b" * 32 + "-hello-2.12.1.drv",
        status=BuildStatus.FAILED_PERMANENT,
        attempts=1,
        last_error="builder for '/nix/store/...-hello-2.12.1.drv' failed with exit code 2;\n"
        "last 2 log lines:\n> make: *** [Makefile:42: all] Error 2\n> error: build failed",
        finished_at=now,
    )
    dependent = DerivationBuildFactory(
        drv_path="/nix/store/" + "c" * 32 + "-hello-tests.drv", status=BuildStatus.DEPENDENCY_FAILED
    )
    failed.dependency_edges.create(dependency=done)
    dependent.dependency_edges.create(dependency=failed)
    for build in (done, failed, dependent):
        EvaluationBuild.objects.create(evaluation=evaluation, build=build)
    BuildAttempt.objects.create(
        build=failed,
        worker=worker,
        number=1,
        outcome="Failed",
        failure_kind="permanent",
        error="exit code 2",
        started_at=now - timezone.timedelta(seconds=95),
        finished_at=now,
    )
    history.evaluation_transition(
        evaluation_id=evaluation.id,
        to=EvaluationStatus.FAILED,
        expect=None,
        reason="1 builds failed",
        now=now,
        errors=[f"{failed.drv_path}: FailedPermanent"],
    )
    return Evaluation.objects.get(id=evaluation.id), failed, dependent


def test_the_overview_shows_what_runs_now_recent_failures_and_pass_health(
    page: Any, live_server: Any
) -> None:
    expect = sync_api.expect
    _evaluation_with_a_failed_build()
    worker = WorkerFactory(name="builder-2", architectures=["x86_64-linux", "aarch64-linux"])
    WorkerSessionFactory(worker=worker)
    running = DerivationBuildFactory(drv_path="/nix/store/" + "d" * 32 + "-linux-6.6.drv", status="Building")
    DispatchedJobFactory(
        worker=worker, derivation_build=running, dispatched_at=timezone.now() - timezone.timedelta(minutes=3)
    )
    sign_in(page, live_server.url, "/admin/overview/")
    expect(page.locator("#ov-running")).to_contain_text("linux-6.6")
    expect(page.locator("#ov-running")).to_contain_text("builder-2")
    expect(page.locator("#ov-running")).to_contain_text("3 min")
    expect(page.locator("#ov-failures")).to_contain_text("hello-2.12.1")
    expect(page.locator("#ov-chart-handed rect")).to_have_count(12)
    _shot(page, "console-overview.png")
    page.click("#ov-failures a:has-text('hello-2.12.1')")
    expect(page.locator("h1")).to_contain_text("View shared build")


def test_an_evaluation_with_a_failed_build_reads_as_a_view_and_restarts_from_its_page(
    page: Any, live_server: Any
) -> None:
    expect = sync_api.expect
    evaluation, failed, _ = _evaluation_with_a_failed_build()
    sign_in(page, live_server.url, f"/admin/scheduling/evaluation/{evaluation.id}/change/")
    expect(page.locator(".field-progress")).to_contain_text("1/3 built, 1 failed, 1 failed with a dependency")
    expect(page.locator(".field-failed_builds")).to_contain_text("hello-2.12.1")
    expect(page.locator(".field-failed_builds")).to_contain_text("Error 2")
    expect(page.locator(".field-project")).to_contain_text("nixpkgs-ci")
    # the status-edit path is gone: no status field, no save button, the add page is refused
    assert page.locator("select[name=status]").count() == 0 and page.locator("input[name=_save]").count() == 0
    _shot(page, "console-evaluation.png")
    page.click("a.operation:has-text('Restart')")
    expect(page.locator("#confirm-operation")).to_contain_text("supersedes the finished one")
    _shot(page, "console-restart-confirmation.png")
    # Issue 34: the failed builds are rebuilt unless the operator unticks it, and the result page is
    # the new evaluation.
    expect(page.locator("#operation-option")).to_be_checked()
    page.click("input[value='Yes, restart it']")
    expect(page.locator(".messagelist")).to_contain_text("restarted as sim:diamond@")
    job = record_job(job_key=evaluation.job_key, now=timezone.now())
    assert job.successor
    assert [(c.intent, c.actor) for c in job.controls] == [("rebuild", "admin:op"), ("resubmit", "admin:op")]
    successor = job.successor.split(":", 1)[1]
    expect(page).to_have_url(f"{live_server.url}/admin/scheduling/evaluation/{successor}/change/")
    assert DerivationBuild.objects.get(id=failed.id).status == BuildStatus.QUEUED
    response = page.goto(f"{live_server.url}/admin/scheduling/evaluation/add/")
    assert response is not None and response.status == 403


def test_a_build_page_shows_who_shares_it_its_graph_and_its_attempts(page: Any, live_server: Any) -> None:
    expect = sync_api.expect
    _, failed, _ = _evaluation_with_a_failed_build()
    sign_in(page, live_server.url, f"/admin/scheduling/derivationbuild/{failed.id}/change/")
    body = page.locator("#content")
    expect(body).to_contain_text("evaluations that share it", ignore_case=True)
    expect(body).to_contain_text("openssl-3.0.13")  # its dependency, by name
    expect(body).to_contain_text("hello-tests")  # its dependent
    expect(body).to_contain_text("builder-1")  # the attempt's worker
    expect(body).to_contain_text("1 min 35 s")  # the attempt's duration
    _shot(page, "console-build.png")
    page.click("a.operation:has-text('Rebuild')")
    page.click("input[value='Yes, rebuild it']")
    expect(page.locator(".field-status")).to_contain_text("Queued")
    assert DerivationBuild.objects.get(id=failed.id).status == BuildStatus.QUEUED


def test_a_worker_page_reads_as_a_view_and_drains_from_its_page(page: Any, live_server: Any) -> None:
    expect = sync_api.expect
    worker = WorkerFactory(
        name="builder-3",
        zone="eu-1",
        system_features=["kvm", "big-parallel"],
        cpu_count=16,
        ram_total_mb=65536,
        cpu_usage_pct=37.25,
        ram_free_mb=30211,
        metrics_at=timezone.now(),
    )
    WorkerSessionFactory(worker=worker)
    sign_in(page, live_server.url, f"/admin/workers/worker/{worker.id}/change/")
    expect(page.locator(".field-connection")).to_contain_text("connected")
    expect(page.locator(".field-capabilities")).to_contain_text("kvm, big-parallel")
    expect(page.locator(".field-metrics")).to_contain_text("37.2 %")
    assert page.locator("input[name=cpu_usage_pct]").count() == 0
    _shot(page, "console-worker.png")
    page.click("a.operation:has-text('Drain')")
    page.click("input[value='Yes, drain it']")
    expect(page.locator(".field-connection")).to_contain_text("draining")


def test_a_cluster_is_aborted_from_its_own_page(page: Any, live_server: Any) -> None:
    expect = sync_api.expect
    cluster = make_cluster(
        [("server", queued_build(ProjectFactory())), ("client", queued_build(ProjectFactory()))]
    )
    sign_in(page, live_server.url, f"/admin/clusters/clusterjob/{cluster.id}/change/")
    page.click("a.operation:has-text('Abort')")
    expect(page.locator("#confirm-operation")).to_contain_text("Abort these cluster jobs?")
    page.click("input[value='Yes, abort it']")
    expect(page.locator(".field-status")).to_contain_text("Aborted")
    expect(page.locator(".field-record_timeline")).to_contain_text("admin:op")
    # it no longer waits: no empty "why it waits", "waiting reason", "waiting since" or "retry" rows
    for row in ("waiting_in_words", "waiting_reason", "waiting_since_when", "retry_at_when"):
        expect(page.locator(f".field-{row}")).to_have_count(0)
    _shot(page, "console-cluster.png")
    assert ClusterJob.objects.get(id=cluster.id).status == ClusterStatus.ABORTED


def _columns_past(page: Any, width: int) -> list[str]:
    """The list's column headers whose right edge is beyond `width` or beyond the list's own box (which
    scrolls sideways: a column past it is hidden until the operator scrolls)."""
    shown = page.locator("#changelist .results").bounding_box()
    right = min(width, shown["x"] + shown["width"]) if shown else width
    past = []
    for th in page.locator("#result_list thead th").all():
        box = th.bounding_box()
        if box is not None and box["x"] + box["width"] > right + 1:
            past.append(th.inner_text().strip())
    return past


def test_the_lists_key_columns_fit_a_1400_px_screen(page: Any, live_server: Any) -> None:
    """Issue 34, item 7: progress, waiting for and kind on Evaluations; outcome on Dispatched jobs
    (each column once); last seen on Workers: all visible at 1 400 px with long values in them."""
    expect = sync_api.expect
    project = ProjectFactory(name="nixpkgs-ci-with-a-long-name")
    worker = WorkerFactory(
        name="builder-with-a-rather-long-name-7", architectures=["x86_64-linux", "aarch64-linux"]
    )
    WorkerSessionFactory(worker=worker)
    reason = {
        "reason": "workers",
        "unmet": [
            {"architecture": "aarch64-linux", "required_features": ["kvm", "big-parallel"], "builds": 3}
        ],
        "connected_workers": 3,
        "available_architectures": ["x86_64-linux", "i686-linux"],
    }
    evaluation = EvaluationFactory(
        project=project,
        repository="https://git.example.org/some-group/a-repository-with-a-long-name.git",
        commit="4f2a9c1e" * 5,
        status=EvaluationStatus.WAITING,
        waiting_reason=reason,
    )
    build = DerivationBuildFactory()
    DispatchedJobFactory(
        derivation_build=build, worker=worker, finished_at=timezone.now(), outcome="Completed"
    )
    sign_in(page, live_server.url, "/admin/scheduling/evaluation/")
    expect(page.locator("#result_list")).to_contain_text("nixpkgs-ci-with-a-long-name")
    _shot(page, "console-evaluations.png")
    hidden = {"Evaluations": _columns_past(page, 1400)}
    assert "aarch64-linux" in page.locator("#result_list").inner_text()
    _ = evaluation

    page.goto(f"{live_server.url}/admin/scheduling/dispatchedjob/")
    expect(page.locator("#result_list")).to_contain_text("Completed")
    headers = [th.inner_text().strip().lower() for th in page.locator("#result_list thead th").all()]
    _shot(page, "console-dispatched.png")
    assert headers.count("job") == 1 and "outcome" in headers, headers
    hidden["Dispatched jobs"] = _columns_past(page, 1400)

    page.goto(f"{live_server.url}/admin/workers/worker/")
    expect(page.locator("#result_list")).to_contain_text("builder-with-a-rather-long-name-7")
    _shot(page, "console-workers.png")
    hidden["Workers"] = _columns_past(page, 1400)
    assert hidden == {"Evaluations": [], "Dispatched jobs": [], "Workers": []}


def test_a_relative_time_keeps_ticking_on_an_open_page(page: Any, live_server: Any) -> None:
    """Issue 34, item 6: "started 14 s ago" went on saying so while the log above it ran on."""
    expect = sync_api.expect
    worker = WorkerFactory(name="ticking", last_seen=timezone.now())
    sign_in(page, live_server.url, f"/admin/workers/worker/{worker.id}/change/")
    seen = page.locator(".field-seen time")
    first = seen.inner_text()
    expect(seen).not_to_have_text(first)  # without a reload
    expect(seen).to_contain_text("ago")
