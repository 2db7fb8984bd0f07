"""The planner: one placement pass over every cluster able to start."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gradient.clusters.decisions.coordinator import CoordinatorPolicy
from gradient.clusters.decisions.planner import PlannerPolicy, PlanResult, plan_pass
from gradient.clusters.decisions.types import (
    Cluster,
    Pool,
    Reservation,
    ReservedSeat,
    SlotKind,
    WaitingCode,
)
from tests.support.clusters import NOW, ago, build, cluster, evaluation, later, pool, worker


def seated(result: PlanResult) -> dict[str, list[str]]:
    return {p.cluster_id: sorted(s.worker_id for s in p.seats) for p in result.placements}


def reservation(cid: str, *seats: tuple[str, SlotKind]) -> Reservation:
    return Reservation(
        cluster_id=cid,
        seats=tuple(ReservedSeat("r", i, kind, wid) for i, (wid, kind) in enumerate(seats)),
        created_at=ago(10),
        expires_at=later(1000),
    )


# All clusters able to start get a placement, prioritized clusters first, then the oldest.


def test_prioritized_clusters_are_placed_first() -> None:
    old = cluster("old", build("a"), age=3000)
    urgent = cluster("urgent", build("a"), age=10, priority=True)

    result = plan_pass([old, urgent], pool([worker("w1")]), NOW)

    assert seated(result) == {"urgent": ["w1"]}


def test_among_equals_the_oldest_cluster_is_placed_first() -> None:
    young = cluster("young", build("a"), age=10)
    old = cluster("old", build("a"), age=500)

    result = plan_pass([young, old], pool([worker("w1")]), NOW)

    assert seated(result) == {"old": ["w1"]}


def test_the_pass_is_the_same_whatever_order_the_clusters_arrive_in() -> None:
    clusters = [cluster(f"c{i}", build("a"), build("b"), age=100 + i % 3) for i in range(6)]
    p = pool([worker(f"w{i}") for i in range(5)])

    assert plan_pass(clusters, p, NOW) == plan_pass(list(reversed(clusters)), p, NOW)


# The pass will not offer a worker seated for one cluster to the next cluster.


def test_a_worker_seated_for_one_cluster_is_not_offered_to_the_next() -> None:
    first = cluster("first", build("a"), build("b"), age=200)
    second = cluster("second", build("a"), build("b"), age=100)
    third = cluster("third", build("a"), age=50)
    p = pool([worker("w1"), worker("w2"), worker("w3")])

    result = plan_pass([first, second, third], p, NOW)

    assert seated(result) == {"first": ["w1", "w2"], "third": ["w3"]}
    assert result.waiting["second"].as_json() == {
        "code": "too_few_workers",
        "seatable_workers": 1,
        "needed": 2,
    }


def test_a_worker_seated_for_its_build_slot_is_not_offered_for_its_eval_slot() -> None:
    first = cluster("first", build("a"), age=200)
    second = cluster("second", evaluation("a"), age=100)
    p = pool([worker("w1")], idle_build=["w1"], idle_eval=["w1"])

    result = plan_pass([first, second], p, NOW)

    assert seated(result) == {"first": ["w1"]}
    assert result.waiting["second"].members[0].reason == "no_idle_slot"


# A cluster without a full placement must keep waiting. Single assignment is unaffected.


def test_a_cluster_without_a_full_placement_keeps_waiting_and_says_why() -> None:
    big = cluster("big", build("a"), build("b"), build("c"), age=300)

    result = plan_pass([big], pool([worker("w1"), worker("w2")]), NOW)

    assert result.placements == ()
    assert result.waiting["big"].code == WaitingCode.TOO_FEW_WORKERS


def test_a_waiting_cluster_leaves_its_workers_to_the_clusters_behind_it() -> None:
    big = cluster("big", build("a"), build("b"), build("c"), age=300)
    small = cluster("small", build("a"), build("b"), age=100)

    result = plan_pass([big, small], pool([worker("w1"), worker("w2")]), NOW)

    assert seated(result) == {"small": ["w1", "w2"]}


# Clusters in backoff, parked, or with a member unable to start are skipped.


def test_a_cluster_backing_off_after_a_failed_prepare_is_skipped_until_retry_at() -> None:
    c = cluster("c", build("a"), retry_at=later(20), prepare_failures=1)

    result = plan_pass([c], pool([worker("w1")]), NOW)

    assert result.placements == ()
    assert result.waiting["c"].as_json() == {
        "code": "backoff",
        "until": later(20).isoformat(),
        "prepare_failures": 1,
    }


def test_a_cluster_whose_retry_at_has_passed_is_placed_again() -> None:
    c = cluster("c", build("a"), retry_at=ago(1), prepare_failures=1)

    assert seated(plan_pass([c], pool([worker("w1")]), NOW)) == {"c": ["w1"]}


def test_a_parked_cluster_is_not_placed() -> None:
    cap = CoordinatorPolicy().park_after_failures
    c = cluster("c", build("a"), prepare_failures=cap)

    result = plan_pass([c], pool([worker("w1")]), NOW)

    assert result.placements == ()
    assert result.waiting["c"].as_json() == {"code": "parked", "prepare_failures": cap}


def test_a_member_that_can_no_longer_start_holds_its_cluster_back() -> None:
    c = cluster("c", build("a"), build("b", can_start=False))

    result = plan_pass([c], pool([worker("w1"), worker("w2")]), NOW)

    assert result.placements == ()
    assert result.waiting["c"].as_json() == {
        "code": "member_cannot_start",
        "blocked": [{"role": "b", "index": 0}],
    }


# Aging reservations: reserved seats are offered to nobody else; the planner names who should reserve.


def test_the_seats_of_the_reservation_in_force_are_not_offered_to_other_clusters() -> None:
    reserved = cluster("reserved", build("a"), build("b"), age=900)
    other = cluster("other", build("a"), age=10)
    held = reservation("reserved", ("w1", SlotKind.BUILD), ("w2", SlotKind.BUILD))

    result = plan_pass(
        [reserved, other], pool([worker("w1"), worker("w2"), worker("w3")]), NOW, reservation=held
    )

    assert seated(result) == {"other": ["w3"]}


def test_a_reserved_seat_still_offers_its_other_kind() -> None:
    held = reservation("reserved", ("w1", SlotKind.BUILD))
    other = cluster("other", evaluation("a"))
    p = pool([worker("w1")], idle_build=["w1"], idle_eval=["w1"])

    result = plan_pass([cluster("reserved", build("a"), age=900), other], p, NOW, reservation=held)

    assert seated(result) == {"other": ["w1"]}


def test_the_reserved_cluster_is_left_to_the_reservation_step() -> None:
    held = reservation("reserved", ("w1", SlotKind.BUILD), ("w2", SlotKind.BUILD))
    c = cluster("reserved", build("a"), build("b"), age=900)

    result = plan_pass([c], pool([worker("w1"), worker("w2")], idle_build=["w2"]), NOW, reservation=held)

    assert result.placements == ()
    assert result.waiting["reserved"].as_json() == {"code": "reserved", "seatable_workers": 1, "needed": 2}


def test_the_oldest_aged_unplaced_cluster_should_reserve() -> None:
    after = PlannerPolicy().reserve_after_secs
    older = cluster("older", build("a"), build("b"), age=after + 500)
    aged = cluster("aged", build("a"), build("b"), age=after + 1)
    young = cluster("young", build("a"), build("b"), age=after - 1)

    result = plan_pass([young, aged, older], pool([worker("w1")]), NOW)

    assert result.reserve == "older"


def test_a_young_cluster_should_not_reserve() -> None:
    young = cluster("young", build("a"), build("b"), age=PlannerPolicy().reserve_after_secs - 1)

    assert plan_pass([young], pool([worker("w1")]), NOW).reserve is None


def test_no_cluster_should_reserve_while_a_reservation_exists() -> None:
    aged = cluster("aged", build("a"), build("b"), age=5000)
    held = reservation("someone-else", ("w9", SlotKind.BUILD))

    assert plan_pass([aged], pool([worker("w1")]), NOW, reservation=held).reserve is None


def test_a_cluster_that_cannot_be_tried_should_not_reserve() -> None:
    backing_off = cluster("c", build("a"), build("b"), age=5000, retry_at=later(30), prepare_failures=1)

    assert plan_pass([backing_off], pool([worker("w1")]), NOW).reserve is None


# Property: across a pass, no worker is seated twice.


@st.composite
def passes(draw: st.DrawFn) -> tuple[list[Cluster], Pool]:
    n_workers = draw(st.integers(1, 8))
    workers = [worker(f"w{i}", zone=draw(st.sampled_from([None, "a", "b"]))) for i in range(n_workers)]
    idle_build = [w.worker_id for w in workers if draw(st.booleans())]
    idle_eval = [w.worker_id for w in workers if draw(st.booleans())]
    clusters = []
    for c in range(draw(st.integers(1, 6))):
        members = [
            (build if draw(st.booleans()) else evaluation)(f"m{i}", key=f"job:{c}-{i}")
            for i in range(draw(st.integers(1, 3)))
        ]
        clusters.append(
            cluster(
                f"c{c}",
                *members,
                age=draw(st.integers(0, 2000)),
                same_zone=draw(st.booleans()),
                priority=draw(st.booleans()),
            )
        )
    return clusters, pool(workers, idle_build=idle_build, idle_eval=idle_eval)


@settings(max_examples=200, deadline=None)
@given(passes())
def test_a_pass_never_seats_one_worker_for_two_members(scenario: tuple[list[Cluster], Pool]) -> None:
    clusters, p = scenario
    result = plan_pass(clusters, p, NOW)

    workers = [s.worker_id for placement in result.placements for s in placement.seats]
    assert len(workers) == len(set(workers))
    assert {pl.cluster_id for pl in result.placements} | set(result.waiting) == {
        c.cluster_id for c in clusters
    }
