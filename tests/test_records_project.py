"""Project: the Status a caller reads, from the folded Job and what the scheduler shows now."""

from __future__ import annotations

import uuid
from datetime import timedelta

from hypothesis import given

from gradient.records.decisions.discovery import Discovery, ObservedObject
from gradient.records.decisions.fold import fold
from gradient.records.decisions.project import Phase, project
from gradient.records.schemas import (
    AssignmentClaimed,
    AssignmentClosed,
    AssignmentOutcome,
    Cancel,
    Hold,
    ObjectRef,
    ObjectTable,
    Outcome,
    OutcomeCommitted,
    ReportKind,
    RowStatus,
    WorkerReport,
)
from tests.support.records import T0, History, entries, histories, make_header

A1 = uuid.UUID(int=1)
REF1 = ObjectRef(table=ObjectTable.DISPATCHED_JOB, id=A1)
CLAIM = AssignmentClaimed(submission=1, assignment_id=A1, worker="w1", attempt=1)


def _status(*bodies, discovery: Discovery | None = None):  # type: ignore[no-untyped-def]
    job = fold(make_header(), entries(*bodies), T0)
    return project(job, discovery or Discovery(observed_at=T0, row_status=RowStatus.QUEUED), T0)


def test_a_fresh_job_is_queued() -> None:
    status = _status()
    assert (status.phase, status.outcome, status.submissions, status.attempt) == (
        Phase.QUEUED,
        Outcome.NONE,
        0,
        None,
    )


def test_a_claimed_job_is_dispatched_until_the_worker_accepts_then_running() -> None:
    live = Discovery(
        observed_at=T0, objects=(ObservedObject(object=REF1, open=True, worker="w1", worker_connected=True),)
    )
    dispatched = _status(CLAIM, discovery=live)
    assert dispatched.phase is Phase.DISPATCHED and dispatched.live and dispatched.worker_connected
    running = _status(
        CLAIM, WorkerReport(assignment_id=A1, worker="w1", kind=ReportKind.ACCEPTED), discovery=live
    )
    assert (running.phase, running.worker, running.attempt) == (Phase.RUNNING, "w1", 1)


def test_a_held_job_says_why() -> None:
    status = _status((Hold(reason="cache is down"), "op"))
    assert status.phase is Phase.HELD and status.holds == ("cache is down",)


def test_a_cancelled_job_with_its_assignment_still_open_is_cancelled_with_cleanup_pending() -> None:
    live = Discovery(observed_at=T0, objects=(ObservedObject(object=REF1, open=True),))
    status = _status(CLAIM, (Cancel(), "op"), discovery=live)
    assert status.phase is Phase.CANCELLED and status.cleanup_pending and not status.settleable
    assert any("has not ended" in r for r in status.unsettled)


def test_a_finished_job_whose_rows_closed_is_settleable() -> None:
    status = _status(
        CLAIM,
        AssignmentClosed(assignment_id=A1, outcome=AssignmentOutcome.COMPLETED),
        OutcomeCommitted(outcome=Outcome.SUCCEEDED, cause="built"),
        discovery=Discovery(observed_at=T0, objects=(ObservedObject(object=REF1, open=False),)),
    )
    assert (status.phase, status.cause, status.settleable, status.unsettled) == (
        Phase.SUCCEEDED,
        "built",
        True,
        (),
    )


@given(histories())
def test_project_is_a_function_of_the_job_and_the_discovery(generated: History) -> None:
    header, history = generated
    job = fold(header, history, T0)
    discovery = Discovery(observed_at=T0)
    status = project(job, discovery, T0)
    assert project(job, discovery, T0 + timedelta(hours=1)) == status
    assert status.revision == len(history)
    assert (status.phase.value == job.outcome.value) == job.has_outcome
