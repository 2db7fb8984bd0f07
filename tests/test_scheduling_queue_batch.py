"""The ETA pass reads many waiting builds' standing at once (queue_position.build_positions and
build_queues, issue 33): the same positions as the hand-out order's simulation and as one build's own
read, in a number of statements that does not grow with the builds (one read of the order per shape of
build, each input once), so that the pass does not slow the hand-outs it estimates."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradient.scheduling import queue_position
from gradient.scheduling.models import DerivationBuild, StartEstimate
from gradient.scheduling.services import estimates
from tests.factories import ProjectFactory, connected_worker
from tests.scheduling_helpers import drv
from tests.test_scheduling_queue_order import Spec, queue_builds, simulated_position, specs
from tests.test_scheduling_queue_order import pinned_pool as pinned_pool  # a fixture
from tests.test_scheduling_queue_position import queued

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.usefixtures("pinned_pool")
def test_many_positions_at_once_follow_the_simulated_order() -> None:
    @settings(
        max_examples=20,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(spec_list=st.lists(specs, min_size=1, max_size=10))
    def check(spec_list: list[Spec]) -> None:
        now = timezone.now()
        rows = queue_builds(spec_list, now)
        projects = queue_builds.projects  # type: ignore[attr-defined]
        builds = list(DerivationBuild.objects.filter(id__in=[r.id for r in rows]))
        projects_of = {r.id: {projects[p].id for p in r.spec.projects} for r in rows}
        expected = {r.id: simulated_position(rows, r, now) for r in rows}
        assert queue_position.build_positions(builds, now, projects_of) == expected
        # The embedded mode's way (the features compared in Python) counts alike.
        assert queue_position.build_positions(builds, now, projects_of, features_in_db=False) == expected
        # And so do the whole standings, against one build's own read.
        many = queue_position.build_queues(builds, now)
        for build in builds:
            assert many[build.id] == queue_position.build_queue(build, now), build.id

    check()


def _statements(n: int) -> int:
    """The statements of estimating `n` newly queued builds of one project, of five derivation names
    (each a store hash of its own)."""
    project = ProjectFactory()
    connected_worker([project], max_concurrent_builds=2)
    derivations = []
    for i in range(n):
        name = f"pkg{i % 5}"
        derivations.append({**drv(name), "drv_path": f"/nix/store/{n:016d}{i:016d}-{name}.drv"})
    queued(project, *derivations)
    with CaptureQueriesContext(connection) as captured:
        assert estimates.start_estimates_record(now=timezone.now() + timedelta(minutes=1), limit=1000) == n
    return len(captured.captured_queries)


def test_the_pass_reads_a_fixed_number_of_statements_whatever_the_builds() -> None:
    few, many = _statements(5), _statements(40)
    assert few == many, (few, many)
    assert StartEstimate.objects.count() == 45
