"""The periodic passes on a real Celery worker with its embedded beat (`celery -A gradient worker -B`),
on Redis, over the test database: django-celery-beat's DatabaseScheduler installs every pass of
gradient.schedule as a PeriodicTask (what the admin lists), beat sends them, the worker runs them under
their leases, and a PeriodicTask an operator pauses (enabled = False) stops running until resumed."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from gradient.recovery.models import PassState
from gradient.schedule import beat_schedule
from gradient.scheduling.models import BuildStatus, DerivationBuild
from tests.factories import DerivationBuildFactory
from tests.support.processes import CeleryProcess, base_env, celery_worker, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def celery_env() -> dict[str, str]:
    db = settings.DATABASES["default"]
    if db["ENGINE"] != "django.db.backends.postgresql" or not settings.REDIS_URL:
        pytest.skip("needs PostgreSQL and Redis")
    url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    return base_env(DATABASE_URL=url, REDIS_URL=settings.REDIS_URL, GRADIENT_SCHEDULER_PASS_INTERVAL_SECS="1")


@pytest.fixture
def celery(celery_env: dict[str, str], tmp_path: Path) -> Iterator[CeleryProcess]:
    with celery_worker(celery_env, tmp_path) as worker:
        try:
            yield worker
        except BaseException:
            print(worker.log()[-8000:])
            raise


def _runs(name: str) -> int:
    state = PassState.objects.filter(name=name).first()
    return state.runs if state else 0


def test_beat_runs_the_assignment_pass_which_promotes_a_build_out_of_its_backoff(
    celery: CeleryProcess,
) -> None:
    due = DerivationBuildFactory(
        status=BuildStatus.FAILED_TRANSIENT, retry_at=timezone.now() - timedelta(seconds=1), attempts=1
    )
    backing_off = DerivationBuildFactory(
        status=BuildStatus.FAILED_TRANSIENT, retry_at=timezone.now() + timedelta(hours=1), attempts=1
    )

    wait_until(
        lambda: DerivationBuild.objects.get(id=due.id).status == BuildStatus.QUEUED,
        timeout=45,
        what="the assignment pass to queue the build whose retry_at passed",
    )

    assert DerivationBuild.objects.get(id=backing_off.id).status == BuildStatus.FAILED_TRANSIENT
    wait_until(lambda: _runs("assignment") >= 1, timeout=10, what="the run to be recorded")
    state = PassState.objects.get(name="assignment")
    assert state.last_error == "" and state.last_finished_at is not None
    assert state.last_result is not None and state.last_result["promoted"] in (0, 1)
    wait_until(lambda: _runs("cluster-dispatch") >= 2, timeout=20, what="the cluster-dispatch pass")
    assert "Traceback" not in celery.log()


def test_every_pass_is_a_periodic_task_in_the_admin_and_pausing_one_stops_it(
    celery: CeleryProcess, client: Client, settings: Any
) -> None:
    settings.GRADIENT_SCHEDULER_PASS_INTERVAL_SECS = 1  # as the Celery process has it
    expected = beat_schedule()
    wait_until(
        lambda: set(expected) <= set(PeriodicTask.objects.values_list("name", flat=True)),
        timeout=30,
        what="beat to install the passes",
    )
    for name, entry in expected.items():
        task = PeriodicTask.objects.get(name=name)
        assert task.task == entry["task"] and task.enabled
        assert task.interval is not None
        assert task.interval.every == int(entry["schedule"]) and task.interval.period == "seconds"
        # Every run expires within its interval (1 s, the shortest a whole number allows, for 1 s).
        assert task.expire_seconds == max(1, int(entry["schedule"] * 0.9))
    assert PeriodicTask.objects.get(name="assignment").interval.every == 1  # from the environment

    # An operator sees them under Periodic tasks.
    User.objects.create_user("admin", password="admin-pw", is_staff=True, is_superuser=True)
    client.login(username="admin", password="admin-pw")
    page = client.get("/admin/django_celery_beat/periodictask/")
    assert page.status_code == 200
    for name in expected:
        assert name.encode() in page.content

    wait_until(lambda: _runs("assignment") >= 2, timeout=30, what="the assignment pass to run")

    # Pause it, as the admin's "Disable selected tasks" does (a save, so beat notices the change).
    task = PeriodicTask.objects.get(name="assignment")
    task.enabled = False
    task.save()
    # Beat rereads its schedule once it sees the change; from then on the pass is not sent. The
    # cluster-dispatch pass (same 1 s interval) shows beat is still ticking meanwhile.
    marker = _runs("cluster-dispatch")
    wait_until(lambda: _runs("cluster-dispatch") >= marker + 3, timeout=30, what="beat to tick")
    paused_at = _runs("assignment")
    marker = _runs("cluster-dispatch")
    wait_until(lambda: _runs("cluster-dispatch") >= marker + 4, timeout=30, what="beat to tick on")
    assert _runs("assignment") == paused_at

    task.enabled = True
    task.save()
    wait_until(lambda: _runs("assignment") > paused_at, timeout=30, what="the resumed pass to run again")
    assert "Traceback" not in celery.log()
