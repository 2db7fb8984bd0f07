"""Build logs in the console, in a real browser (Playwright on Debian's Chromium, headless) against a live
server: an operator opens a running build and watches its log grow without reloading the page until it
is complete; a failed build shows its error beside the last lines of its log, and so does its failed
evaluation. Screenshots go to artifacts/screenshots/. Skipped without Chromium or Playwright."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.utils import timezone

from gradient.scheduling.models import DerivationBuild, Evaluation, EvaluationStatus
from gradient.scheduling.services import graph
from gradient.scheduling.services.assignment import Assignment
from gradient.scheduling.services.logs import build_log_append
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, build_id_of, drv, report, update, wire
from tests.test_console_browser import CHROMIUM, SHOTS, page, sign_in  # noqa: F401 (the page fixture)

sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)"),
]


class Sender:
    """A worker's side of one build: its pieces, in order."""

    def __init__(self, worker_id: uuid.UUID, a: Assignment) -> None:
        self.worker_id, self.a, self.offset = worker_id, a, 0

    def send(self, text: str) -> None:
        message = {
            "type": "BuildLog",
            "job_id": self.a.job_key,
            "assignment_id": str(self.a.assignment_id),
            "build_id": build_id_of(self.a),
            "offset": self.offset,
            "data": text,
        }
        assert build_log_append(worker_id=self.worker_id, message=wire(message), now=timezone.now()).accepted
        self.offset += len(text)


def _running_build(name: str) -> tuple[Evaluation, Sender]:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv(name)], now=timezone.now())
    worker = connected_worker([project])
    a = ask(worker.id)
    assert a is not None
    update(worker.id, a, kind="building", build_id=build_id_of(a))
    return evaluation, Sender(worker.id, a)


def test_the_console_follows_a_running_builds_log_live(page: Any, live_server: Any) -> None:  # noqa: F811
    expect = sync_api.expect
    _, sender = _running_build("follow-me")
    sender.send("unpacking sources\n")
    build_id = build_id_of(sender.a)

    sign_in(page, live_server.url, f"/admin/scheduling/derivationbuild/{build_id}/change/")
    log = page.locator("#build-log-text")
    expect(log).to_contain_text("unpacking sources")
    expect(page.locator("#build-log-status")).to_contain_text("live")

    sender.send("compiling ünïcode.c 😀\n")
    sender.send("linking follow-me\n")
    expect(log).to_contain_text("linking follow-me")  # without a reload: the page follows the log
    page.screenshot(path=str(SHOTS / "build-log-live.png"), full_page=True)
    sender.send("installing follow-me\n")
    expect(log).to_have_text(
        "unpacking sources\ncompiling ünïcode.c 😀\nlinking follow-me\ninstalling follow-me\n"
    )

    build = DerivationBuild.objects.get(id=build_id)
    outputs = [{"name": o["name"], "path": o["path"], "nar_size": 1} for o in build.outputs]
    update(
        sender.worker_id, sender.a, kind="build_output", build_id=build_id, outputs=outputs, substituted=False
    )
    report(sender.worker_id, sender.a, "JobCompleted", elapsed_ms=5)
    expect(page.locator("#build-log-status")).to_contain_text("complete")
    expect(log).to_have_text(
        "unpacking sources\ncompiling ünïcode.c 😀\nlinking follow-me\ninstalling follow-me\n"
    )
    href = page.locator("#build-log-whole").get_attribute("href")
    assert href == f"/api/v1/builds/{build_id}/log"


def test_the_followed_log_drops_terminal_escapes_even_one_cut_between_two_pieces(
    page: Any,  # noqa: F811
    live_server: Any,
) -> None:
    """Issue 34, item 4: the console's panes showed `␛[1;31merror:␛[0m`; colour is the log page's, the
    panes show the text a terminal would leave to read."""
    expect = sync_api.expect
    _, sender = _running_build("colourful")
    sender.send("\x1b[1;34mconfiguring\x1b[0m\n")
    build_id = build_id_of(sender.a)
    sign_in(page, live_server.url, f"/admin/scheduling/derivationbuild/{build_id}/change/")
    log = page.locator("#build-log-text")
    expect(log).to_have_text("configuring\n")  # as the server renders it

    sender.send("compiling\n\x1b[1;3")  # the poll gets half an escape ...
    expect(log).to_have_text("configuring\ncompiling\n")
    sender.send("1merror:\x1b[0m it failed\n10%\r100%\n")  # ... and the rest with the next one
    expect(log).to_have_text("configuring\ncompiling\nerror: it failed\n100%\n")
    assert "\x1b" not in log.inner_text()


def test_a_failed_build_and_its_evaluation_show_the_last_lines_beside_the_error(
    page: Any,  # noqa: F811
    live_server: Any,
) -> None:
    expect = sync_api.expect
    evaluation, sender = _running_build("broken")
    for i in range(60):
        sender.send(f"test {i:02d} ok\n")
    sender.send("test 60 FAILED: expected 42, got 41\n")
    report(sender.worker_id, sender.a, "JobFailed", error="builder exited with code 1", kind="permanent")
    build_id = build_id_of(sender.a)
    assert Evaluation.objects.get(id=evaluation.id).status == EvaluationStatus.FAILED

    sign_in(page, live_server.url, f"/admin/scheduling/derivationbuild/{build_id}/change/")
    expect(page.locator("#build-log-error")).to_contain_text("builder exited with code 1")
    tail = page.locator("#build-log-failure-tail")
    expect(tail).to_contain_text("test 60 FAILED: expected 42, got 41")
    expect(tail).to_contain_text("test 36 ok")
    expect(tail).not_to_contain_text("test 35 ok")  # the last 25 lines, beside the error
    page.screenshot(path=str(SHOTS / "build-log-failed.png"), full_page=True)

    page.goto(f"{live_server.url}/admin/scheduling/evaluation/{evaluation.id}/change/")
    failed = page.locator("#failed-build-logs")
    expect(failed.locator(".failed-build-error")).to_contain_text("builder exited with code 1")
    expect(failed.locator(".failed-build-tail")).to_contain_text("test 60 FAILED: expected 42, got 41")
    page.screenshot(path=str(SHOTS / "evaluation-failed-build-log.png"), full_page=True)
    page.click("#failed-build-logs a:has-text('broken')")
    expect(page.locator("#build-log-failure-tail")).to_contain_text("test 60 FAILED")
