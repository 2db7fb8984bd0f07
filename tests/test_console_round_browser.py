"""The operator's round in a real browser (issue 34, item 9: Chromium through Playwright, as the console's
browser tests run, not Django's test client as in tests/test_console_round.py), with the scheduler's
own services doing the work a worker would: the overview names a failed build, the operator follows it
to its page and its log, goes to its evaluation, restarts it (the failed build rebuilt by default),
lands on the new evaluation, which completes while the page is open; its History is its timeline,
whose names are links. Every page on the way names its jobs and shows one time style: no UUID as
visible text but in an id field, no raw ISO time, no raw JSON list. Screenshots go to
artifacts/screenshots/ (GRADIENT_SCREENSHOTS overrides); docs/img has copies. Skipped without
Chromium or Playwright."""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest
from django.utils import timezone

from gradient.core.vocab import BuildStatus, EvaluationStatus
from gradient.records.selectors import record_job
from gradient.scheduling.models import DerivationBuild, Evaluation
from gradient.scheduling.services.assignment import Assignment
from gradient.scheduling.services.evaluations import evaluation_create
from gradient.scheduling.services.logs import build_log_append
from tests.factories import ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, build, build_id_of, drv, evaluate, report, update, wire
from tests.test_console_browser import CHROMIUM, SHOTS, page, sign_in, sync_api

__all__ = ["page"]  # the browser fixture of the console's tests

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)"),
]

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")
GRAPH = [drv("libfoo"), drv("hello", "libfoo", attr="packages.x86_64-linux.hello")]
LOG = "configuring libfoo\n\x1b[1;31merror:\x1b[0m make: *** [all] Error 2\n"

# What a person reads of a page: its rendered text, an id field left out (the one place for a UUID).
_READ = """() => {
  const ids = [...document.querySelectorAll('.field-id')];
  ids.forEach(e => { e.dataset.was = e.style.display; e.style.display = 'none'; });
  const text = document.body.innerText;
  ids.forEach(e => { e.style.display = e.dataset.was; });
  return text;
}"""


def looks_right(page: Any) -> str:
    text: str = page.evaluate(_READ)
    assert not UUID.search(text), f"a UUID on {page.url}: {UUID.search(text)}"
    assert not ISO.search(text), f"a raw ISO time on {page.url}: {ISO.search(text)}"
    assert '["' not in text and "[{" not in text, f"raw JSON on {page.url}"
    return text


def _send_log(worker_id: uuid.UUID, a: Assignment, text: str) -> None:
    message = {
        "type": "BuildLog",
        "job_id": a.job_key,
        "assignment_id": str(a.assignment_id),
        "build_id": build_id_of(a),
        "offset": 0,
        "data": text,
    }
    assert build_log_append(worker_id=worker_id, message=wire(message), now=timezone.now()).accepted


def test_the_operators_round_from_a_failure_on_the_overview_to_the_restarted_evaluation_completing(
    page: Any, live_server: Any
) -> None:
    expect = sync_api.expect
    project = ProjectFactory(name="nixpkgs-ci")
    worker = connected_worker([project], name="builder-1", architectures=["x86_64-linux"])
    first, _ = evaluation_create(project=project, repository="sim:round", commit="c0ffee", now=timezone.now())
    evaluate(worker.id, ask(worker.id, "flake"), GRAPH)
    failing = ask(worker.id)
    assert failing is not None
    update(worker.id, failing, kind="building", build_id=build_id_of(failing))
    _send_log(worker.id, failing, LOG)
    report(worker.id, failing, "JobFailed", error="make: *** [all] Error 2", kind="permanent")
    assert Evaluation.objects.get(id=first.id).status == EvaluationStatus.FAILED
    libfoo = DerivationBuild.objects.get(drv_path=GRAPH[0]["drv_path"])

    # The overview: the failure, by name.
    sign_in(page, live_server.url, "/admin/overview/")
    expect(page.locator("#ov-failures")).to_contain_text("libfoo")
    looks_right(page)
    page.screenshot(path=str(SHOTS / "round-overview.png"), full_page=True)

    # Its build: the error beside the last lines of its log, the try on its worker.
    page.click("#ov-failures a:has-text('libfoo')")
    expect(page.locator("h1")).to_contain_text("View shared build")
    expect(page.locator("#build-log-error")).to_contain_text("make: *** [all] Error 2")
    expect(page.locator("#build-log-failure-tail")).to_contain_text("configuring libfoo")
    # the panes show the text without its terminal escapes (colour is the log page's)
    expect(page.locator("#build-log-failure-tail")).to_contain_text("error: make: *** [all] Error 2")
    expect(page.locator("#build-log-text")).to_contain_text("error: make: *** [all] Error 2")
    assert "attempt 1 on builder-1" in looks_right(page)
    page.screenshot(path=str(SHOTS / "round-failed-build.png"), full_page=True)

    # Its log with line numbers, the colour rendered, no escape code shown.
    page.click("#build-log-page")
    line = page.locator("#L2")
    expect(line).to_contain_text("error: make: *** [all] Error 2")
    expect(line.locator("span.ansi-bold")).to_have_text("error:")
    assert "\x1b" not in looks_right(page)
    page.go_back()

    # Its evaluation, from the build's list of the evaluations that share it.
    page.click("a:has-text('sim:round@c0ffee')")
    expect(page.locator(".field-status")).to_contain_text("Failed")
    expect(page.locator(".field-failed_builds")).to_contain_text("libfoo")
    expect(page.locator(".failed-build-tail")).to_contain_text("error: make: *** [all] Error 2")
    assert "\x1b" not in looks_right(page)

    # Restart: rebuilding the failed build is ticked; the result page is the new evaluation.
    page.click("a.operation:has-text('Restart')")
    expect(page.locator("#operation-option")).to_be_checked()
    looks_right(page)
    page.click("input[value='Yes, restart it']")
    expect(page.locator(".messagelist")).to_contain_text("restarted as sim:round@c0ffee")
    successor = Evaluation.objects.exclude(id=first.id).get()
    expect(page).to_have_url(f"{live_server.url}/admin/scheduling/evaluation/{successor.id}/change/")
    assert DerivationBuild.objects.get(id=libfoo.id).status == BuildStatus.QUEUED
    assert [c.actor for c in record_job(job_key=first.job_key, now=timezone.now()).controls] == [
        "admin:op",
        "admin:op",
    ]
    looks_right(page)

    # The worker evaluates and builds it; the operator reloads the page it landed on.
    evaluate(worker.id, ask(worker.id, "flake"), GRAPH)
    for _ in GRAPH:
        assignment = ask(worker.id)
        assert assignment is not None
        build(worker.id, assignment)
    assert Evaluation.objects.get(id=successor.id).status == EvaluationStatus.COMPLETED
    page.reload()
    expect(page.locator(".field-status")).to_contain_text("Completed")
    # nothing failed: no "failed builds" rows saying so twice
    expect(page.locator(".field-failed_builds, .field-failed_build_logs")).to_have_count(0)
    text = looks_right(page)
    assert "restarts sim:round@c0ffee" in text
    page.screenshot(path=str(SHOTS / "round-restarted-completed.png"), full_page=True)

    # History is the record's timeline, and the names on it are links: the worker's leads to its page.
    page.click("a.historylink")
    expect(page).to_have_url(re.compile(r"#record-timeline$"))
    timeline = page.locator(".field-record_timeline")
    expect(timeline).to_contain_text("builder-1")
    timeline.locator("a", has_text="builder-1").first.click()
    expect(page.locator("h1")).to_contain_text("worker")
    expect(page.locator(".field-connection")).to_contain_text("connected")
    looks_right(page)

    # The rebuilt build's page shows how long it waited and how long it built, apart.
    page.goto(f"{live_server.url}/admin/scheduling/derivationbuild/{libfoo.id}/change/")
    expect(page.locator(".field-status")).to_contain_text("Completed")
    expect(page.locator(".field-waited")).to_be_visible()
    expect(page.locator(".field-built")).to_be_visible()
    looks_right(page)
