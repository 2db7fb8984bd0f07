"""Settlement: the verdict order, how members settle under each verdict, and startup recovery."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradient.clusters.decisions.settlement import (
    AttemptClose,
    AttemptFacts,
    ClusterChange,
    MemberOutcome,
    MemberResult,
    MemberSettlement,
    OpenAttempt,
    RecoveringCluster,
    Verdict,
    attempt_outcome,
    classify_failure,
    cluster_status,
    recover_clusters,
    resolve,
    settle_member,
    verdict,
)
from gradient.clusters.decisions.types import (
    REQUEUEING_FAILURE_KINDS,
    AttemptOutcome,
    ClusterStatus,
    FailureKind,
)

RUNNING = MemberOutcome.RUNNING
SUCCEEDED = MemberOutcome.SUCCEEDED
FAILED = MemberOutcome.FAILED
LOST = MemberOutcome.LOST
EVAL_ABORTED = MemberOutcome.EVALUATION_ABORTED


def member(
    role: str,
    outcome: MemberOutcome = RUNNING,
    *,
    primary: bool = False,
    kind: FailureKind | None = None,
    error: str = "",
    can_start: bool = True,
) -> MemberResult:
    if outcome == FAILED and kind is None:
        kind = FailureKind.PERMANENT
    return MemberResult(role, 0, f"build:{role}", primary, outcome, kind, error, can_start)


def facts(*members: MemberResult, attempts: int = 1, budget: int = 2, abort: bool = False) -> AttemptFacts:
    return AttemptFacts(tuple(members), attempts, budget, abort)


def settled(
    v: Verdict, *members: MemberResult
) -> dict[str, tuple[MemberSettlement, FailureKind | None, bool]]:
    return {
        m.role: (d.settlement, d.failure_kind, d.abort_running)
        for m in members
        for d in [settle_member(v, m)]
    }


# Complete if the primary succeeded or every member succeeded.


def test_the_primary_succeeding_completes_the_cluster() -> None:
    assert verdict(facts(member("p", SUCCEEDED, primary=True), member("c"))) == Verdict.COMPLETE


def test_every_member_succeeding_completes_a_cluster_without_a_primary() -> None:
    assert verdict(facts(member("a", SUCCEEDED), member("b", SUCCEEDED))) == Verdict.COMPLETE


def test_a_non_primary_success_alone_decides_nothing() -> None:
    assert verdict(facts(member("p", primary=True), member("c", SUCCEEDED))) is None


def test_complete_wins_over_a_failure_and_an_abort_when_the_primary_succeeded() -> None:
    f = facts(
        member("p", SUCCEEDED, primary=True),
        member("x", FAILED),
        member("y", EVAL_ABORTED),
        budget=5,
        abort=True,
    )

    assert verdict(f) == Verdict.COMPLETE


# Otherwise Abort if any member was aborted by an evaluation abort.


def test_an_evaluation_abort_reaching_a_member_aborts_the_cluster() -> None:
    assert verdict(facts(member("a", EVAL_ABORTED), member("b", FAILED), budget=5)) == Verdict.ABORT


def test_the_clusters_abort_intent_aborts_it() -> None:
    assert verdict(facts(member("a"), member("b"), abort=True)) == Verdict.ABORT


def test_an_aborted_job_failure_is_an_evaluation_abort_only_when_an_evaluation_abort_caused_it() -> None:
    assert classify_failure(FailureKind.ABORTED, evaluation_aborted=True) == EVAL_ABORTED
    assert classify_failure(FailureKind.ABORTED, evaluation_aborted=False) == FAILED
    assert classify_failure(FailureKind.TRANSIENT, evaluation_aborted=True) == FAILED


# Otherwise Retry if a member failed or was lost and budget is left and every member can still start.


def test_a_failed_member_with_budget_left_retries() -> None:
    assert verdict(facts(member("a", FAILED), member("b"), attempts=1, budget=2)) == Verdict.RETRY


def test_a_member_lost_with_its_worker_with_budget_left_retries() -> None:
    assert verdict(facts(member("a", LOST), member("b"), attempts=1, budget=2)) == Verdict.RETRY


def test_a_member_whose_worker_stopped_counts_as_lost() -> None:
    stopped = member("a", FAILED, kind=FailureKind.CANCELED)

    assert stopped.effective_outcome == LOST
    assert classify_failure(FailureKind.CANCELED, evaluation_aborted=False) == LOST


@pytest.mark.parametrize("budget", [0, 1])
def test_a_retry_budget_of_0_or_1_allows_one_started_attempt(budget: int) -> None:
    assert verdict(facts(member("a", FAILED), attempts=1, budget=budget)) == Verdict.FAIL


def test_a_retry_budget_of_2_allows_a_first_attempt_and_one_retry() -> None:
    assert verdict(facts(member("a", FAILED), attempts=1, budget=2)) == Verdict.RETRY
    assert verdict(facts(member("a", FAILED), attempts=2, budget=2)) == Verdict.FAIL


# Otherwise Fail: same as Retry without budget, or a member can no longer start.


def test_a_member_that_can_no_longer_start_turns_a_retry_into_a_fail() -> None:
    f = facts(member("a", FAILED), member("b", can_start=False), attempts=1, budget=5)

    assert verdict(f) == Verdict.FAIL


# Attempt outcome and cluster status per verdict.


@pytest.mark.parametrize(
    ("v", "attempt", "cluster"),
    [
        (Verdict.COMPLETE, AttemptOutcome.SUCCEEDED, ClusterStatus.COMPLETED),
        (Verdict.RETRY, AttemptOutcome.FAILED, ClusterStatus.QUEUED),
        (Verdict.FAIL, AttemptOutcome.FAILED, ClusterStatus.FAILED),
        (Verdict.ABORT, AttemptOutcome.ABORTED, ClusterStatus.ABORTED),
    ],
)
def test_the_attempt_outcome_and_cluster_status_follow_the_verdict(
    v: Verdict, attempt: AttemptOutcome, cluster: ClusterStatus
) -> None:
    assert (attempt_outcome(v), cluster_status(v)) == (attempt, cluster)


# Members, per verdict.


def test_under_complete_reported_members_settle_and_still_running_ones_end_aborted() -> None:
    members = (
        member("p", SUCCEEDED, primary=True),
        member("ok", SUCCEEDED),
        member("bad", FAILED, kind=FailureKind.TIMEOUT),
        member("busy"),
    )

    assert settled(Verdict.COMPLETE, *members) == {
        "p": (MemberSettlement.COMPLETED, None, False),
        "ok": (MemberSettlement.COMPLETED, None, False),
        "bad": (MemberSettlement.FAILED, FailureKind.TIMEOUT, False),
        "busy": (MemberSettlement.ABORTED, None, True),
    }


def test_under_retry_every_member_job_goes_back_to_the_assignment_passes() -> None:
    members = (member("ok", SUCCEEDED), member("bad", FAILED), member("lost", LOST), member("busy"))

    assert settled(Verdict.RETRY, *members) == {
        "ok": (MemberSettlement.REQUEUED, None, False),
        "bad": (MemberSettlement.REQUEUED, None, False),
        "lost": (MemberSettlement.REQUEUED, None, False),
        "busy": (MemberSettlement.REQUEUED, None, True),
    }


def test_under_fail_members_settle_with_their_own_outcome_and_survivors_end_aborted() -> None:
    members = (
        member("ok", SUCCEEDED),
        member("bad", FAILED, kind=FailureKind.TIMEOUT),
        member("lost", LOST),
        member("busy"),
    )

    assert settled(Verdict.FAIL, *members) == {
        "ok": (MemberSettlement.COMPLETED, None, False),
        "bad": (MemberSettlement.FAILED, FailureKind.TIMEOUT, False),
        "lost": (MemberSettlement.FAILED, FailureKind.PERMANENT, False),
        "busy": (MemberSettlement.ABORTED, None, True),
    }


@pytest.mark.parametrize("kind", sorted(REQUEUEING_FAILURE_KINDS))
def test_under_fail_requeueing_failure_kinds_become_permanent(kind: FailureKind) -> None:
    d = settle_member(Verdict.FAIL, member("bad", FAILED, kind=kind, error="cache down"))

    assert (d.settlement, d.failure_kind) == (MemberSettlement.FAILED, FailureKind.PERMANENT)
    assert d.error.startswith("cache down")


def test_under_abort_survivors_end_aborted() -> None:
    members = (member("ok", SUCCEEDED), member("victim", EVAL_ABORTED), member("busy"), member("lost", LOST))

    assert settled(Verdict.ABORT, *members) == {
        "ok": (MemberSettlement.COMPLETED, None, False),
        "victim": (MemberSettlement.ABORTED, None, False),
        "busy": (MemberSettlement.ABORTED, None, True),
        "lost": (MemberSettlement.ABORTED, None, False),
    }


def test_the_resolution_settles_every_member_once_by_the_verdict() -> None:
    f = facts(member("a", FAILED), member("b"), member("c", SUCCEEDED), attempts=1, budget=2)

    r = resolve(f)

    assert r is not None
    assert (r.verdict, r.attempt_outcome, r.cluster_status) == (
        Verdict.RETRY,
        AttemptOutcome.FAILED,
        ClusterStatus.QUEUED,
    )
    assert [(d.address.role, d.settlement) for d in r.members] == [
        ("a", MemberSettlement.REQUEUED),
        ("b", MemberSettlement.REQUEUED),
        ("c", MemberSettlement.REQUEUED),
    ]


def test_an_undecided_attempt_has_no_resolution() -> None:
    assert resolve(facts(member("a", SUCCEEDED), member("b"))) is None


# Reports arriving during the resolution of the attempt settle by the decided verdict.


def test_a_report_arriving_during_the_resolution_settles_by_the_decided_verdict() -> None:
    # The first deciding report: a failure with budget left. The cluster retries.
    decided = verdict(facts(member("a", FAILED), member("b"), attempts=1, budget=2))
    assert decided == Verdict.RETRY

    # b then completes while the verdict is applied: it requeues with the rest, not completes.
    late = settle_member(decided, member("b", SUCCEEDED))

    assert late.settlement == MemberSettlement.REQUEUED and not late.abort_running


def test_a_late_failure_under_complete_never_requeues_its_job() -> None:
    late = settle_member(Verdict.COMPLETE, member("c", FAILED, kind=FailureKind.TRANSIENT))

    assert (late.settlement, late.failure_kind) == (MemberSettlement.FAILED, FailureKind.PERMANENT)


# Startup recovery, in the reference notes' order.


def recovering(
    cid: str,
    status: ClusterStatus,
    *,
    attempts: int = 1,
    budget: int = 2,
    dead: bool = False,
    open_attempt: OpenAttempt | None = None,
) -> RecoveringCluster:
    return RecoveringCluster(cid, status, attempts, budget, dead, open_attempt)


def test_recovery_closes_unstarted_open_attempts_prepare_failed() -> None:
    plan = recover_clusters(
        [recovering("c", ClusterStatus.QUEUED, attempts=0, open_attempt=OpenAttempt("a1", False))]
    )

    assert plan.closes == (
        AttemptClose("a1", "c", AttemptOutcome.PREPARE_FAILED, "server restarted during the prepare"),
    )
    assert plan.changes == ()


def test_recovery_closes_started_open_attempts_aborted() -> None:
    plan = recover_clusters([recovering("c", ClusterStatus.RUNNING, open_attempt=OpenAttempt("a1", True))])

    assert [(c.attempt_id, c.outcome) for c in plan.closes] == [("a1", AttemptOutcome.ABORTED)]


def test_recovery_closes_unstarted_attempts_before_started_ones() -> None:
    plan = recover_clusters(
        [
            recovering("a", ClusterStatus.RUNNING, open_attempt=OpenAttempt("started", True)),
            recovering("b", ClusterStatus.QUEUED, open_attempt=OpenAttempt("unstarted", False)),
        ]
    )

    assert [c.attempt_id for c in plan.closes] == ["unstarted", "started"]


def test_recovery_aborts_running_clusters_with_a_dead_member() -> None:
    plan = recover_clusters([recovering("c", ClusterStatus.RUNNING, dead=True)])

    assert [(c.cluster_id, c.status_to, c.members) for c in plan.changes] == [
        ("c", ClusterStatus.ABORTED, MemberSettlement.ABORTED)
    ]


def test_recovery_fails_running_clusters_whose_budget_is_spent() -> None:
    plan = recover_clusters([recovering("c", ClusterStatus.RUNNING, attempts=2, budget=2)])

    assert [(c.cluster_id, c.status_to) for c in plan.changes] == [("c", ClusterStatus.FAILED)]


def test_recovery_requeues_the_remaining_running_clusters() -> None:
    plan = recover_clusters([recovering("c", ClusterStatus.RUNNING, attempts=1, budget=2)])

    assert plan.changes == (
        ClusterChange(
            "c",
            ClusterStatus.RUNNING,
            ClusterStatus.QUEUED,
            MemberSettlement.REQUEUED,
            "requeued after a server restart",
        ),
    )


def test_recovery_aborts_queued_clusters_with_a_dead_member() -> None:
    plan = recover_clusters([recovering("c", ClusterStatus.QUEUED, attempts=0, dead=True)])

    assert [(c.cluster_id, c.status_from, c.status_to) for c in plan.changes] == [
        ("c", ClusterStatus.QUEUED, ClusterStatus.ABORTED)
    ]


def test_recovery_steps_apply_in_order_and_each_cluster_changes_once() -> None:
    plan = recover_clusters(
        [
            recovering("queued-dead", ClusterStatus.QUEUED, attempts=0, dead=True),
            recovering("requeue", ClusterStatus.RUNNING, attempts=1, budget=3),
            recovering("spent", ClusterStatus.RUNNING, attempts=1, budget=1),
            # Dead and spent: the dead member decides first.
            recovering("dead-and-spent", ClusterStatus.RUNNING, attempts=2, budget=2, dead=True),
        ]
    )

    assert [(c.cluster_id, c.status_to) for c in plan.changes] == [
        ("dead-and-spent", ClusterStatus.ABORTED),
        ("spent", ClusterStatus.FAILED),
        ("requeue", ClusterStatus.QUEUED),
        ("queued-dead", ClusterStatus.ABORTED),
    ]


def test_recovery_leaves_healthy_queued_and_finished_clusters_alone() -> None:
    plan = recover_clusters(
        [
            recovering("q", ClusterStatus.QUEUED, attempts=0),
            recovering("done", ClusterStatus.COMPLETED, dead=True),
            recovering("failed", ClusterStatus.FAILED, dead=True),
        ]
    )

    assert plan == recover_clusters([])


# Properties.

OUTCOMES = st.sampled_from(list(MemberOutcome))
KINDS = st.sampled_from(list(FailureKind))


@st.composite
def attempt_facts(draw: st.DrawFn) -> AttemptFacts:
    n = draw(st.integers(1, 5))
    primary = draw(st.integers(-1, n - 1))
    members = tuple(
        MemberResult(
            role="m",
            index=i,
            job_key=f"build:{i}",
            primary=i == primary,
            outcome=(o := draw(OUTCOMES)),
            failure_kind=draw(KINDS) if o == FAILED else None,
            can_start=draw(st.integers(0, 4)) > 0,
        )
        for i in range(n)
    )
    return AttemptFacts(members, draw(st.integers(1, 4)), draw(st.integers(0, 4)), draw(st.booleans()))


@settings(max_examples=500, deadline=None)
@given(attempt_facts())
def test_the_verdict_is_one_of_the_four_and_complete_wins_whenever_the_primary_succeeded(
    f: AttemptFacts,
) -> None:
    v = verdict(f)
    outcomes = {m.effective_outcome for m in f.members}
    primary_succeeded = any(m.primary and m.outcome == SUCCEEDED for m in f.members)
    # Only a success of a non-primary member, with others still running, decides nothing.
    deciding = (
        f.abort_requested or primary_succeeded or outcomes != {SUCCEEDED, RUNNING} and outcomes != {RUNNING}
    )

    if deciding:
        assert v in set(Verdict)
    else:
        assert v is None
    if primary_succeeded:
        assert v == Verdict.COMPLETE


@settings(max_examples=500, deadline=None)
@given(attempt_facts())
def test_a_member_requeues_only_under_retry_and_never_settles_with_a_requeueing_kind(f: AttemptFacts) -> None:
    r = resolve(f)
    if r is None:
        return
    assert len(r.members) == len(f.members)
    for d in r.members:
        assert (d.settlement == MemberSettlement.REQUEUED) == (r.verdict == Verdict.RETRY)
        assert d.failure_kind not in REQUEUEING_FAILURE_KINDS | {FailureKind.CANCELED}
