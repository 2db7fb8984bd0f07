"""The console in a real browser (Playwright on Debian's Chromium, headless) against a live server: an
operator signs in, finds a waiting cluster on the overview, reads why it waits, aborts it and sees it
Aborted with the intent on its timeline; the overview updates when a worker connects. Screenshots go
to artifacts/screenshots/ (GRADIENT_SCREENSHOTS overrides). Skipped without Chromium or Playwright."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from gradient.clusters.models import ClusterJob, ClusterStatus
from gradient.clusters.services.dispatch import cluster_dispatch_pass
from gradient.workers.models import WorkerSession
from tests.clusters_helpers import make_cluster, queued_build
from tests.factories import ProjectFactory, WorkerFactory

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)"),
]
SHOTS = Path(
    os.environ.get("GRADIENT_SCREENSHOTS", Path(__file__).parent.parent / "artifacts" / "screenshots")
)
PATIENCE_MS = 20_000  # how long to wait for a page to show something before failing


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    # Playwright's sync API keeps an event loop running in this thread; the ORM calls of the test are
    # still plain synchronous code (Django's documented escape hatch for exactly this case).
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(PATIENCE_MS)
        sync_api.expect.set_options(timeout=PATIENCE_MS)
        yield context.new_page()
        browser.close()


def sign_in(page: Any, base: str, next_path: str) -> None:
    User.objects.create_user("op", password="pw-op-12345", is_staff=True, is_superuser=True)
    page.goto(f"{base}/admin/login/?next={next_path}")
    page.fill("#id_username", "op")
    page.fill("#id_password", "pw-op-12345")
    page.click("input[type=submit]")


def test_an_operator_finds_a_waiting_cluster_reads_why_and_aborts_it(page: Any, live_server: Any) -> None:
    expect = sync_api.expect
    cluster = make_cluster([("server", queued_build(ProjectFactory()))])
    cluster_dispatch_pass(now=timezone.now())  # no worker: the pass records why it waits
    reason = ClusterJob.objects.get(id=cluster.id).waiting_reason
    assert reason, "the dispatch pass left the cluster without a waiting reason"

    sign_in(page, live_server.url, "/admin/overview/")
    waiting = page.locator("#ov-clusters-waiting")
    expect(waiting).to_contain_text(cluster.name)  # by name, not its id
    expect(waiting).to_contain_text(str(reason["code"]))
    page.screenshot(path=str(SHOTS / "overview.png"), full_page=True)

    page.locator("#ov-clusters-waiting a", has_text=cluster.name).first.click()
    expect(page.locator(".field-waiting_in_words")).to_contain_text("No seat for every member")
    page.screenshot(path=str(SHOTS / "cluster-waiting.png"), full_page=True)

    page.goto(f"{live_server.url}/admin/clusters/clusterjob/")
    page.check(f"input[name=_selected_action][value='{cluster.id}']")
    page.select_option("select[name=action]", "abort_clusters")
    page.click("button[name=index]")
    expect(page.locator("body")).to_contain_text("Abort these cluster jobs?")
    page.screenshot(path=str(SHOTS / "abort-confirmation.png"), full_page=True)
    page.click("input[value='Yes, abort them']")

    page.goto(f"{live_server.url}/admin/clusters/clusterjob/{cluster.id}/change/")
    expect(page.locator(".field-status")).to_contain_text("Aborted")
    timeline = page.locator(".field-record_timeline")
    expect(timeline).to_contain_text("cancel requested")
    expect(timeline).to_contain_text("admin:op")
    page.screenshot(path=str(SHOTS / "cluster-aborted.png"), full_page=True)
    assert ClusterJob.objects.get(id=cluster.id).status == ClusterStatus.ABORTED


def test_the_overview_updates_when_a_worker_connects(page: Any, live_server: Any) -> None:
    expect = sync_api.expect
    sign_in(page, live_server.url, "/admin/overview/")
    workers = page.locator("#ov-workers")
    expect(workers).to_contain_text("no worker is connected")
    now = timezone.now()
    WorkerSession.objects.create(
        worker=WorkerFactory(name="builder-7", zone="eu-1"),
        channel_name="c",
        server_boot="00000000-0000-0000-0000-000000000001",
        opened_at=now,
        last_seen=now,
    )
    expect(workers).to_contain_text("builder-7")  # without a reload: the page polls
    expect(page.locator("#ov-workers-count")).to_have_text("1")
    page.screenshot(path=str(SHOTS / "overview-worker-connected.png"), full_page=True)
