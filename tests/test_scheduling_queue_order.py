"""A waiting build's position and ahead follow the hand-out order exactly (issue 33): a property test
against a simulation of the order (prioritized first, then the longest wait with every wait past the
WaitTime cap alike, then the smaller id), across several buckets (systems, a required feature, projects
alone and shared), checked against the positions queue_position reads and against what a worker of each
build's own shape is handed, one RequestJob at a time."""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradient.scheduling import queue_position, selectors
from gradient.scheduling.decisions.scoring import PoolView, wait_cap_secs
from gradient.scheduling.models import DerivationBuild, Evaluation, EvaluationStatus
from gradient.scheduling.services import graph
from tests.factories import ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, build_id_of, drv

pytestmark = pytest.mark.django_db(transaction=True)

SYSTEMS = ("x86_64-linux", "aarch64-linux")
FEATURE = "big-parallel"
POOL = PoolView(mean_wait_secs=60.0)  # the WaitTime cap: 4000 s
# Waits: two far past the cap (they tie there; the id decides), and some below it, some of them equal.
WAITS = (30 * 86400, 20 * 86400, 3000, 1800, 1800, 600, 60, 60, 5)


@dataclass(frozen=True)
class Spec:
    system: str
    big: bool
    projects: frozenset[int]  # 0, 1 or both
    wait: int
    prioritized: bool


@dataclass(frozen=True)
class Shape:
    system: str
    big: bool
    projects: frozenset[int]


specs = st.builds(
    Spec,
    system=st.sampled_from(SYSTEMS),
    big=st.booleans(),
    projects=st.sampled_from([frozenset({0}), frozenset({1}), frozenset({0, 1})]),
    wait=st.sampled_from(WAITS),
    prioritized=st.booleans(),
)


@dataclass(frozen=True)
class Row:
    id: uuid.UUID
    spec: Spec

    def shape(self) -> Shape:
        return Shape(self.spec.system, self.spec.big, self.spec.projects)


def takes(shape: Shape, row: Row) -> bool:
    """A worker of `shape` may be handed the build (its system, its features, a project of its)."""
    return (
        row.spec.system == shape.system
        and (shape.big or not row.spec.big)
        and bool(row.spec.projects & shape.projects)
    )


def order_key(row: Row, now: datetime, cap: float) -> tuple[bool, datetime, uuid.UUID]:
    start = now - timedelta(seconds=min(row.spec.wait, cap))
    return (not row.spec.prioritized, start, row.id)


def simulated_order(rows: list[Row], shape: Shape, now: datetime) -> list[Row]:
    """The simulation: the order in which a worker of `shape` that sends no scores is handed them."""
    cap = wait_cap_secs(POOL)
    return sorted((r for r in rows if takes(shape, r)), key=lambda r: order_key(r, now, cap))


def simulated_position(rows: list[Row], row: Row, now: datetime) -> int:
    return simulated_order(rows, row.shape(), now).index(row) + 1


_example = itertools.count()


@pytest.fixture
def pinned_pool(monkeypatch):  # type: ignore[no-untyped-def]
    """The pool's mean wait pinned, so the cap stays put while the builds handed out change it."""
    monkeypatch.setattr(selectors, "_pool_view", lambda now: POOL)
    monkeypatch.setattr(selectors, "_pool_cache", None)


def queue_builds(spec_list: list[Spec], now: datetime) -> list[Row]:
    """Two projects; each build wanted by an evaluation of each of its projects; queued `wait` ago."""
    n = next(_example)
    projects = [ProjectFactory(name=f"order-{n}-a"), ProjectFactory(name=f"order-{n}-b")]
    derivations = [
        drv(f"o{n}x{i}", system=s.system, features=[FEATURE] if s.big else [])
        for i, s in enumerate(spec_list)
    ]
    for p, project in enumerate(projects):
        evaluation = Evaluation.objects.create(
            project=project, repository="sim:x", commit=f"{n}", status=EvaluationStatus.BUILDING
        )
        mine = [d for d, s in zip(derivations, spec_list, strict=True) if p in s.projects]
        if mine:
            graph.ingest_eval_result(evaluation=evaluation, derivations=mine, now=now)
    rows = []
    for d, s in zip(derivations, spec_list, strict=True):
        build = DerivationBuild.objects.get(drv_path=d["drv_path"])
        assert build.status == "Queued"
        DerivationBuild.objects.filter(id=build.id).update(
            queued_at=now - timedelta(seconds=s.wait), prioritized=s.prioritized
        )
        rows.append(Row(build.id, s))
    queue_builds.projects = projects  # type: ignore[attr-defined]
    return rows


def read_position(row: Row, now: datetime, projects: list) -> int:  # type: ignore[type-arg]
    build = DerivationBuild.objects.get(id=row.id)
    return queue_position.build_position(build, now, {projects[p].id for p in row.spec.projects})


def test_positions_and_hand_outs_follow_the_simulated_order(pinned_pool) -> None:  # type: ignore[no-untyped-def]
    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(spec_list=st.lists(specs, min_size=1, max_size=10), drain=st.integers(min_value=0, max_value=9))
    def check(spec_list: list[Spec], drain: int) -> None:
        now = timezone.now()
        rows = queue_builds(spec_list, now)
        projects = queue_builds.projects  # type: ignore[attr-defined]
        for row in rows:
            position = read_position(row, now, projects)
            assert position == simulated_position(rows, row, now), row
            standing = queue_position.build_queue(DerivationBuild.objects.get(id=row.id), now)
            assert standing is not None and standing.ahead == position - 1

        # A worker of one build's own shape asks until it has nothing left: each time it is handed the
        # head of the simulated order, and every build of its shape still waiting stands where the
        # simulation puts it among what is left.
        shape = rows[drain % len(rows)].shape()
        worker = connected_worker(
            [projects[p] for p in sorted(shape.projects)],
            architectures=[shape.system],
            system_features=[FEATURE] if shape.big else [],
            max_concurrent_builds=len(rows) + 1,
        )
        left = list(rows)
        while True:
            expected = simulated_order(left, shape, now)
            for row in expected:
                if row.shape() == shape:
                    assert read_position(row, timezone.now(), projects) == expected.index(row) + 1
            a = ask(worker.id)
            if not expected:
                assert a is None
                break
            assert a is not None and build_id_of(a) == str(expected[0].id)
            left = [r for r in left if r.id != expected[0].id]

    check()


def test_the_embedded_modes_count_compares_the_features_itself(pinned_pool) -> None:  # type: ignore[no-untyped-def]
    """SQLite has no JSON containment: build_position compares the required features in Python there.
    The same builds, counted both ways, stand in the same places."""
    now = timezone.now()
    specs = [
        Spec("x86_64-linux", big, frozenset({0}), wait, prioritized)
        for big, wait, prioritized in [
            (True, 3000, False),
            (False, 1800, False),
            (True, 600, True),
            (False, 60, False),
            (False, 20 * 86400, False),
        ]
    ]
    rows = queue_builds(specs, now)
    projects = queue_builds.projects  # type: ignore[attr-defined]
    on_postgresql = [read_position(r, now, projects) for r in rows]
    here = [
        queue_position.build_position(
            DerivationBuild.objects.get(id=r.id), now, {projects[0].id}, features_in_db=False
        )
        for r in rows
    ]
    assert here == on_postgresql == [simulated_position(rows, r, now) for r in rows]
    assert len(set(here)) > 2  # the features did put some builds out of others' way
