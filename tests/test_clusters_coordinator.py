"""The attempt coordinator: claim, prepare, start, prepare failures, backoff and signal routing."""

from __future__ import annotations

from datetime import timedelta
from typing import TypeVar

from hypothesis import given, settings
from hypothesis import strategies as st

from gradient.clusters.decisions.coordinator import (
    AttemptEvent,
    AttemptPhase,
    AttemptState,
    ClaimCluster,
    ClaimLost,
    ClaimWon,
    ClosePrepareFailed,
    ClusterMembership,
    ClusterPeer,
    CoordinatorPolicy,
    HeldMemberFailed,
    MemberAccepted,
    MemberRejected,
    ParkCluster,
    PenaliseWorker,
    PrepareTimedOut,
    ScheduleRetry,
    SendAbortCluster,
    SendAssignJob,
    SendStartCluster,
    StartAttempt,
    begin_attempt,
    hold_secs,
    is_overdue,
    prepare_retry_delay,
    route_signal,
    step,
)
from gradient.clusters.decisions.types import MemberAddress, Placement, Seat, SlotKind
from tests.support.clusters import NOW, later

POLICY = CoordinatorPolicy()
TIMEOUT = POLICY.prepare_timeout_secs


def placement(cid: str = "c1") -> Placement:
    return Placement(
        cluster_id=cid,
        seats=(
            Seat("server", 0, "build:s", SlotKind.BUILD, "w1", "a", "10.0.0.1:7000"),
            Seat("client", 0, "build:c0", SlotKind.BUILD, "w2", "a", None),
            Seat("client", 1, "eval:c1", SlotKind.EVAL, "w3", "a", None),
        ),
        cost=0,
        zone="a",
    )


def claimed(prepare_failures: int = 0, cid: str = "c1") -> AttemptState:
    state, _ = begin_attempt(placement(cid), attempt_id="att", now=NOW, prepare_failures=prepare_failures)
    state, _ = step(state, ClaimWon(), NOW)
    return state


def started() -> AttemptState:
    state = claimed()
    for m in state.members:
        state, _ = step(state, MemberAccepted(m.job_key, m.worker_id), NOW)
    assert state.phase == AttemptPhase.STARTED
    return state


T = TypeVar("T")


def of_type(actions: tuple[object, ...], kind: type[T]) -> list[T]:
    return [a for a in actions if isinstance(a, kind)]


# 1. The scheduler takes the cluster and its seats in one step; 2. claim_cluster writes the attempt.


def test_an_attempt_begins_with_the_claim_of_the_cluster_and_its_seats() -> None:
    state, actions = begin_attempt(placement(), attempt_id="att", now=NOW)

    assert state.phase == AttemptPhase.CLAIMING
    assert actions == (ClaimCluster("att", "c1", placement(), NOW, later(TIMEOUT)),)


# 3. The session of each seat sends AssignJob with cluster (attempt, role, index, hold_secs).


def test_a_won_claim_sends_every_seat_assign_job_with_its_cluster_membership() -> None:
    state, _ = begin_attempt(placement(), attempt_id="att", now=NOW)

    state, actions = step(state, ClaimWon(), NOW)

    hold = hold_secs()
    assert state.phase == AttemptPhase.PREPARING
    assert actions == (
        SendAssignJob("w1", "build:s", ClusterMembership("att", "server", 0, hold)),
        SendAssignJob("w2", "build:c0", ClusterMembership("att", "client", 0, hold)),
        SendAssignJob("w3", "eval:c1", ClusterMembership("att", "client", 1, hold)),
    )


def test_hold_secs_is_the_prepare_timeout_plus_10_seconds() -> None:
    assert hold_secs() == 40
    assert hold_secs(CoordinatorPolicy(prepare_timeout_secs=45)) == 55


# The claim is lost: nothing written; the members go back to the assignment passes.


def test_a_lost_claim_writes_nothing() -> None:
    state, _ = begin_attempt(placement(), attempt_id="att", now=NOW)

    state, actions = step(state, ClaimLost(), NOW)

    assert actions == ()
    assert state.phase == AttemptPhase.CLOSED


# 4. start_cluster_attempt once every member accepted; all members then receive StartCluster with the
# roster.


def test_an_acceptance_before_the_last_starts_nothing() -> None:
    state = claimed()

    state, actions = step(state, MemberAccepted("build:s", "w1"), NOW)

    assert actions == ()
    assert state.phase == AttemptPhase.PREPARING


def test_the_last_acceptance_starts_the_attempt_and_sends_start_cluster_with_the_roster_to_all() -> None:
    state = claimed()
    state, _ = step(state, MemberAccepted("eval:c1", "w3"), NOW)
    state, _ = step(state, MemberAccepted("build:s", "w1"), NOW)

    state, actions = step(state, MemberAccepted("build:c0", "w2"), later(3))

    roster = (
        ClusterPeer("client", 0, "w2", "a", None),
        ClusterPeer("client", 1, "w3", "a", None),
        ClusterPeer("server", 0, "w1", "a", "10.0.0.1:7000"),
    )
    assert actions == (
        StartAttempt("att", "c1", later(3)),
        SendStartCluster(("w1", "w2", "w3"), "att", roster),
    )
    assert (state.phase, state.started_at) == (AttemptPhase.STARTED, later(3))


def test_a_repeated_acceptance_starts_the_attempt_once() -> None:
    state = started()

    assert step(state, MemberAccepted("build:s", "w1"), NOW) == (state, ())


# A member rejected: attempt closed PrepareFailed, AbortCluster to every member, waiting again after 30 s.


def test_a_reject_closes_the_attempt_prepare_failed_and_aborts_every_member() -> None:
    state = claimed()

    state, actions = step(state, MemberRejected("build:c0", "w2", "full"), later(2))

    reason = "client[0] on w2 rejected the prepare: full"
    assert state.phase == AttemptPhase.CLOSED
    assert actions[:2] == (
        ClosePrepareFailed("att", "c1", reason),
        SendAbortCluster(("w1", "w2", "w3"), "att", reason),
    )


def test_a_failed_prepare_waits_at_least_30_seconds_before_the_next_try() -> None:
    _, actions = step(claimed(), MemberRejected("build:c0", "w2"), NOW)

    (retry,) = of_type(actions, ScheduleRetry)
    assert isinstance(retry, ScheduleRetry)
    wait = (retry.retry_at - NOW).total_seconds()
    assert POLICY.retry_wait_secs <= wait <= POLICY.retry_wait_secs * (1 + POLICY.jitter)
    assert retry.prepare_failures == 1


# scheduler.clusterPrepareTimeoutSecs passed without every acceptance: same as a reject.


def test_the_prepare_timeout_fails_the_prepare_like_a_reject() -> None:
    state = claimed()
    state, _ = step(state, MemberAccepted("build:s", "w1"), NOW)

    state, actions = step(state, PrepareTimedOut(), later(TIMEOUT))

    reason = "prepare timed out after 30 s waiting for client[0], client[1]"
    assert state.phase == AttemptPhase.CLOSED
    assert actions[:2] == (
        ClosePrepareFailed("att", "c1", reason),
        SendAbortCluster(("w1", "w2", "w3"), "att", reason),
    )
    assert len(of_type(actions, ScheduleRetry)) == 1


def test_a_prepare_timer_before_the_deadline_changes_nothing() -> None:
    state = claimed()

    assert step(state, PrepareTimedOut(), later(TIMEOUT - 1)) == (state, ())


def test_a_prepare_is_overdue_only_past_its_deadline_and_before_the_start() -> None:
    assert not is_overdue(claimed(), later(TIMEOUT - 1))
    assert is_overdue(claimed(), later(TIMEOUT))
    assert not is_overdue(started(), later(TIMEOUT))


# A held member reporting JobFailed before the start (hold expired, drain, AbortJob): same as a reject.


def test_a_held_members_job_failed_before_the_start_fails_the_prepare() -> None:
    state = claimed()

    state, actions = step(state, HeldMemberFailed("eval:c1", "w3", "worker draining"), NOW)

    assert state.phase == AttemptPhase.CLOSED
    assert of_type(actions, ClosePrepareFailed) == [
        ClosePrepareFailed("att", "c1", "client[1] on w3 failed before the start: worker draining")
    ]
    assert len(of_type(actions, SendAbortCluster)) == 1 and len(of_type(actions, ScheduleRetry)) == 1


def test_a_members_job_failed_after_the_start_is_left_to_settlement() -> None:
    state = started()

    assert step(state, HeldMemberFailed("eval:c1", "w3", "boom"), NOW) == (state, ())


# A failed prepare does not consume the cluster's retry budget.


def test_a_failed_prepare_spends_no_retry_budget() -> None:
    for event in (MemberRejected("build:s", "w1"), HeldMemberFailed("build:s", "w1"), PrepareTimedOut()):
        _, actions = step(claimed(), event, later(TIMEOUT))

        assert of_type(actions, StartAttempt) == []  # only a started attempt counts against the budget
        assert len(of_type(actions, ClosePrepareFailed)) == 1


# Beyond the anchors: exponential backoff with deterministic jitter; parking past a cap.


def test_repeated_prepare_failures_back_off_exponentially() -> None:
    delays = [prepare_retry_delay("c1", n) for n in range(1, 7)]

    for n, delay in enumerate(delays, start=1):
        base = min(POLICY.retry_wait_secs * 2 ** (n - 1), POLICY.max_retry_wait_secs)
        assert base <= delay <= base * (1 + POLICY.jitter)
    assert delays[0] < delays[1] < delays[2] < delays[3] < delays[4]


def test_the_backoff_jitter_is_deterministic_per_cluster_and_differs_between_clusters() -> None:
    assert prepare_retry_delay("c1", 3) == prepare_retry_delay("c1", 3)
    assert len({prepare_retry_delay(f"c{i}", 3) for i in range(20)}) > 1


def test_the_next_failure_counts_on_from_the_clusters_consecutive_failures() -> None:
    _, actions = step(claimed(prepare_failures=3), MemberRejected("build:s", "w1"), NOW)

    (retry,) = of_type(actions, ScheduleRetry)
    assert retry == ScheduleRetry("c1", NOW + timedelta(seconds=prepare_retry_delay("c1", 4)), 4)


def test_past_the_cap_the_cluster_parks_with_a_waiting_reason_instead_of_retrying() -> None:
    cap = POLICY.park_after_failures

    _, actions = step(claimed(prepare_failures=cap - 1), MemberRejected("build:s", "w1", "no"), NOW)

    assert of_type(actions, ScheduleRetry) == []
    (park,) = of_type(actions, ParkCluster)
    assert isinstance(park, ParkCluster)
    assert park.prepare_failures == cap
    assert park.waiting_reason.as_json() == {
        "code": "parked",
        "prepare_failures": cap,
        "detail": "server[0] on w1 rejected the prepare: no",
    }


# Beyond the anchors: workers that rejected a prepare or let a hold expire are down-ranked for a while.


def test_a_worker_that_rejects_a_prepare_is_penalised() -> None:
    _, actions = step(claimed(), MemberRejected("build:c0", "w2"), NOW)

    assert [(p.worker_id, p.at) for p in of_type(actions, PenaliseWorker)] == [("w2", NOW)]


def test_a_worker_that_lets_a_hold_expire_is_penalised_but_a_draining_one_is_not() -> None:
    _, expired = step(
        claimed(), HeldMemberFailed("build:c0", "w2", "cluster start timed out", hold_expired=True), NOW
    )
    _, drained = step(claimed(), HeldMemberFailed("build:c0", "w2", "worker draining"), NOW)

    assert [p.worker_id for p in of_type(expired, PenaliseWorker)] == ["w2"]
    assert of_type(drained, PenaliseWorker) == []


def test_the_workers_that_never_answered_before_the_timeout_are_penalised() -> None:
    state, _ = step(claimed(), MemberAccepted("build:s", "w1"), NOW)

    _, actions = step(state, PrepareTimedOut(), later(TIMEOUT))

    assert sorted(p.worker_id for p in of_type(actions, PenaliseWorker)) == ["w2", "w3"]


# Stale or foreign events change nothing; an attempt closes once.


def test_a_closed_attempt_ignores_every_later_event() -> None:
    closed, _ = step(claimed(), MemberRejected("build:s", "w1"), NOW)

    for event in (
        MemberRejected("build:c0", "w2"),
        PrepareTimedOut(),
        HeldMemberFailed("build:c0", "w2"),
        MemberAccepted("build:c0", "w2"),
        ClaimWon(),
    ):
        assert step(closed, event, later(TIMEOUT)) == (closed, ())


def test_a_report_from_a_worker_that_does_not_hold_the_seat_changes_nothing() -> None:
    state = claimed()

    assert step(state, MemberRejected("build:s", "w2"), NOW) == (state, ())
    assert step(state, MemberAccepted("build:s", "w9"), NOW) == (state, ())


# Signals: forwarded only within a started attempt and only from one of its members; `to` names one
# member by role and index; all other members receive the signal when `to` is absent.


def test_signals_are_dropped_before_the_attempt_started() -> None:
    assert route_signal(claimed(), "w1", None) is None


def test_signals_are_dropped_from_a_worker_that_is_not_a_member() -> None:
    assert route_signal(started(), "w9", None) is None


def test_signals_are_dropped_after_the_attempt_closed() -> None:
    closed, _ = step(claimed(), MemberRejected("build:s", "w1"), NOW)

    assert route_signal(closed, "w1", None) is None


def test_a_signal_without_to_reaches_every_other_member() -> None:
    route = route_signal(started(), "w1", None)

    assert route is not None
    assert (route.sender, route.recipients) == (MemberAddress("server", 0), ("w2", "w3"))


def test_a_signal_to_one_member_reaches_only_that_member() -> None:
    route = route_signal(started(), "w3", MemberAddress("server", 0))

    assert route is not None
    assert (route.sender, route.recipients) == (MemberAddress("client", 1), ("w1",))


def test_a_signal_to_an_unknown_member_reaches_nobody() -> None:
    route = route_signal(started(), "w1", MemberAddress("observer", 0))

    assert route is not None and route.recipients == ()


# Property: whatever the order of events, an attempt starts or closes at most once, never both, and
# starts only once every member accepted.

EVENTS = st.sampled_from(
    [
        MemberAccepted("build:s", "w1"),
        MemberAccepted("build:c0", "w2"),
        MemberAccepted("eval:c1", "w3"),
        MemberRejected("build:c0", "w2"),
        HeldMemberFailed("eval:c1", "w3", hold_expired=True),
        PrepareTimedOut(),
        MemberAccepted("build:s", "w9"),
    ]
)


SEATS = {(s.job_key, s.worker_id) for s in placement().seats}


@settings(max_examples=300, deadline=None)
@given(st.booleans(), st.lists(st.tuples(EVENTS, st.integers(0, 60)), max_size=12))
def test_an_attempt_starts_or_fails_its_prepare_at_most_once(
    won: bool, events: list[tuple[AttemptEvent, int]]
) -> None:
    state, _ = begin_attempt(placement(), attempt_id="att", now=NOW)
    state, actions = step(state, ClaimWon() if won else ClaimLost(), NOW)
    everything = list(actions)
    accepted: set[str] = set()
    for event, secs in events:
        state, actions = step(state, event, later(secs))
        everything.extend(actions)
        if isinstance(event, MemberAccepted) and of_type(actions, StartAttempt):
            assert accepted | {event.worker_id} == {"w1", "w2", "w3"}
        if isinstance(event, MemberAccepted) and (event.job_key, event.worker_id) in SEATS:
            accepted.add(event.worker_id)

    starts = of_type(tuple(everything), StartAttempt)
    closes = of_type(tuple(everything), ClosePrepareFailed)
    assert len(starts) + len(closes) <= 1
    if not won:
        assert everything == []
