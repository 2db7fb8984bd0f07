"""The error of past start estimates (issue 33, "honest estimates"): the ETA pass writes down where a
newly waiting build stood, settles it once the build is handed out, drops what can never start; the
error's p50/p90 over the last day and the histogram gradient_eta_error_seconds of GET /metrics."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from gradient.core.vocab import BuildAttemptOutcome
from gradient.schedule import PASSES
from gradient.scheduling.models import BuildAttempt, DerivationBuild, DispatchedJob, StartEstimate
from gradient.scheduling.services import estimates
from tests.factories import DerivationBuildFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, build_id_of, drv
from tests.test_metrics import samples
from tests.test_scheduling_queue_position import queued

pytestmark = pytest.mark.django_db(transaction=True)


def history(name: str, secs: float) -> None:
    earlier = DerivationBuildFactory(drv_path=f"/nix/store/{'z' * 32}-{name}.drv", status="Completed")
    ended = timezone.now() - timedelta(hours=2)
    BuildAttempt.objects.create(
        build=earlier,
        number=1,
        outcome=BuildAttemptOutcome.BUILT,
        started_at=ended - timedelta(seconds=secs),
        finished_at=ended,
    )


def test_the_pass_estimates_each_wait_once_and_settles_it_at_the_hand_out() -> None:
    assert any(p.name == "eta" and p.seconds() > 0 for p in PASSES)
    project = ProjectFactory()
    worker = connected_worker([project])  # one slot
    _, (first, second) = queued(project, drv("first"), drv("second"))
    history("first", 100.0)
    history("second", 100.0)
    # The pass estimates each build at the later of `now` and the clock: a `now` ahead of the clock
    # makes the figures exact.
    now = timezone.now() + timedelta(minutes=10)
    result = estimates.start_estimate_pass(now=now)
    assert (result.recorded, result.settled, result.dropped) == (2, 0, 0)
    rows = {e.build_id: e for e in StartEstimate.objects.all()}
    assert rows[first.id].position == 1 and rows[first.id].expected_start == now
    # One ahead on a free slot: the first takes it, the second starts half a typical time later.
    assert rows[second.id].position == 2 and rows[second.id].expected_start == now + timedelta(seconds=50)
    assert rows[second.id].basis == "derivation"
    assert estimates.start_estimate_pass(now=now).recorded == 0  # each wait once

    a = ask(worker.id)
    assert a is not None and build_id_of(a) == str(first.id)
    # Handed out 20 s after the estimate said (the test sets the time of the claim).
    DispatchedJob.objects.filter(id=a.assignment_id).update(dispatched_at=now + timedelta(seconds=20))
    result = estimates.start_estimate_pass(now=now + timedelta(seconds=30))
    assert (result.recorded, result.settled) == (0, 1)
    settled = StartEstimate.objects.get(build_id=first.id)
    assert settled.started_at == now + timedelta(seconds=20) and settled.error_secs == pytest.approx(20.0)
    assert StartEstimate.objects.get(build_id=second.id).started_at is None

    # The second's wait ends without a hand-out (a cache had it): nothing to compare, dropped.
    DerivationBuild.objects.filter(id=second.id).update(status="Substituted")
    assert estimates.start_estimate_pass(now=now + timedelta(seconds=40)).dropped == 1
    assert list(StartEstimate.objects.values_list("build_id", flat=True)) == [first.id]

    errors = estimates.start_estimate_errors(now=now + timedelta(minutes=1))
    assert (errors.count, errors.p50_secs, errors.p90_secs) == (1, pytest.approx(20.0), pytest.approx(20.0))
    assert estimates.start_estimate_errors(now=now + timedelta(days=2)).count == 0  # the last day only

    scraped = samples(Client().get("/metrics").content.decode())
    assert scraped[("gradient_eta_error_seconds_count", ())] == 1
    assert scraped[("gradient_eta_error_seconds_sum", ())] == pytest.approx(20.0)
    assert scraped[("gradient_eta_error_seconds_bucket", (("le", "15.0"),))] == 0
    assert scraped[("gradient_eta_error_seconds_bucket", (("le", "30.0"),))] == 1


def test_percentiles_of_the_last_days_errors() -> None:
    project = ProjectFactory()
    _, builds = queued(project, *(drv(f"p{i}") for i in range(10)))
    now = timezone.now()
    for i, b in enumerate(builds):
        StartEstimate.objects.create(
            build_id=b.id,
            waiting_since=now - timedelta(hours=1),
            estimated_at=now - timedelta(hours=1),
            position=1,
            expected_start=now - timedelta(minutes=30),
            basis="derivation",
            started_at=now - timedelta(minutes=30) + timedelta(seconds=10 * (i + 1)),
            error_secs=10.0 * (i + 1),
        )
    errors = estimates.start_estimate_errors(now=now)
    assert (errors.count, errors.p50_secs, errors.p90_secs) == (10, 50.0, 90.0)


def test_an_unknown_estimate_is_written_down_and_never_counted(settings) -> None:
    settings.GRADIENT_ETA_DEFAULT_BUILD_SECS = 0
    project = ProjectFactory()
    worker = connected_worker([project])
    _, (b,) = queued(project, drv("nohistory"))
    now = timezone.now()
    assert estimates.start_estimate_pass(now=now).recorded == 1
    assert StartEstimate.objects.get().expected_start is None
    a = ask(worker.id)
    assert a is not None
    result = estimates.start_estimate_pass(now=now + timedelta(seconds=5))
    assert (result.settled, result.dropped) == (0, 1)
    assert estimates.start_estimate_errors(now=now).count == 0


def test_the_eta_task_runs_the_pass_and_old_estimates_go() -> None:
    from gradient.scheduling.tasks import eta_pass

    project = ProjectFactory()
    connected_worker([project])
    _, (waiting, done) = queued(project, drv("waiting"), drv("done"))
    long_ago = timezone.now() - timedelta(days=8)
    StartEstimate.objects.create(
        build_id=done.id,
        waiting_since=long_ago,
        estimated_at=long_ago,
        position=1,
        expected_start=long_ago,
        basis="default",
        started_at=long_ago + timedelta(seconds=5),
        error_secs=5.0,
    )
    result = eta_pass()
    assert result == {"recorded": 2, "settled": 0, "dropped": 1}  # both waits estimated; the old one gone
    assert set(StartEstimate.objects.values_list("build_id", flat=True)) == {waiting.id, done.id}
    assert not StartEstimate.objects.filter(estimated_at__lt=timezone.now() - timedelta(days=7)).exists()
