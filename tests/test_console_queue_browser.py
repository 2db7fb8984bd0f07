"""Where a waiting build stands, in a real browser (issue 33): the overview draws the first in line
(position, ahead, busy slots, waited, expected start) and the last day's estimate error, then the
operator follows the head to its page, which says where it stands and when it is expected to start.
Skipped without Chromium or Playwright."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from gradient.scheduling.models import StartEstimate
from tests.factories import DerivationBuildFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, drv
from tests.test_console_browser import CHROMIUM, SHOTS, page, sign_in, sync_api

__all__ = ["page"]  # the browser fixture of the console's tests
from tests.test_console_queue import tries
from tests.test_scheduling_queue_position import queued

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)"),
]


def named(name: str, n: int) -> dict[str, Any]:
    """A derivation whose store name has dashes and dots, as real ones do (drv() pads the name)."""
    path = f"/nix/store/{str(n) * 32}-{name}"
    return {**drv(f"d{n}"), "drv_path": f"{path}.drv", "outputs": [{"name": "out", "path": path}]}


def test_the_overviews_first_in_line_leads_to_a_build_that_says_when_it_starts(
    page: Any, live_server: Any
) -> None:
    expect = sync_api.expect
    project = ProjectFactory(name="nixpkgs-ci")
    worker = connected_worker([project])  # one slot
    _, (running, head, after) = queued(
        project, named("gcc-13.2", 1), named("hello-2.12", 2), named("firefox-128", 3)
    )
    tries("hello-2.12", 200.0, 240.0, 300.0)
    tries("firefox-128", 1200.0)
    assert ask(worker.id) is not None  # gcc takes the slot
    now = timezone.now()
    done = DerivationBuildFactory(drv_path="/nix/store/" + "e" * 32 + "-bash-5.2.drv", status="Completed")
    StartEstimate.objects.create(
        build=done,
        waiting_since=now - timedelta(minutes=20),
        estimated_at=now - timedelta(minutes=20),
        position=3,
        expected_start=now - timedelta(minutes=10),
        basis="derivation",
        started_at=now - timedelta(minutes=10) + timedelta(seconds=75),
        error_secs=75.0,
    )

    sign_in(page, live_server.url, "/admin/overview/")
    rows = page.locator("#ov-head tr")
    expect(rows).to_have_count(2)
    expect(rows.nth(0)).to_contain_text("hello-2.12")
    expect(rows.nth(0)).to_contain_text("1 of 1")  # busy of the slots that can run it
    expect(rows.nth(0)).to_contain_text("in 2 min 0 s")  # half of its 240 s median on the busy slot
    expect(rows.nth(1)).to_contain_text("firefox-128")
    expect(rows.nth(1)).to_contain_text("in 30 min 0 s")  # 1.5 of its 1 200 s typical: hello first
    expect(page.locator("#ov-running")).to_contain_text("gcc-13.2")
    expect(page.locator("#ov-eta-errors")).to_contain_text(
        "off by 1 min 15 s (p50), 1 min 15 s (p90) over 1 build handed out"
    )
    page.screenshot(path=str(SHOTS / "console-overview-queue.png"), full_page=True)

    page.click("#ov-head a:has-text('hello-2.12')")
    expect(page.locator("h1")).to_contain_text("View shared build")
    stands = page.locator(".field-where_it_stands")
    expect(stands).to_contain_text("position 1 of the builds the same workers can run (0 ahead)")
    expect(stands).to_contain_text("1 of 1 slots busy")
    expect(stands).to_contain_text("between 1 min 40 s and 2 min 30 s from now")
    expect(stands).to_contain_text("from past builds of this derivation")
    page.screenshot(path=str(SHOTS / "console-build-queue.png"), full_page=True)
