"""What an operator sees of work that waits and of the console's details, in a real browser (issue 34,
items 1, 7 and 9; Playwright on Debian's Chromium, headless, as the console's browser tests run).
The waiting reasons are the waiting pass's own (scheduling.services.waiting), not rows written by hand:
an evaluation of a project no connected worker serves says so and is freed when the operator gives a
worker the project on its page; work held back by ResourceSaturation says which load; a needed build
that was aborted is named. Then the details: Activate after Deactivate, the list's action behind a
confirmation, yes/no as words and not icons, and Gradient's own 403 page. Screenshots go to
artifacts/screenshots/ (GRADIENT_SCREENSHOTS overrides); docs/img has copies. Skipped without Chromium
or Playwright."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from gradient.core.vocab import BuildStatus, EvaluationStatus
from gradient.records.selectors import record_job
from gradient.recovery.models import PassState, ServerBoot
from gradient.scheduling.models import DerivationBuild, Evaluation
from gradient.scheduling.services import graph
from gradient.scheduling.services.lifecycle import end_build
from gradient.scheduling.services.waiting import refresh_waiting_state
from gradient.workers.models import Worker
from tests.clusters_helpers import make_cluster, queued_build
from tests.factories import (
    EvaluationFactory,
    ProjectFactory,
    WorkerFactory,
    WorkerSessionFactory,
    connected_worker,
)
from tests.scheduling_helpers import ask, build_id_of, drv, update
from tests.test_console_browser import CHROMIUM, SHOTS, page, sign_in, sync_api

__all__ = ["page"]  # the browser fixture of the console's tests

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)"),
]

ICONS = "img[src*='icon-yes'], img[src*='icon-no'], img[src*='icon-unknown']"


def _pass() -> None:
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)


def _building(project: Any, name: str, derivations: list[dict[str, Any]]) -> Evaluation:
    evaluation = EvaluationFactory(
        project=project, repository=f"sim:{name}", commit="c0ffee00", status=EvaluationStatus.BUILDING
    )
    graph.ingest_eval_result(evaluation=evaluation, derivations=derivations, now=timezone.now())
    return evaluation


def test_waiting_work_says_why_in_words_and_a_project_park_ends_when_a_worker_is_given_the_project(
    page: Any, live_server: Any
) -> None:
    expect = sync_api.expect
    demo, rest_proj, tools = (ProjectFactory(name=n) for n in ("demo", "rest-proj", "tools"))
    for n in (1, 2, 3):  # busy: every demo worker reports CPU > 80 %
        connected_worker(
            [demo], name=f"builder-{n}", cpu_usage_pct=95.0, cpu_count=8, metrics_at=timezone.now()
        )
    spare = connected_worker([tools], name="builder-4")
    unserved = EvaluationFactory(project=rest_proj, repository="sim:rest", commit="c0ffee00")
    held = _building(demo, "held", [drv("hello")])
    stuck = _building(tools, "stuck", [drv("base"), drv("tool", "base")])
    base = DerivationBuild.objects.get(drv_path__endswith="-base.drv")
    tool = DerivationBuild.objects.get(drv_path__endswith="-tool.drv")
    DerivationBuild.objects.filter(id=base.id).update(status=BuildStatus.COMPLETED)
    DerivationBuild.objects.filter(id=tool.id).update(status=BuildStatus.QUEUED)
    end_build(
        build_id=tool.id, status=BuildStatus.ABORTED, kind="aborted", error="aborted", now=timezone.now()
    )
    _pass()
    assert {e.status for e in Evaluation.objects.filter(id__in=[unserved.id, held.id, stuck.id])} == {
        EvaluationStatus.WAITING
    }

    sign_in(page, live_server.url, "/admin/scheduling/evaluation/")
    listed = page.locator("#result_list")
    expect(listed).to_contain_text("sim:rest@c0ffee00")
    # each one's brief in the list; the sentence is on its page
    expect(listed).to_contain_text("a less loaded worker (theirs: CPU > 80 %)")
    expect(listed).to_contain_text("a worker serving rest-proj")
    expect(listed).to_contain_text("aborted builds to be queued again: tool")
    page.screenshot(path=str(SHOTS / "console-waiting.png"), full_page=True)

    page.goto(f"{live_server.url}/admin/scheduling/evaluation/{held.id}/change/")
    expect(page.locator(".field-waiting_for")).to_contain_text(
        "Held back by ResourceSaturation: 3 workers can build it; all report CPU > 80 %."
    )
    page.goto(f"{live_server.url}/admin/scheduling/evaluation/{stuck.id}/change/")
    expect(page.locator(".field-waiting_for")).to_contain_text(
        "it needs a shared build that was aborted: tool"
    )
    page.goto(f"{live_server.url}/admin/scheduling/evaluation/{unserved.id}/change/")
    expect(page.locator(".field-waiting_for")).to_contain_text(
        "no connected worker serves project rest-proj; 4 connected serve: demo, tools"
    )
    page.screenshot(path=str(SHOTS / "console-waiting-project.png"), full_page=True)

    # The operator gives builder-4 the project on its page; the next pass frees the evaluation.
    page.goto(f"{live_server.url}/admin/workers/worker/{spare.id}/change/")
    page.locator("#id_projects_from option", has_text="rest-proj").dblclick()
    expect(page.locator("#id_projects_to")).to_contain_text("rest-proj")
    page.click("input[name=_save]")
    expect(page.locator(".messagelist")).to_contain_text("builder-4")
    assert set(Worker.objects.get(id=spare.id).projects.values_list("name", flat=True)) == {
        "tools",
        "rest-proj",
    }
    _pass()
    page.goto(f"{live_server.url}/admin/scheduling/evaluation/{unserved.id}/change/")
    expect(page.locator(".field-status")).to_contain_text("Queued")
    expect(page.locator(".field-waiting_for")).to_have_count(0)  # no empty row once it no longer waits


def test_activate_follows_deactivate_the_list_action_asks_first_and_no_is_a_word(
    page: Any, live_server: Any
) -> None:
    expect = sync_api.expect
    worker = WorkerFactory(name="builder-7")
    idle = WorkerFactory(name="builder-8", active=False, deactivated_at=timezone.now())

    sign_in(page, live_server.url, f"/admin/workers/worker/{worker.id}/change/")
    page.click("a.operation:has-text('Deactivate')")
    page.click("input[type=submit][value^='Yes']")
    expect(page.locator(".messagelist")).to_contain_text("builder-7")
    assert Worker.objects.get(id=worker.id).active is False
    page.goto(f"{live_server.url}/admin/workers/worker/{worker.id}/change/")
    expect(page.locator("a.operation:has-text('Activate')")).to_be_visible()  # after Deactivate
    assert page.locator(ICONS).count() == 0
    expect(page.locator("#content")).to_contain_text("no")

    # The list's action: a confirmation first, nothing changed before it.
    page.goto(f"{live_server.url}/admin/workers/worker/")
    assert page.locator(ICONS).count() == 0, "a yes/no is a word in the list too"
    page.locator(f"input[name=_selected_action][value='{idle.id}']").check()
    page.select_option("select[name=action]", "activate_workers")
    page.click("button[name=index], input[name=index]")
    expect(page.locator("#content")).to_contain_text("builder-8")
    page.screenshot(path=str(SHOTS / "console-activate-confirmation.png"), full_page=True)
    assert Worker.objects.get(id=idle.id).active is False
    page.click("input[type=submit][value^='Yes']")
    expect(page.locator(".messagelist")).to_contain_text("builder-8")
    assert Worker.objects.get(id=idle.id).active is True

    page.goto(f"{live_server.url}/admin/workers/worker/{worker.id}/change/")
    page.click("a.operation:has-text('Activate')")
    page.click("input[type=submit][value^='Yes']")
    assert Worker.objects.get(id=worker.id).active is True


def test_a_refused_page_is_gradients_own_and_points_a_member_to_my(page: Any, live_server: Any) -> None:
    expect = sync_api.expect
    User.objects.create_user("ci", password="pw-ci-12345", is_staff=True)  # staff without permissions
    evaluation = EvaluationFactory()
    page.goto(f"{live_server.url}/admin/login/")
    page.fill("#id_username", "ci")
    page.fill("#id_password", "pw-ci-12345")
    page.click("input[type=submit]")
    response = page.goto(f"{live_server.url}/admin/scheduling/evaluation/{evaluation.id}/delete/")
    assert response is not None and response.status == 403
    assert "Django" not in page.title()
    expect(page.locator("a[href='/my/']").first).to_be_visible()
    assert "Django administration" not in page.locator("body").inner_text()


def test_a_running_trys_start_keeps_ticking_beside_its_live_log(page: Any, live_server: Any) -> None:
    """Issue 34, item 6: an attempt's "started 14 s ago" stood still while the log above it ran on."""
    expect = sync_api.expect
    project = ProjectFactory()
    _building(project, "ticking", [drv("slow")])
    worker = connected_worker([project], name="builder-5")
    a = ask(worker.id)
    assert a is not None
    update(worker.id, a, kind="building", build_id=build_id_of(a))
    sign_in(page, live_server.url, f"/admin/scheduling/derivationbuild/{build_id_of(a)}/change/")
    started = page.locator(".inline-group time").first
    expect(started).to_contain_text("ago")
    first = started.inner_text()
    expect(started).not_to_have_text(first)  # without a reload
    expect(started).to_contain_text("ago")


# --- What does not apply is not said; one time style on every page (issue 34, items 6 and 7) ---------------

# How Django writes a datetime it is given as it is (en-us): "Dec. 4, 2026, 2:13 a.m.", or ISO text.
ABSOLUTE = re.compile(
    r"\b(Jan|Feb|March|April|May|June|July|Aug|Sept|Oct|Nov|Dec)[a-z]*\.? \d{1,2}, \d{4}"
    r"|\d{4}-\d\d-\d\d[T ]\d\d:\d\d"
    r"|\b\d{1,2}:\d\d ?[ap]\.m\."
)


def _absolute_times(page: Any) -> list[str]:
    """The absolute times in what a person reads of the page (a `<time>`'s hover title is not read)."""
    return [m.group(0) for m in ABSOLUTE.finditer(page.locator("body").inner_text())]


def test_a_cancel_is_signed_as_every_console_action_and_what_does_not_apply_is_not_said(
    page: Any, live_server: Any
) -> None:
    """A console cancel signed `admin:<user>` as its restart is (it showed `admin` for a cancel and
    `admin:admin` for a restart); an evaluation that ended says no more than "no" for waiting for
    workers (not "aborted after the grace"); a building and a completed build have no empty "why it
    waits" row."""
    expect = sync_api.expect
    project = ProjectFactory(name="nixpkgs-ci")
    evaluation = _building(project, "cancelled", [drv("base"), drv("app", "base")])
    worker = connected_worker([project], name="builder-1")
    base = DerivationBuild.objects.get(drv_path__endswith="-base.drv")
    a = ask(worker.id)
    assert a is not None and build_id_of(a) == str(base.id)
    update(worker.id, a, kind="building", build_id=build_id_of(a))
    done = DerivationBuild.objects.create(
        drv_path="/nix/store/" + "d" * 32 + "-done.drv",
        system="x86_64-linux",
        status=BuildStatus.COMPLETED,
        queued_at=timezone.now(),
        finished_at=timezone.now(),
    )

    sign_in(page, live_server.url, f"/admin/scheduling/derivationbuild/{base.id}/change/")
    expect(page.locator(".field-status")).to_contain_text("Building")
    expect(page.locator(".field-why_it_waits")).to_have_count(0)
    page.goto(f"{live_server.url}/admin/scheduling/derivationbuild/{done.id}/change/")
    expect(page.locator(".field-status")).to_contain_text("Completed")
    expect(page.locator(".field-why_it_waits")).to_have_count(0)

    page.goto(f"{live_server.url}/admin/scheduling/evaluation/{evaluation.id}/change/")
    expect(page.locator(".field-waits_for_workers")).to_contain_text(
        "aborted if no connected worker can build it for the grace"
    )  # while it runs, what the grace would do applies
    page.click("a.operation:has-text('Cancel')")
    page.click("input[type=submit][value^='Yes']")
    page.goto(f"{live_server.url}/admin/scheduling/evaluation/{evaluation.id}/change/")
    expect(page.locator(".field-status")).to_contain_text("Aborted")
    waits = page.locator(".field-waits_for_workers")
    expect(waits).to_contain_text("no")
    expect(waits).not_to_contain_text("grace")
    timeline = page.locator(".field-record_timeline")
    expect(timeline).to_contain_text("cancel requested")
    expect(timeline).to_contain_text("admin:op")
    page.screenshot(path=str(SHOTS / "console-cancelled.png"), full_page=True)
    assert [c.actor for c in record_job(job_key=evaluation.job_key, now=timezone.now()).controls] == [
        "admin:op"
    ]


def test_every_console_page_shows_its_times_in_the_one_relative_style(page: Any, live_server: Any) -> None:
    """A worker's "deactivated at", the sessions list and the job records showed absolute times beside
    the relative ones of every other page: each list of the scheduler's models, the first row's page and
    a worker's change history now show none (the exact time is on hover)."""
    expect = sync_api.expect
    project = ProjectFactory(name="nixpkgs-ci")
    evaluation = _building(project, "times", [drv("base"), drv("app", "base")])
    worker = connected_worker([project], name="builder-1")
    a = ask(worker.id)
    assert a is not None
    update(worker.id, a, kind="building", build_id=build_id_of(a))
    gone = WorkerFactory(name="builder-9", active=False, deactivated_at=timezone.now())
    WorkerSessionFactory(worker=gone, closed_at=timezone.now(), close_reason="deactivated")
    make_cluster([("server", queued_build(project))])
    now = timezone.now()
    ServerBoot.objects.create(hostname="serve-1", pid=1, started_at=now, last_heartbeat=now)
    PassState.objects.create(name="waiting", last_started_at=now, last_finished_at=now, runs=1)
    assert evaluation.job_key

    sign_in(page, live_server.url, f"/admin/workers/worker/{gone.id}/change/")
    expect(page.locator(".field-deactivated")).to_contain_text("ago")
    found = {f"/admin/workers/worker/{gone.id}/change/": _absolute_times(page)}
    # A worker is edited by form (its projects): its History is Django's change history, in the same style.
    page.locator("#id_projects_from option", has_text="nixpkgs-ci").dblclick()
    page.click("input[name=_continue]")
    page.click("a.historylink")
    expect(page.locator("#change-history")).to_contain_text("Changed Projects")
    expect(page.locator("#change-history tbody th time")).to_contain_text("ago")
    found[f"/admin/workers/worker/{gone.id}/history/"] = _absolute_times(page)
    for app in ("records", "scheduling", "workers", "clusters", "recovery"):
        page.goto(f"{live_server.url}/admin/{app}/")
        lists = [h for h in page.locator("#content-main a[href$='/']").evaluate_all(_HREFS) if h]
        for changelist in lists:
            page.goto(f"{live_server.url}{changelist}")
            found[changelist] = _absolute_times(page)
            first = page.locator("#result_list tbody tr th a, #result_list tbody tr td a").first
            if first.count():
                first.click()
                found[page.url.removeprefix(live_server.url)] = _absolute_times(page)
    assert len(found) > 20, sorted(found)
    absolute = [f"{url}: {times}" for url, times in found.items() if times]
    assert not absolute, "\n".join(absolute)


_HREFS = "links => links.map(a => a.getAttribute('href')).filter(h => /^\\/admin\\/\\w+\\/\\w+\\/$/.test(h))"
