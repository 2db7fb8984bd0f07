"""A lane warmed before the first worker connects (gradient/runtime/lanes.py, serve's start through
dispatcher.warm_lanes): each of its threads has its connection open, and on the claims lane the claim
statement is planned, claiming nothing."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections
from django.utils import timezone

from gradient.core.vocab import BuildStatus
from gradient.runtime import lanes
from gradient.scheduling.models import DerivationBuild, DispatchedJob
from gradient.scheduling.services import claims
from gradient.scheduling.services.assignment import request_builds
from tests.factories import ProjectFactory, connected_worker
from tests.test_scheduling_book import _building

pytestmark = pytest.mark.django_db(transaction=True)


def test_warming_a_lane_opens_the_connection_of_each_of_its_threads_and_prepares_there() -> None:
    lane = lanes.Lane("warm-test", lambda: 3)
    seen: list[tuple[int, bool]] = []
    lock = threading.Lock()

    def prepare() -> None:
        with lock:
            seen.append((threading.get_ident(), connections["default"].connection is not None))

    try:
        assert lane.warm(5, prepare) == 3  # no more than its threads
        assert len({ident for ident, _ in seen}) == 3, "one call on each thread"
        assert all(opened for _, opened in seen)
        # What runs on the lane afterwards finds its thread's connection open.
        assert lane.executor().submit(lambda: connections["default"].connection is not None).result(5)
    finally:
        lane.shutdown()


def _claim_statements() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE '%%json_to_recordset%%'"
        )
        return int(cursor.fetchone()[0])


def test_the_claim_statement_planned_ahead_claims_nothing_and_is_the_one_the_batches_run() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the claim statement is PostgreSQL's")
    project = ProjectFactory()
    _building(project, ["a", "b"])
    worker = connected_worker([project])

    claims.claim_statement_prepare(now=timezone.now())

    assert not DispatchedJob.objects.exists()
    assert DerivationBuild.objects.filter(status=BuildStatus.QUEUED).count() == 2
    assert _claim_statements() == 1
    answers = request_builds(worker_ids=[worker.id], now=timezone.now(), tried=[])
    assert answers[0] is not None and DispatchedJob.objects.count() == 1
    assert _claim_statements() == 1, "the batch ran the statement planned ahead, not one of its own"
