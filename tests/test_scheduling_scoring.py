"""The scoring rules of the reference notes, one table test per rule, and properties of the ranking."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradient.scheduling.decisions.scoring import (
    RESOURCE_AWARE,
    SIMPLE,
    Candidate,
    PoolView,
    WorkerView,
    metrics_stale,
    policy_name,
    rank,
    saturation_holds_back,
    saturation_signals,
    score,
)

W = WorkerView()
P = PoolView()


def c(job_id: str = "build:a", **kw: object) -> Candidate:
    kw.setdefault("kind", "build")
    kw.setdefault("waited_secs", 0.0)
    return Candidate(job_id=job_id, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("waited", "mean", "expected"),
    [(0, None, 0.0), (60, None, 60.0), (120, 60, 120.0), (30, 15, 120.0), (10_000, None, 4000.0)],
)
def test_wait_time_is_sixty_times_the_wait_over_the_mean_capped_at_4000(waited, mean, expected) -> None:
    s = score(c(waited_secs=waited), W, PoolView(mean_wait_secs=mean))
    assert s.breakdown["WaitTime"] == pytest.approx(expected)


def test_estimated_time_rewards_a_worker_that_has_everything_already() -> None:
    local = score(c(missing_nar_size=0), W, P)
    remote = score(c(missing_nar_size=10 * 1024**3), W, P)
    assert local.breakdown["EstimatedTime"] == 3600
    assert remote.breakdown["EstimatedTime"] < local.breakdown["EstimatedTime"]


def test_estimated_time_scales_build_history_by_the_workers_core_score() -> None:
    fast = score(c(history_secs=1000), WorkerView(cpu_core_score=2000), P)
    slow = score(c(history_secs=1000), WorkerView(cpu_core_score=500), P)
    assert fast.breakdown["EstimatedTime"] == pytest.approx(3600 - 500)
    assert slow.breakdown["EstimatedTime"] == pytest.approx(3600 - 2000)


def test_estimated_time_never_goes_below_zero() -> None:
    assert score(c(history_secs=10**9), W, P).breakdown["EstimatedTime"] == 0


def test_qos_adds_5000_for_a_prioritized_job() -> None:
    assert score(c(prioritized=True), W, P).breakdown["Qos"] == 5000
    assert score(c(), W, P).breakdown["Qos"] == 0


def test_rescore_wait_vetoes_an_offered_build_whose_score_is_not_in_for_up_to_four_passes() -> None:
    assert score(c(offered_passes_ago=0), W, P).vetoed_by == "RescoreWait"
    assert score(c(offered_passes_ago=3), W, P).vetoed_by == "RescoreWait"
    assert score(c(offered_passes_ago=4), W, P).vetoed_by is None
    assert score(c(offered_passes_ago=0, missing_nar_size=5), W, P).vetoed_by is None
    assert score(c(kind="eval", offered_passes_ago=0), W, P).vetoed_by is None
    assert score(c(offered_passes_ago=None), W, P).vetoed_by is None


def test_reserve_fetch_workers_penalises_a_fetch_worker_for_a_job_without_fetch_by_pool_busyness() -> None:
    fetcher = WorkerView(can_fetch=True)
    busy = PoolView(fetch_workers_idle=0, fetch_workers_total=4)
    half = PoolView(fetch_workers_idle=2, fetch_workers_total=4)
    idle = PoolView(fetch_workers_idle=4, fetch_workers_total=4)
    assert score(c(), fetcher, busy).breakdown["ReserveFetchWorkers"] == -300
    assert score(c(), fetcher, half).breakdown["ReserveFetchWorkers"] == -150
    assert score(c(), fetcher, idle).breakdown["ReserveFetchWorkers"] == 0
    assert score(c(has_fetch_step=True), fetcher, busy).breakdown["ReserveFetchWorkers"] == 0
    assert score(c(), WorkerView(can_fetch=False), busy).breakdown["ReserveFetchWorkers"] == 0


def test_reserve_fetch_workers_never_refuses_a_job() -> None:
    s = score(c(kind="eval", waited_secs=600), WorkerView(can_fetch=True), PoolView(0, 0, 3))
    assert s.vetoed_by is None and s.eligible


def test_transfer_limit_penalises_a_large_transfer_when_the_workers_transfer_slots_are_full() -> None:
    big = c(missing_nar_size=2 * 1024**3)
    assert score(big, WorkerView(large_transfers_running=2), P).breakdown["TransferLimit"] == -4000
    assert score(big, WorkerView(large_transfers_running=1), P).breakdown["TransferLimit"] == 0
    small = c(missing_nar_size=1024)
    assert score(small, WorkerView(large_transfers_running=5), P).breakdown["TransferLimit"] == 0


def test_resource_saturation_costs_8600_per_signal_under_the_resource_aware_policy() -> None:
    hot = WorkerView(cpu_usage_pct=95, ram_free_mb=500, ram_total_mb=16000, build_peak_ram_mb=4000)
    assert score(c(), hot, P, RESOURCE_AWARE).breakdown["ResourceSaturation"] == -3 * 8600
    cool = WorkerView(cpu_usage_pct=10, ram_free_mb=12000, ram_total_mb=16000, build_peak_ram_mb=4000)
    assert score(c(), cool, P, RESOURCE_AWARE).breakdown["ResourceSaturation"] == 0


def test_the_saturation_signals_are_said_in_words_and_two_hold_back_even_a_prioritized_job() -> None:
    hot = WorkerView(cpu_usage_pct=95, ram_free_mb=500, ram_total_mb=16000, build_peak_ram_mb=4000)
    assert saturation_signals(hot) == ("CPU > 80 %", "free RAM < 10 %", "free RAM below their builds' peak")
    assert saturation_signals(WorkerView(cpu_usage_pct=80)) == ()
    assert not saturation_holds_back(0)
    assert saturation_holds_back(1) and not saturation_holds_back(1, prioritized=True)
    assert saturation_holds_back(2, prioritized=True)
    # what holds back is what the floor refuses: the best possible score of an unprioritized job
    best = c(waited_secs=1e9)
    assert not score(best, WorkerView(cpu_usage_pct=95), P).eligible


def test_metrics_older_than_sixty_seconds_are_stale() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert not metrics_stale(now - timedelta(seconds=60), now)
    assert metrics_stale(now - timedelta(seconds=61), now)
    assert not metrics_stale(None, now)  # nothing to judge: a session's metrics come with their time


def test_workers_without_metrics_get_unknown_values_not_penalties() -> None:
    assert score(c(), WorkerView(), P).breakdown["ResourceSaturation"] == 0


def test_the_simple_policy_has_no_resource_saturation_rule() -> None:
    hot = WorkerView(cpu_usage_pct=95)
    assert "ResourceSaturation" not in score(c(), hot, P, SIMPLE).breakdown


def test_an_unknown_policy_falls_back_to_resource_aware() -> None:
    assert policy_name("nonsense") == RESOURCE_AWARE
    assert "ResourceSaturation" in score(c(), W, P, "nonsense").breakdown


def test_nothing_below_the_floor_is_handed_out() -> None:
    hot = WorkerView(cpu_usage_pct=99)
    assert rank([c()], hot, P) == []


def test_ties_go_to_the_smaller_job_id() -> None:
    ranked = rank([c("build:b"), c("build:a"), c("build:c")], W, P)
    assert [s.job_id for s in ranked] == ["build:a", "build:b", "build:c"]


candidates = st.builds(
    Candidate,
    job_id=st.text(alphabet="abcdef0123456789", min_size=1, max_size=8).map(lambda s: f"build:{s}"),
    kind=st.sampled_from(["eval", "build"]),
    waited_secs=st.floats(0, 100_000),
    prioritized=st.booleans(),
    has_fetch_step=st.booleans(),
    missing_nar_size=st.none() | st.integers(0, 10**12),
    offered_passes_ago=st.none() | st.integers(0, 10),
    history_secs=st.none() | st.floats(0, 10**6),
)
workers = st.builds(
    WorkerView,
    can_fetch=st.booleans(),
    cpu_core_score=st.none() | st.integers(1, 5000),
    cpu_usage_pct=st.none() | st.floats(0, 100),
    ram_free_mb=st.none() | st.integers(0, 64000),
    ram_total_mb=st.none() | st.integers(1, 64000),
    build_peak_ram_mb=st.none() | st.integers(0, 64000),
    download_speed_mbps=st.none() | st.floats(0.1, 10_000),
    large_transfers_running=st.integers(0, 4),
)


@given(st.lists(candidates, max_size=30, unique_by=lambda x: x.job_id), workers)
def test_the_ranking_is_sorted_eligible_and_deterministic(cs: list[Candidate], w: WorkerView) -> None:
    ranked = rank(cs, w, P)
    assert ranked == rank(list(reversed(cs)), w, P)
    assert all(s.eligible for s in ranked)
    keys = [(-s.total, s.job_id) for s in ranked]
    assert keys == sorted(keys)
    assert {s.job_id for s in ranked} <= {x.job_id for x in cs}


@given(candidates, workers)
def test_the_total_is_the_sum_of_the_breakdown(cand: Candidate, w: WorkerView) -> None:
    s = score(cand, w, P)
    assert s.total == pytest.approx(sum(s.breakdown.values()))
