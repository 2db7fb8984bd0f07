"""Next: what should happen next for a job."""

from __future__ import annotations

import uuid
from datetime import timedelta

from hypothesis import given

from gradient.records.decisions.discovery import Discovery, ObservedObject
from gradient.records.decisions.fold import fold
from gradient.records.decisions.steps import (
    AbortObject,
    CommitOutcome,
    ExpireHold,
    Offer,
    RequeueObject,
    Resubmit,
    Settle,
    Wait,
    next_steps,
)
from gradient.records.schemas import (
    AssignmentClaimed,
    AssignmentClosed,
    AssignmentOutcome,
    CallDeadline,
    CallKind,
    Cancel,
    ClusterAttemptOpened,
    Hold,
    JobKind,
    ObjectRef,
    ObjectTable,
    Outcome,
    OutcomeCommitted,
    Requeue,
    Settled,
)
from gradient.records.schemas import (
    Resubmit as ResubmitIntent,
)
from tests.support.records import PLAN, T0, History, entries, histories, make_header

A1, A2, A3 = (uuid.UUID(int=n) for n in (1, 2, 3))
REF1 = ObjectRef(table=ObjectTable.DISPATCHED_JOB, id=A1)
NOTHING = Discovery(observed_at=T0)


def _claim(n: int, a: uuid.UUID) -> AssignmentClaimed:
    return AssignmentClaimed(submission=n, assignment_id=a, worker="w1", attempt=n)


def _next(*bodies, kind: JobKind = JobKind.EVALUATION, discovery: Discovery = NOTHING, now=T0):  # type: ignore[no-untyped-def]
    return next_steps(fold(make_header(kind), entries(*bodies), T0), discovery, now)


def test_a_queued_job_wants_an_offer_and_a_held_one_wants_nothing() -> None:
    assert _next() == [Offer()]
    assert _next((Hold(), "op")) == []


def test_a_running_job_needs_nothing() -> None:
    assert (
        _next(
            _claim(1, A1),
            discovery=Discovery(observed_at=T0, objects=(ObservedObject(object=REF1, open=True),)),
        )
        == []
    )


def test_a_cancelled_job_with_an_open_assignment_aborts_it() -> None:
    assert _next(_claim(1, A1), (Cancel(reason="stop"), "op")) == [
        AbortObject(object=REF1, reason="cancelled by op: stop")
    ]


def test_a_requeue_ends_the_current_submission() -> None:
    assert _next(_claim(1, A1), (Requeue(), "op")) == [RequeueObject(object=REF1)]


def test_an_unstarted_cluster_attempt_past_its_hold_deadline_expires() -> None:
    c1 = uuid.UUID(int=9)
    ref = ObjectRef(table=ObjectTable.CLUSTER_ATTEMPT, id=c1)
    deadline = T0 + timedelta(seconds=30)
    bodies = (
        ClusterAttemptOpened(submission=1, cluster_attempt_id=c1, attempt=1),
        CallDeadline(call=CallKind.HOLD, object=ref, deadline=deadline),
    )
    assert _next(*bodies, kind=JobKind.CLUSTER, now=deadline - timedelta(seconds=1)) == []
    assert _next(*bodies, kind=JobKind.CLUSTER, now=deadline) == [ExpireHold(object=ref, deadline=deadline)]


def test_an_evaluation_that_lost_every_dispatch_the_plan_allows_fails() -> None:
    lost = []
    for n, a in enumerate((A1, A2, A3), start=1):
        lost += [_claim(n, a), AssignmentClosed(assignment_id=a, outcome=AssignmentOutcome.ABANDONED)]
    (step,) = _next(*lost)
    assert isinstance(step, CommitOutcome) and step.outcome is Outcome.FAILED
    assert f"allows {PLAN.max_attempts}" in step.cause
    assert _next(*lost[:-2]) == [Offer()]


def test_a_finished_job_settles_once_nothing_is_left_and_then_needs_nothing() -> None:
    done = (
        _claim(1, A1),
        AssignmentClosed(assignment_id=A1, outcome=AssignmentOutcome.COMPLETED),
        OutcomeCommitted(outcome=Outcome.SUCCEEDED),
    )
    assert _next(*done) == [Settle()]
    assert _next(*done, Settled()) == []


def test_a_resubmit_follows_the_outcome_with_the_next_generation() -> None:
    header = make_header()
    job = fold(header, entries((Cancel(), "op"), (ResubmitIntent(), "op")), T0)
    assert next_steps(job, NOTHING, T0) == [Resubmit(supersedes=header.job_key, generation=2)]


def test_settling_waits_for_a_recorded_call_to_land_or_expire() -> None:
    ref = REF1
    deadline = T0 + timedelta(seconds=60)
    bodies = (
        _claim(1, A1),
        CallDeadline(call=CallKind.ABORT, object=ref, deadline=deadline),
        AssignmentClosed(assignment_id=A1, outcome=AssignmentOutcome.ABANDONED),
        OutcomeCommitted(outcome=Outcome.CANCELLED),
    )
    still_open = Discovery(observed_at=T0, objects=(ObservedObject(object=ref, open=True),))
    assert _next(*bodies, discovery=still_open) == [
        Wait(until=deadline, reason="a recorded call has not landed or expired")
    ]


@given(histories())
def test_next_never_offers_a_job_that_ended_or_settles_one_that_has_not(generated: History) -> None:
    header, history = generated
    job = fold(header, history, T0)
    steps = next_steps(job, NOTHING, T0)
    if job.has_outcome:
        assert Offer() not in steps
    else:
        assert Settle() not in steps
    if job.settled:
        assert Settle() not in steps
