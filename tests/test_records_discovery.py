"""The settled predicate, judged on what the scheduler shows now."""

from __future__ import annotations

import uuid
from datetime import timedelta

from hypothesis import given

from gradient.records.decisions.discovery import Discovery, ObservedObject, unsettled_reasons
from gradient.records.decisions.fold import fold
from gradient.records.schemas import (
    Abandon,
    AssignmentClaimed,
    AssignmentClosed,
    AssignmentOutcome,
    AttemptOutcome,
    CallDeadline,
    CallKind,
    Cancel,
    ClusterAttemptClosed,
    ClusterAttemptOpened,
    JobKind,
    ObjectRef,
    ObjectTable,
    Outcome,
    OutcomeCommitted,
    Resubmit,
)
from tests.support.records import T0, History, entries, histories, make_header

A1 = uuid.UUID(int=1)
REF1 = ObjectRef(table=ObjectTable.DISPATCHED_JOB, id=A1)
FOREIGN = ObjectRef(table=ObjectTable.DISPATCHED_JOB, id=uuid.UUID(int=99))


def _done() -> tuple:
    return (
        AssignmentClaimed(submission=1, assignment_id=A1, worker="w1", attempt=1),
        AssignmentClosed(assignment_id=A1, outcome=AssignmentOutcome.COMPLETED),
        OutcomeCommitted(outcome=Outcome.SUCCEEDED),
    )


def test_a_finished_job_whose_objects_all_ended_can_settle() -> None:
    job = fold(make_header(), entries(*_done()), T0)
    seen = Discovery(observed_at=T0, objects=(ObservedObject(object=REF1, open=False),))
    assert unsettled_reasons(job, seen) == ()


def test_a_job_without_an_outcome_cannot_settle() -> None:
    assert "no outcome yet" in unsettled_reasons(fold(make_header(), (), T0), Discovery(observed_at=T0))


def test_an_object_still_open_in_the_record_or_in_discovery_holds_settling_back() -> None:
    cancelled = fold(
        make_header(),
        entries(AssignmentClaimed(submission=1, assignment_id=A1, worker="w1", attempt=1), (Cancel(), "op")),
        T0,
    )
    assert any("has not ended" in r for r in unsettled_reasons(cancelled, Discovery(observed_at=T0)))
    done = fold(make_header(), entries(*_done()), T0)
    still_open = Discovery(observed_at=T0, objects=(ObservedObject(object=REF1, open=True),))
    assert any("still open" in r for r in unsettled_reasons(done, still_open))


def test_a_foreign_object_holds_settling_back_until_the_job_is_abandoned() -> None:
    foreign = Discovery(observed_at=T0, objects=(ObservedObject(object=FOREIGN, open=True),))
    done = fold(make_header(), entries(*_done()), T0)
    assert any("foreign" in r for r in unsettled_reasons(done, foreign))
    abandoned = fold(make_header(), entries(*_done(), (Abandon(), "op")), T0)
    assert unsettled_reasons(abandoned, foreign) == ()


def test_a_recorded_hold_must_have_expired_before_a_cluster_settles_on_an_earlier_discovery() -> None:
    c1 = uuid.UUID(int=5)
    ref = ObjectRef(table=ObjectTable.CLUSTER_ATTEMPT, id=c1)
    deadline = T0 + timedelta(seconds=40)
    history = entries(
        ClusterAttemptOpened(submission=1, cluster_attempt_id=c1, attempt=1),
        CallDeadline(call=CallKind.HOLD, object=ref, deadline=deadline),
        (Cancel(), "op"),
        ClusterAttemptClosed(cluster_attempt_id=c1, outcome=AttemptOutcome.PREPARE_FAILED),
    )
    job = fold(make_header(JobKind.CLUSTER), history, T0)
    # the row is closed, and discovery no longer shows it open: the call landed
    assert (
        unsettled_reasons(job, Discovery(observed_at=T0, objects=(ObservedObject(object=ref, open=False),)))
        == ()
    )
    # a discovery that still shows the row open before the hold (plus margin) expired cannot settle it
    early = Discovery(observed_at=deadline, objects=(ObservedObject(object=ref, open=True),))
    assert any("hold call" in r for r in unsettled_reasons(job, early))


def test_a_pending_resubmit_holds_settling_back() -> None:
    job = fold(make_header(), entries((Cancel(), "op"), (Resubmit(), "op")), T0)
    assert "a resubmit is pending" in unsettled_reasons(job, Discovery(observed_at=T0))


@given(histories())
def test_a_job_with_no_outcome_never_satisfies_the_predicate(generated: History) -> None:
    header, history = generated
    job = fold(header, history, T0)
    if not job.has_outcome:
        assert unsettled_reasons(job, Discovery(observed_at=T0 + timedelta(days=1)))
