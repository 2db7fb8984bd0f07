"""What a failed build does next, read from its rows: scheduling.decisions.failures with what the pure
decision cannot see, namely how many times in a row the reporting worker canceled this build
(issue 34, item 9: a worker that keeps answering `canceled` for one build must not hold it forever).

lifecycle.fail_build calls `build_failure_decision` in place of `decide_build_failure` (the one call
this module exists for); it runs inside fail_build's transaction, with the build row locked and the
failed try already closed with its failure kind."""

from __future__ import annotations

import uuid
from datetime import datetime

from django.conf import settings

from gradient.core.vocab import FailureKind
from gradient.scheduling.decisions.failures import (
    BuildFailureDecision,
    cancels_in_a_row,
    decide_build_failure,
)
from gradient.scheduling.models import BuildAttempt, DerivationBuild, DispatchedJob

# How far back a run of cancels is looked for: a run longer than this is long enough to count anyway.
_TRIES_LOOKED_AT = 64


def worker_cancels_in_a_row(*, build_id: uuid.UUID, worker_id: uuid.UUID | None) -> int:
    """The tries of the build that `worker_id` ended `canceled` one after another, newest first until
    its latest try that ended otherwise (other workers' tries in between do not count; see
    decisions.failures.cancels_in_a_row)."""
    if worker_id is None:
        return 0
    # Newest first by start: a refunded try's number is given again to the next one.
    tries = BuildAttempt.objects.filter(build_id=build_id).order_by("-started_at", "-number")
    pairs = [
        (str(worker) if worker is not None else None, kind)
        for worker, kind in tries.values_list("worker_id", "failure_kind")[:_TRIES_LOOKED_AT]
    ]
    return cancels_in_a_row(pairs, str(worker_id))


def build_failure_decision(
    *, build: DerivationBuild, row: DispatchedJob, kind: str, now: datetime
) -> BuildFailureDecision:
    """decide_build_failure for the build of `row` (the assignment whose try just failed `kind`), with
    the reporting worker's cancels in a row counted from the build's tries and the free cancels of
    GRADIENT_BUILD_FREE_CANCELS."""
    # Only a cancel reads the tries: every other failure is decided as before, with no query more.
    in_a_row = (
        worker_cancels_in_a_row(build_id=build.id, worker_id=row.worker_id)
        if kind == FailureKind.CANCELED
        else 0
    )
    return decide_build_failure(
        kind=kind,
        attempts_spent=build.attempts,
        max_attempts=build.max_attempts,
        abort_requested=False,
        now=now,
        cancels_in_a_row=in_a_row,
        free_cancels=settings.GRADIENT_BUILD_FREE_CANCELS,
    )
