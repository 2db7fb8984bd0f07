"""What a failed job does next, by failure kind and attempts spent (reference notes: build maxAttempts 3
with 30 s doubling backoff; canceled requeues without spending an attempt, but only the first few times
one worker cancels one build in a row: a worker that keeps answering `canceled` would hold the build
forever, so its cancels past `free_cancels` are failed attempts, issue 34 item 9)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from gradient.core.vocab import REQUEUEING_FAILURE_KINDS, FailureKind

BACKOFF_BASE_SECS = 30.0
DEFAULT_MAX_ATTEMPTS = 3
MAX_LOST_EVAL_DISPATCHES = 10
DEFAULT_FREE_CANCELS = 3  # settings.GRADIENT_BUILD_FREE_CANCELS


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
    *,
    kind: str,
    attempts_spent: int,
    max_attempts: int,
    abort_requested: bool,
    now: datetime,
    cancels_in_a_row: int = 0,
    free_cancels: int = DEFAULT_FREE_CANCELS,
) -> BuildFailureDecision:
    """`attempts_spent` counts the attempt that just failed. `cancels_in_a_row`: the tries of this build
    that the same worker ended `canceled` one after another, the one that just failed included (see
    `cancels_in_a_row` below); past `free_cancels` of them a cancel spends its attempt like a transient
    failure (backoff, then FailedPermanent on the last attempt)."""
    if kind == FailureKind.CANCELED:
        if cancels_in_a_row <= free_cancels:
            return BuildFailureDecision(BuildVerdict.REQUEUE, refund_attempt=True, reason="worker stopping")
        repeated = f"canceled {cancels_in_a_row} times in a row by one worker"
        if attempts_spent < max_attempts:
            return BuildFailureDecision(
                BuildVerdict.RETRY,
                retry_at=now + backoff(attempts_spent),
                reason=f"{repeated}: counted as a failed attempt, will retry",
            )
        return BuildFailureDecision(
            BuildVerdict.PERMANENT, reason=f"{repeated}: failed on all {max_attempts} attempts"
        )
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


def cancels_in_a_row(tries: Sequence[tuple[str | None, str | None]], worker: str) -> int:
    """How many of `worker`'s latest tries of one build ended `canceled` one after another: `tries` are
    (worker, failure kind) pairs, newest first. Another worker's tries in between neither count nor break
    the run (a fleet that restarts worker by worker cancels each try once); a try of this worker that
    ended any other way (or still runs) does."""
    count = 0
    for by, kind in tries:
        if by != worker:
            continue
        if kind != FailureKind.CANCELED:
            break
        count += 1
    return count


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
