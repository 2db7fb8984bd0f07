"""A project member's day in a real browser (Playwright on Debian's Chromium, headless, as the
console's browser tests run): `ci`, a submitter the console refuses, signs in at /my/, finds its
waiting evaluation with why it waits in words, opens its failed one, the failed build and its log.
Screenshots go to artifacts/screenshots/ (GRADIENT_SCREENSHOTS overrides); docs/img has copies."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from gradient.core.vocab import BuildStatus, EvaluationStatus
from gradient.scheduling.models import BuildLog, BuildLogChunk, DerivationBuild
from gradient.scheduling.services import graph
from tests.factories import DispatchedJobFactory, EvaluationFactory, ProjectFactory
from tests.scheduling_helpers import drv
from tests.test_console_browser import CHROMIUM, SHOTS, page, sync_api

__all__ = ["page"]  # the browser fixture of the console's tests

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)"),
]


def test_a_member_reads_its_evaluations_a_failed_build_and_its_log(page: Any, live_server: Any) -> None:
    expect = sync_api.expect
    mine = ProjectFactory(name="rest-proj")
    ci = User.objects.create_user("ci", password="pw-ci-12345")
    mine.members.add(ci)
    EvaluationFactory(
        project=mine,
        repository="sim:diamond",
        commit="c0ffee00",
        status=EvaluationStatus.WAITING,
        waiting_reason={
            "reason": "eval_workers",
            "capability": "fetch",
            "connected_workers": 3,
            "project": "rest-proj",
            "capable_workers": 3,
            "serving_projects": ["demo"],
        },
    )
    failed = EvaluationFactory(project=mine, repository="sim:chain", commit="beef0001", status="Building")
    graph.ingest_eval_result(evaluation=failed, derivations=[drv("hello")], now=timezone.now())
    build = DerivationBuild.objects.get()
    DerivationBuild.objects.filter(id=build.id).update(
        status=BuildStatus.FAILED_PERMANENT, last_error="builder failed with exit code 2"
    )
    failed.status = EvaluationStatus.FAILED
    failed.save(update_fields=["status"])
    log = BuildLog.objects.create(build=build, assignment=DispatchedJobFactory(derivation_build=build))
    BuildLogChunk.objects.create(
        log=log, start=0, data="configuring\n\x1b[31mmake: *** [all] Error 2\x1b[0m\n"
    )

    page.goto(f"{live_server.url}/admin/login/")  # the console is for staff ...
    page.fill("#id_username", "ci")
    page.fill("#id_password", "pw-ci-12345")
    page.click("input[type=submit]")
    expect(page.locator("#member-hint")).to_contain_text("/my/")  # ... and it points members there

    page.click("#member-hint a")
    page.fill("#id_username", "ci")
    page.fill("#id_password", "pw-ci-12345")
    page.click("input[type=submit]")
    table = page.locator("#evaluations")
    expect(table).to_contain_text("sim:diamond@c0ffee00")
    expect(table).to_contain_text("no connected worker serves project rest-proj; 3 connected serve: demo")
    page.screenshot(path=str(SHOTS / "member-evaluations.png"), full_page=True)

    page.click("text=sim:chain@beef0001")
    expect(page.locator("#failed-builds")).to_contain_text("builder failed with exit code 2")
    page.screenshot(path=str(SHOTS / "member-evaluation.png"), full_page=True)

    page.locator("#failed-builds a", has_text=build.name).click()
    expect(page.locator("#log")).to_contain_text("make: *** [all] Error 2")
    assert "\x1b" not in page.locator("#log").inner_text()  # the end of the log, without its escapes
    page.screenshot(path=str(SHOTS / "member-build.png"), full_page=True)
    page.click("#whole-log")  # the REST route, with the member's session
    expect(page.locator("body")).to_contain_text("configuring")


def test_the_log_page_numbers_lines_with_anchors_renders_ansi_as_text_searches_and_downloads(
    page: Any, live_server: Any
) -> None:
    expect = sync_api.expect
    mine = ProjectFactory(name="rest-proj")
    ci = User.objects.create_user("ci", password="pw-ci-12345")
    mine.members.add(ci)
    evaluation = EvaluationFactory(project=mine, status="Building")
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("hello")], now=timezone.now())
    build = DerivationBuild.objects.get()
    log = BuildLog.objects.create(build=build, assignment=DispatchedJobFactory(derivation_build=build))
    text = "".join(f"step {n}\n" for n in range(1, 200))
    text += "\x1b[1;31merror:\x1b[0m <script>window.pwned = 1</script> failed\n"
    text += "".join(f"after {n} error-free\n" for n in range(1, 30))
    BuildLogChunk.objects.create(log=log, start=0, data=text)

    page.goto(f"{live_server.url}/my/login/?next=/my/builds/{build.id}/log/%23L200")
    page.fill("#id_username", "ci")
    page.fill("#id_password", "pw-ci-12345")
    page.click("input[type=submit]")

    line = page.locator("#L200")
    expect(line).to_contain_text("error: <script>window.pwned = 1</script> failed")  # shown as text
    assert page.evaluate("window.pwned") is None, "a log's text is never markup"
    expect(line.locator("span.fg-31.ansi-bold")).to_have_text("error:")  # the colour, not the escape
    assert "\x1b" not in line.inner_text()
    expect(line.locator("a.ln")).to_have_attribute("href", "#L200")
    assert page.evaluate("location.hash") == "#L200"
    assert _in_view(page, "#L200"), "the line linked to is not hidden under the search bar"

    page.fill("#log-search", "ERROR")
    page.press("#log-search", "Enter")
    found = page.locator("#log-found")
    expect(found).to_have_text("1 of 30 (line 200)")
    expect(page.locator("#L200 mark")).to_have_text("error")
    # far down a long log, the search and its Next/Previous stay in view above the line found
    assert _in_view(page, "#log-tools") and _in_view(page, "#L200")
    page.screenshot(path=str(SHOTS / "member-log.png"), full_page=False)
    page.click("#log-next")
    expect(found).to_have_text("2 of 30 (line 201)")
    page.click("#log-prev")
    page.click("#log-prev")
    expect(found).to_have_text("30 of 30 (line 229)")
    expect(page.locator(".line.current")).to_have_id("L229")

    with page.expect_download() as download:
        page.click("#log-download")
    assert download.value.suggested_filename == f"{build.name}.log"
    assert open(download.value.path(), encoding="utf-8").read() == text


_IN_VIEW = """sel => {
  const box = document.querySelector(sel).getBoundingClientRect();
  const tools = document.getElementById('log-tools').getBoundingClientRect();
  const below = sel === '#log-tools' ? 0 : tools.bottom;
  return box.top >= below - 1 && box.bottom <= window.innerHeight;
}"""


def _in_view(page: Any, selector: str) -> bool:
    """Whether the element is on screen, below the search bar unless it is the bar."""
    return bool(page.evaluate(_IN_VIEW, selector))


def test_a_relative_time_keeps_ticking_in_the_members_view(page: Any, live_server: Any) -> None:
    """Issue 34, item 6, as in the console: a page left open does not show a time that stopped."""
    expect = sync_api.expect
    mine = ProjectFactory(name="rest-proj")
    ci = User.objects.create_user("ci", password="pw-ci-12345")
    mine.members.add(ci)
    EvaluationFactory(project=mine, repository="sim:tick", commit="c0ffee00")
    page.goto(f"{live_server.url}/my/login/?next=/my/")
    page.fill("#id_username", "ci")
    page.fill("#id_password", "pw-ci-12345")
    page.click("input[type=submit]")
    created = page.locator("#evaluations time").first
    expect(created).to_contain_text("ago")
    first = created.inner_text()
    expect(created).not_to_have_text(first)  # without a reload
    expect(created).to_contain_text("ago")
