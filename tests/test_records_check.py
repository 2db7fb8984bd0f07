"""The row check: a job's rows must agree with its folded record."""

from __future__ import annotations

import uuid
from datetime import timedelta

from gradient.records.decisions.check import disagreements
from gradient.records.decisions.discovery import Discovery, ObservedObject
from gradient.records.decisions.fold import fold
from gradient.records.schemas import (
    AssignmentClaimed,
    AssignmentClosed,
    AssignmentOutcome,
    Cancel,
    JobKind,
    ObjectRef,
    ObjectTable,
    Outcome,
    OutcomeCommitted,
    RowStatus,
    StatusChanged,
)
from tests.support.records import T0, entries, make_header

A1 = uuid.UUID(int=1)
REF1 = ObjectRef(table=ObjectTable.DISPATCHED_JOB, id=A1)
CLAIM = AssignmentClaimed(submission=1, assignment_id=A1, worker="w1", attempt=1)


def _check(*bodies, row: RowStatus | None, objects=(), now=T0, kind=JobKind.EVALUATION):  # type: ignore[no-untyped-def]
    job = fold(make_header(kind), entries(*bodies), T0)
    return disagreements(job, Discovery(observed_at=now, objects=tuple(objects), row_status=row), now)


def test_rows_that_match_the_record_agree() -> None:
    assert _check(CLAIM, row=RowStatus.FETCHING, objects=[ObservedObject(object=REF1, open=True)]) == ()
    done = (
        CLAIM,
        AssignmentClosed(assignment_id=A1, outcome=AssignmentOutcome.COMPLETED),
        OutcomeCommitted(outcome=Outcome.SUCCEEDED),
    )
    assert _check(*done, row=RowStatus.COMPLETED, objects=[ObservedObject(object=REF1, open=False)]) == ()


def test_a_terminal_row_without_an_outcome_disagrees() -> None:
    assert _check(row=RowStatus.COMPLETED) == ("the row is Completed but the record has no outcome",)


def test_a_terminal_row_with_another_outcome_disagrees() -> None:
    assert _check(OutcomeCommitted(outcome=Outcome.FAILED), row=RowStatus.ABORTED) == (
        "the row is Aborted but the record's outcome is failed",
    )


def test_a_cancel_not_yet_applied_to_the_row_agrees_within_the_grace_and_disagrees_after() -> None:
    assert _check((Cancel(), "op"), row=RowStatus.QUEUED, now=T0) == ()
    late = _check((Cancel(), "op"), row=RowStatus.QUEUED, now=T0 + timedelta(minutes=10))
    assert late == ("the row is still Queued but the record's outcome is cancelled",)


def test_an_outcome_fact_with_an_active_row_disagrees_at_once() -> None:
    assert _check(OutcomeCommitted(outcome=Outcome.SUCCEEDED), row=RowStatus.BUILDING) != ()


def test_open_rows_must_match_the_open_submissions() -> None:
    assert _check(CLAIM, row=RowStatus.FETCHING, objects=[]) == (
        f"{REF1} is open in the record but its row is closed or gone",
    )
    foreign = ObjectRef(table=ObjectTable.DISPATCHED_JOB, id=uuid.UUID(int=7))
    assert _check(row=RowStatus.FETCHING, objects=[ObservedObject(object=foreign, open=True)]) == (
        f"{foreign} is open but the record never named it",
    )
    closed = (CLAIM, AssignmentClosed(assignment_id=A1, outcome=AssignmentOutcome.FAILED))
    assert _check(*closed, row=RowStatus.QUEUED, objects=[ObservedObject(object=REF1, open=True)]) == (
        f"{REF1} is closed in the record but its row is open",
    )


def test_a_tracked_status_must_match_the_row() -> None:
    assert _check(StatusChanged(status=RowStatus.FETCHING), row=RowStatus.FETCHING) == ()
    assert _check(StatusChanged(status=RowStatus.FETCHING), row=RowStatus.BUILDING) == (
        "the row is Building but the record last recorded Fetching",
    )


def test_a_row_gone_before_the_job_ended_disagrees() -> None:
    assert _check(row=None) == ("the row is gone but the record has no outcome",)
    assert _check(OutcomeCommitted(outcome=Outcome.SUCCEEDED), row=None) == ()
