"""What a failed job does next, by failure kind and attempts spent (reference notes: build maxAttempts 3
with 30 s doubling backoff; canceled requeues without spending an attempt)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from gradient.core.vocab import REQUEUEING_FAILURE_KINDS, FailureKind

BACKOFF_BASE_SECS = 30.0
DEFAULT_MAX_ATTEMPTS = 3
MAX_LOST_EVAL_DISPATCHES = 10


class BuildVerdict(StrEnum):
    RETRY = "retry"  # FailedTransient until retry_at, then Queued again; the attempt is spent
    REQUEUE = "requeue"  # straight back to Queued, the attempt is not spent
    PERMANENT = "permanent"  # FailedPermanent: a lasting failure
    TIMEOUT = "timeout"  # FailedTimeout: a lasting failure
    ABORTED = "aborted"  # Aborted: nobody wants it any more


@dataclass(frozen=True, slots=True)
class BuildFailureDecision:
    verdict: BuildVerdict
    retry_at: datetime | None = None
    refund_attempt: bool = False
    reason: str = ""


def backoff(attempts_spent: int, base_secs: float = BACKOFF_BASE_SECS) -> timedelta:
    """30 s after the first failed attempt, then 60 s, 120 s, ..."""
    return timedelta(seconds=base_secs * (2 ** max(0, attempts_spent - 1)))


def decide_build_failure(
    *, kind: str, attempts_spent: int, max_attempts: int, abort_requested: bool, now: datetime
) -> BuildFailureDecision:
    """`attempts_spent` counts the attempt that just failed."""
    if kind == FailureKind.CANCELED:
        return BuildFailureDecision(BuildVerdict.REQUEUE, refund_attempt=True, reason="worker stopping")
    if kind == FailureKind.ABORTED:
        if abort_requested:
            return BuildFailureDecision(BuildVerdict.ABORTED, reason="aborted")
        return BuildFailureDecision(BuildVerdict.REQUEUE, refund_attempt=True, reason="aborted by the worker")
    if kind == FailureKind.TIMEOUT:
        return BuildFailureDecision(BuildVerdict.TIMEOUT, reason="timed out")
    if kind in REQUEUEING_FAILURE_KINDS:
        if attempts_spent < max_attempts:
            return BuildFailureDecision(
                BuildVerdict.RETRY, retry_at=now + backoff(attempts_spent), reason=f"{kind}, will retry"
            )
        return BuildFailureDecision(
            BuildVerdict.PERMANENT, reason=f"{kind} failure on all {max_attempts} attempts"
        )
    return BuildFailureDecision(BuildVerdict.PERMANENT, reason="permanent failure")


class EvalVerdict(StrEnum):
    REQUEUE = "requeue"
    FAIL = "fail"


def decide_eval_failure(*, kind: str, lost_dispatches: int) -> EvalVerdict:
    """An evaluation job that failed: a permanent or timed-out evaluation fails the evaluation; anything
    that could work on another try goes back to the queue, until 10 dispatches were lost."""
    if kind in (FailureKind.PERMANENT, FailureKind.TIMEOUT):
        return EvalVerdict.FAIL
    if lost_dispatches >= MAX_LOST_EVAL_DISPATCHES:
        return EvalVerdict.FAIL
    return EvalVerdict.REQUEUE
