"""What a failed job does next, by failure kind and attempts spent (reference notes)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gradient.scheduling.decisions.failures import (
    BuildVerdict,
    EvalVerdict,
    backoff,
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
