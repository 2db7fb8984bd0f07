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
    BuildLogChunk.objects.create(log=log, start=0, data="configuring\nmake: *** [all] Error 2\n")

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
    page.screenshot(path=str(SHOTS / "member-build.png"), full_page=True)
    page.click("#whole-log")  # the REST route, with the member's session
    expect(page.locator("body")).to_contain_text("configuring")
