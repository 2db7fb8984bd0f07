"""decisions.eta: a waiting job's typical duration, its expected start and end, and a Building
evaluation's expected finish, as plain arithmetic."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gradient.scheduling.decisions import eta

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def test_median_of_odd_and_even_samples_and_of_none() -> None:
    assert eta.median([30.0, 10.0, 20.0]) == 20.0
    assert eta.median([10.0, 40.0, 20.0, 30.0]) == 25.0
    assert eta.median([]) is None


def test_the_typical_duration_rests_on_the_derivation_then_the_project_then_the_default() -> None:
    got = eta.typical_duration([100.0, 300.0, 200.0], [5.0], 600.0)
    assert got == eta.Typical(200.0, "derivation", 100.0, 300.0)
    assert eta.typical_duration([], [5.0, 7.0], 600.0) == eta.Typical(6.0, "project", 5.0, 7.0)
    assert eta.typical_duration([], [], 600.0) == eta.Typical(600.0, "default")


def test_without_history_and_without_a_default_the_start_is_unknown() -> None:
    typical = eta.typical_duration([], [], 0.0)
    assert typical.basis == "none"
    got = eta.queue_estimate(now=NOW, ahead=0, slots=4, busy=0, typical=typical)
    assert got == eta.NO_ESTIMATE and got.expected_start is None and got.expected_finish is None


def test_the_range_is_the_same_arithmetic_over_the_samples_spread() -> None:
    samples = [float(s) for s in range(10, 110, 10)]  # 10..100 s: p10 10, median 55, p90 90
    typical = eta.typical_duration(samples, [], 600.0)
    assert (typical.low, typical.secs, typical.high) == (10.0, 55.0, 90.0)
    got = eta.queue_estimate(now=NOW, ahead=1, slots=1, busy=1, typical=typical)
    assert got.earliest_start == NOW + timedelta(seconds=15)  # 1.5 x 10 s
    assert got.expected_start == NOW + timedelta(seconds=82.5)
    assert got.latest_start == NOW + timedelta(seconds=135)
    default = eta.queue_estimate(now=NOW, ahead=1, slots=1, busy=1, typical=eta.Typical(100.0, "default"))
    assert default.earliest_start == default.expected_start == default.latest_start


def test_a_job_starts_now_while_a_free_slot_is_left_for_it() -> None:
    assert eta.start_delay_secs(ahead=0, slots=2, busy=1, typical_secs=100.0) == 0.0
    assert eta.start_delay_secs(ahead=2, slots=4, busy=1, typical_secs=100.0) == 0.0


def test_busy_slots_are_halfway_through_and_the_slots_turn_over_as_a_pool() -> None:
    delay = eta.start_delay_secs
    assert delay(ahead=0, slots=1, busy=1, typical_secs=100.0) == 50.0
    assert delay(ahead=1, slots=1, busy=1, typical_secs=100.0) == 150.0
    # Two busy slots halfway through: they free every 50 s on average.
    assert delay(ahead=1, slots=2, busy=2, typical_secs=100.0) == 75.0
    assert delay(ahead=2, slots=2, busy=2, typical_secs=100.0) == 125.0
    assert delay(ahead=3, slots=1, busy=0, typical_secs=100.0) == 250.0
    assert delay(ahead=1000, slots=20, busy=20, typical_secs=1.0) == pytest.approx(50.025)


def test_the_jobs_ahead_last_their_mean_and_the_job_its_own_typical_time() -> None:
    own = eta.Typical(10.0, "derivation")
    pool = eta.Typical(200.0, "project", 100.0, 300.0)
    got = eta.queue_estimate(now=NOW, ahead=3, slots=2, busy=2, typical=own, ahead_typical=pool)
    assert got.expected_start == NOW + timedelta(seconds=350)  # 200 x 3.5 / 2
    assert got.expected_finish == NOW + timedelta(seconds=360)  # then its own 10 s
    assert (got.earliest_start, got.latest_start) == (
        NOW + timedelta(seconds=175),
        NOW + timedelta(seconds=525),
    )
    assert got.basis == "derivation"


def test_no_slot_means_no_estimate() -> None:
    typical = eta.Typical(100.0, "derivation")
    assert eta.queue_estimate(now=NOW, ahead=0, slots=0, busy=0, typical=typical) == eta.NO_ESTIMATE


def test_the_expected_finish_is_one_typical_duration_after_the_start() -> None:
    got = eta.queue_estimate(now=NOW, ahead=1, slots=1, busy=1, typical=eta.Typical(100.0, "project"))
    assert (got.expected_start, got.expected_finish, got.basis) == (
        NOW + timedelta(seconds=150),
        NOW + timedelta(seconds=250),
        "project",
    )


def test_the_longest_chain_counts_builds_on_the_critical_path() -> None:
    edges = [("b", "a"), ("c", "a"), ("d", "b"), ("d", "c"), ("e", "z")]  # z is not remaining
    assert eta.longest_chain(edges, ["a", "b", "c", "d", "e"]) == 3
    assert eta.longest_chain([], []) == 0
    assert eta.longest_chain([("a", "b"), ("b", "a")], ["a", "b"]) == 2  # a cycle ends


def test_an_evaluation_finishes_after_its_critical_path_or_its_work_over_the_slots() -> None:
    finish = eta.evaluation_finish
    assert finish(now=NOW, remaining=10, chain=3, slots=2, typical_secs=60.0) == NOW + timedelta(minutes=5)
    assert finish(now=NOW, remaining=4, chain=3, slots=8, typical_secs=60.0) == NOW + timedelta(minutes=3)
    assert finish(now=NOW, remaining=0, chain=0, slots=0, typical_secs=60.0) == NOW
    assert finish(now=NOW, remaining=3, chain=1, slots=0, typical_secs=60.0) is None


def test_a_slot_turns_over_at_the_mean_duration_plus_the_hand_out_gap() -> None:
    # Worker a: 0-10, 11-21 (gap 1 s), then idle for a minute: 81-91 (not a hand-out gap). Worker b:
    # 0-20, 23-33 (gap 3 s).
    tries = [("a", 0.0, 10.0), ("a", 11.0, 21.0), ("a", 81.0, 91.0), ("b", 0.0, 20.0), ("b", 23.0, 33.0)]
    got = eta.slot_turnover(tries, "project")
    assert got is not None and got.basis == "project"
    assert got.secs == pytest.approx(12.0 + 2.0)  # mean duration 12 s, mean gap 2 s
    assert (got.low, got.high) == (12.0, 22.0)  # p10 and p90 of the durations, plus the gap
    assert eta.slot_turnover([("a", 0.0, 5.0)], "project") == eta.Typical(5.0, "project", 5.0, 5.0)
    assert eta.slot_turnover([], "project") is None


def test_tries_without_a_worker_count_in_the_duration_but_make_no_hand_out_gap() -> None:
    # Two tries whose workers are gone (BuildAttempt.worker is SET_NULL), 1 s apart: no worker ran both,
    # so the second second between them is no hand-out; beside them worker a's real 1 s gap counts.
    gone = [(None, 0.0, 2.0), (None, 3.0, 5.0)]
    assert eta.slot_turnover(gone, "project") == eta.Typical(2.0, "project", 2.0, 2.0)
    got = eta.slot_turnover([*gone, ("a", 10.0, 12.0), ("a", 13.0, 15.0)], "project")
    assert got is not None and got.secs == pytest.approx(2.0 + 1.0)
