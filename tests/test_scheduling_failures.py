"""What a failed job does next, by failure kind and attempts spent (reference notes)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradient.scheduling.decisions.failures import (
    BuildVerdict,
    EvalVerdict,
    backoff,
    cancels_in_a_row,
    decide_build_failure,
    decide_eval_failure,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("kind", "spent", "verdict", "refund"),
    [
        ("transient", 1, BuildVerdict.RETRY, False),
        ("substitute_unavailable", 2, BuildVerdict.RETRY, False),
        ("inputs_unavailable", 1, BuildVerdict.RETRY, False),
        ("transient", 3, BuildVerdict.PERMANENT, False),
        ("permanent", 1, BuildVerdict.PERMANENT, False),
        ("timeout", 1, BuildVerdict.TIMEOUT, False),
        ("canceled", 3, BuildVerdict.REQUEUE, True),
        ("aborted", 1, BuildVerdict.REQUEUE, True),
    ],
)
def test_each_failure_kind_of_a_build_has_its_verdict(
    kind: str, spent: int, verdict: BuildVerdict, refund: bool
) -> None:
    decision = decide_build_failure(
        kind=kind, attempts_spent=spent, max_attempts=3, abort_requested=False, now=NOW
    )
    assert (decision.verdict, decision.refund_attempt) == (verdict, refund)


def test_an_abort_the_server_asked_for_ends_the_build_aborted() -> None:
    decision = decide_build_failure(
        kind="aborted", attempts_spent=1, max_attempts=3, abort_requested=True, now=NOW
    )
    assert decision.verdict is BuildVerdict.ABORTED


def test_the_backoff_starts_at_30_seconds_and_doubles() -> None:
    assert [backoff(n) for n in (1, 2, 3, 4)] == [timedelta(seconds=s) for s in (30, 60, 120, 240)]
    decision = decide_build_failure(
        kind="transient", attempts_spent=2, max_attempts=3, abort_requested=False, now=NOW
    )
    assert decision.retry_at == NOW + timedelta(seconds=60)


@pytest.mark.parametrize(
    ("in_a_row", "spent", "verdict", "retry_after"),
    [
        (1, 1, BuildVerdict.REQUEUE, None),  # a worker stopping: the first few cancels are free
        (3, 1, BuildVerdict.REQUEUE, None),
        (4, 1, BuildVerdict.RETRY, 30),  # past the free ones: a failed attempt, with its backoff
        (5, 2, BuildVerdict.RETRY, 60),
        (6, 3, BuildVerdict.PERMANENT, None),  # on the last attempt: it ends
    ],
)
def test_a_workers_cancels_of_one_build_in_a_row_past_the_free_ones_spend_attempts(
    in_a_row: int, spent: int, verdict: BuildVerdict, retry_after: int | None
) -> None:
    decision = decide_build_failure(
        kind="canceled",
        attempts_spent=spent,
        max_attempts=3,
        abort_requested=False,
        now=NOW,
        cancels_in_a_row=in_a_row,
        free_cancels=3,
    )
    assert decision.verdict is verdict
    assert decision.refund_attempt is (verdict is BuildVerdict.REQUEUE)
    assert decision.retry_at == (NOW + timedelta(seconds=retry_after) if retry_after else None)
    if verdict is not BuildVerdict.REQUEUE:
        assert f"canceled {in_a_row} times in a row by one worker" in decision.reason


def test_no_free_cancels_makes_the_first_cancel_a_failed_attempt() -> None:
    decision = decide_build_failure(
        kind="canceled",
        attempts_spent=1,
        max_attempts=3,
        abort_requested=False,
        now=NOW,
        cancels_in_a_row=1,
        free_cancels=0,
    )
    assert decision.verdict is BuildVerdict.RETRY


@pytest.mark.parametrize(
    ("tries", "count"),
    [
        ([], 0),
        ([("a", "canceled")], 1),
        ([("a", "canceled"), ("a", "canceled"), ("a", "canceled")], 3),
        # another worker's tries in between neither count nor break the run
        ([("a", "canceled"), ("b", "canceled"), ("b", "transient"), ("a", "canceled")], 2),
        # a try of this worker that ended otherwise ends the run (newest first)
        ([("a", "canceled"), ("a", "transient"), ("a", "canceled")], 1),
        ([("a", None), ("a", "canceled")], 0),  # declined or lost: no failure kind
        ([("b", "canceled"), (None, "canceled")], 0),
    ],
)
def test_cancels_in_a_row_counts_one_workers_latest_run(
    tries: list[tuple[str | None, str | None]], count: int
) -> None:
    assert cancels_in_a_row(tries, "a") == count


KINDS = st.sampled_from(["canceled", "transient", "permanent", "aborted", None])


@given(st.lists(st.tuples(st.sampled_from(["a", "b", None]), KINDS), max_size=20))
def test_cancels_in_a_row_is_the_length_of_the_workers_leading_canceled_tries(
    tries: list[tuple[str | None, str | None]],
) -> None:
    own = [kind for by, kind in tries if by == "a"]
    count = cancels_in_a_row(tries, "a")
    assert own[:count] == ["canceled"] * count
    assert count == len(own) or own[count] != "canceled"


@pytest.mark.parametrize(
    ("kind", "lost", "verdict"),
    [
        ("transient", 0, EvalVerdict.REQUEUE),
        ("permanent", 0, EvalVerdict.FAIL),
        ("timeout", 0, EvalVerdict.FAIL),
        ("lost", 9, EvalVerdict.REQUEUE),
        ("lost", 10, EvalVerdict.FAIL),
    ],
)
def test_an_evaluation_job_failure_requeues_or_fails(kind: str, lost: int, verdict: EvalVerdict) -> None:
    assert decide_eval_failure(kind=kind, lost_dispatches=lost) is verdict
