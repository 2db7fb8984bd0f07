"""The operator's round (issue 24, "Done when"), page by page through the console as a browser would
fetch it: the overview, a failed evaluation, its failed build and its log, rebuild, restart, and the
new evaluation completing; every page on the way names its jobs, shows one time style, no raw JSON and
no UUID as visible text except in an id field. (The same round in Chromium, with its JavaScript:
tests/test_console_pages_browser.py.)"""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from gradient.core.vocab import BuildStatus, EvaluationStatus
from gradient.scheduling.models import DerivationBuild, Evaluation
from gradient.scheduling.services.evaluations import evaluation_create
from tests.factories import ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, build, drv, evaluate, report

pytestmark = pytest.mark.django_db(transaction=True)  # control hooks run once the intent committed

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")
GRAPH = [drv("libfoo"), drv("hello", "libfoo", attr="packages.x86_64-linux.hello")]


def visible(html: str) -> str:
    """What a reader sees: no tags, attributes, scripts, folded JSON or hidden inputs; an id field's
    value (the one place a UUID belongs) left out."""
    html = re.sub(r"<(script|style|details)\b.*?</\1>", "", html, flags=re.S)
    html = re.sub(
        r'<div class="form-row field-id">.*?<div class="readonly">[^<]*</div>', "", html, flags=re.S
    )
    html = re.sub(r"<[^>]+>", " ", html)
    return re.sub(r"\s+", " ", html)


def looks_right(page: str) -> str:
    text = visible(page)
    assert not UUID.search(text), UUID.search(text)
    assert not ISO.search(text), ISO.search(text)  # one time style: relative, exact on hover
    assert '["' not in text and "[{" not in text  # no raw JSON lists
    return text


def test_overview_failed_evaluation_its_build_and_log_rebuild_restart_and_the_new_one_completes() -> None:
    console = Client()
    console.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    project = ProjectFactory(name="nixpkgs-ci")
    worker = connected_worker([project], name="builder-1", architectures=["x86_64-linux"])
    evaluation, _ = evaluation_create(
        project=project, repository="sim:round", commit="c0ffee", now=timezone.now()
    )
    evaluate(worker.id, ask(worker.id, "flake"), GRAPH)
    failing = ask(worker.id)
    assert failing is not None
    report(worker.id, failing, "JobFailed", error="make: *** [all] Error 2", kind="permanent")
    assert Evaluation.objects.get(id=evaluation.id).status == EvaluationStatus.FAILED
    libfoo = DerivationBuild.objects.get(drv_path=GRAPH[0]["drv_path"])

    overview = console.get(reverse("console-overview-json")).json()
    assert {f["name"] for f in overview["recent_failures"]} == {"libfoo", "hello"}  # hello: its dependency
    looks_right(console.get(reverse("console-overview")).content.decode())

    page = console.get(reverse("admin:scheduling_evaluation_change", args=[evaluation.id])).content.decode()
    text = looks_right(page)
    assert "libfoo" in text and "Failed" in text and "builder-1" in text

    page = console.get(reverse("admin:scheduling_derivationbuild_change", args=[libfoo.id])).content.decode()
    text = looks_right(page)
    assert "libfoo" in text and "make: *** [all] Error 2" in text and "attempt 1 on builder-1" in text

    rebuild = reverse("admin:scheduling_derivationbuild_operate", args=[libfoo.id, "rebuild_builds"])
    looks_right(console.get(rebuild).content.decode())
    looks_right(console.post(rebuild, {"confirmed": "yes"}, follow=True).content.decode())
    assert DerivationBuild.objects.get(id=libfoo.id).status == BuildStatus.QUEUED

    restart = reverse("admin:scheduling_evaluation_operate", args=[evaluation.id, "restart_evaluations"])
    asked = looks_right(console.get(restart).content.decode())
    assert "still failed" not in asked  # rebuilt already: nothing to warn about
    done = looks_right(console.post(restart, {"confirmed": "yes"}, follow=True).content.decode())
    assert "restarted as sim:round@c0ffee" in done
    successor = Evaluation.objects.exclude(id=evaluation.id).get()

    evaluate(worker.id, ask(worker.id, "flake"), GRAPH)
    for _ in GRAPH:
        assignment = ask(worker.id)
        assert assignment is not None
        build(worker.id, assignment)
    assert Evaluation.objects.get(id=successor.id).status == EvaluationStatus.COMPLETED

    page = console.get(reverse("admin:scheduling_evaluation_change", args=[successor.id])).content.decode()
    text = looks_right(page)
    assert "Completed" in text and "restarts sim:round@c0ffee" in text
    looks_right(console.get(reverse("admin:scheduling_evaluation_changelist")).content.decode())
    looks_right(console.get(reverse("admin:scheduling_dispatchedjob_changelist")).content.decode())
    looks_right(console.get(reverse("admin:workers_worker_change", args=[worker.id])).content.decode())
