"""Fold: the record's history replayed over its header, purely. Table tests for the page's semantics,
Hypothesis properties over histories a protocol-respecting writer could have written, and every
history the protocol could not have written, generated and refused."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradient.records.decisions.fold import Effect, fold, fold_prefix
from gradient.records.errors import InvalidHistory, SchemaError
from gradient.records.schemas import (
    Abandon,
    AssignmentClaimed,
    AssignmentClosed,
    AssignmentOutcome,
    AttemptOutcome,
    Cancel,
    ClusterAttemptClosed,
    ClusterAttemptOpened,
    ClusterAttemptStarted,
    ControlIntent,
    Desired,
    GiveUp,
    Header,
    Hold,
    JobKind,
    ObjectRef,
    ObjectTable,
    Outcome,
    OutcomeCommitted,
    RawEntry,
    Release,
    ReportKind,
    Requeue,
    Resubmit,
    Resubmitted,
    RowStatus,
    Settled,
    StatusChanged,
    WorkerReport,
    decode_body,
    encode,
)
from tests.support.records import (
    T0,
    History,
    control_intents,
    entries,
    entry,
    histories,
    make_header,
    renumber,
)

A1, A2, A3 = (uuid.UUID(int=n) for n in (101, 102, 103))
LATER = T0 + timedelta(days=3)


def _claim(n: int, a: uuid.UUID, attempt: int | None = None) -> AssignmentClaimed:
    return AssignmentClaimed(submission=n, assignment_id=a, worker=f"w{n}", attempt=attempt or n)


# --- The page's semantics, one case at a time -------------------------------------------------------------


def test_a_new_record_wants_to_run_and_has_no_outcome() -> None:
    job = fold(make_header(), (), T0)
    assert (job.desired, job.outcome, job.revision, job.submissions) == (Desired.RUN, Outcome.NONE, 0, ())
    assert job.status is RowStatus.QUEUED and not job.status_tracked


def test_cancel_sets_desired_cancel_and_outcome_cancelled_at_once_and_marks_cleanup_pending() -> None:
    history = entries(
        _claim(1, A1),
        (Hold(reason="look"), "op"),
        (Requeue(), "op"),
        (Resubmit(), "op"),
        (Cancel(reason="no"), "op"),
    )
    job = fold(make_header(), history, T0)
    assert job.desired is Desired.CANCEL
    assert job.outcome is Outcome.CANCELLED and job.cause == "cancelled by op: no"
    assert job.holds == () and job.pending_requeue is None and not job.pending_resubmit
    assert job.cleanup_pending
    assert job.controls[-1].effect is Effect.CANCELLED


def test_cleanup_is_done_once_the_cancelled_jobs_submission_closes() -> None:
    history = entries(
        _claim(1, A1),
        (Cancel(), "op"),
        AssignmentClosed(assignment_id=A1, outcome=AssignmentOutcome.ABANDONED),
    )
    assert not fold(make_header(), history, T0).cleanup_pending


def test_a_cancel_after_success_leaves_the_outcome_succeeded_and_says_so() -> None:
    history = entries(
        _claim(1, A1), OutcomeCommitted(outcome=Outcome.SUCCEEDED, cause="built"), (Cancel(), "op")
    )
    job = fold(make_header(), history, T0)
    assert job.outcome is Outcome.SUCCEEDED and job.cause == "built" and job.outcome_revision == 2
    assert job.controls[-1].effect is Effect.CANCEL_AFTER_OUTCOME


def test_give_up_fails_the_job_with_the_cause_of_the_hold_it_ends_and_escalates() -> None:
    history = entries((Hold(reason="worker keeps crashing"), "op"), (GiveUp(reason="enough"), "op"))
    job = fold(make_header(), history, T0)
    assert job.outcome is Outcome.FAILED and job.cause == "worker keeps crashing"
    assert job.holds == () and job.desired is Desired.RUN
    assert [e.cause for e in job.escalations] == ["worker keeps crashing"]
    assert job.controls[-1].effect is Effect.GIVEN_UP


def test_give_up_without_a_hold_names_who_gave_up() -> None:
    job = fold(make_header(), entries((GiveUp(reason="stuck"), "admin:alice")), T0)
    assert job.cause == "given up by admin:alice: stuck" and len(job.escalations) == 1


def test_a_later_outcome_fact_is_kept_as_evidence_and_never_applied() -> None:
    history = entries((Cancel(), "op"), OutcomeCommitted(outcome=Outcome.SUCCEEDED, cause="raced"))
    job = fold(make_header(), history, T0)
    assert job.outcome is Outcome.CANCELLED
    assert [(lo.revision, lo.outcome) for lo in job.late_outcomes] == [(2, Outcome.SUCCEEDED)]


def test_hold_and_release_move_the_desired_state_and_a_release_without_hold_does_nothing() -> None:
    held = fold(make_header(), entries((Hold(reason="a"), "op"), (Hold(reason="b"), "op")), T0)
    assert held.desired is Desired.HOLD and [h.reason for h in held.holds] == ["a", "b"]
    released = fold(make_header(), entries((Hold(), "op"), (Release(), "op"), (Release(), "op")), T0)
    assert released.desired is Desired.RUN and released.holds == ()
    assert [c.effect for c in released.controls] == [Effect.HELD, Effect.RELEASED, Effect.RELEASE_IGNORED]


def test_a_hold_after_the_outcome_is_ignored() -> None:
    job = fold(make_header(), entries((Cancel(), "op"), (Hold(), "op")), T0)
    assert job.desired is Desired.CANCEL and job.controls[-1].effect is Effect.HOLD_IGNORED


def test_a_requeue_is_pending_until_the_submission_it_names_closes() -> None:
    pending = fold(make_header(), entries(_claim(1, A1), (Requeue(), "op")), T0)
    assert pending.pending_requeue == ObjectRef(table=ObjectTable.DISPATCHED_JOB, id=A1)
    landed = fold(
        make_header(),
        entries(
            _claim(1, A1),
            (Requeue(), "op"),
            AssignmentClosed(assignment_id=A1, outcome=AssignmentOutcome.ABANDONED),
        ),
        T0,
    )
    assert landed.pending_requeue is None


def test_a_requeue_with_nothing_running_is_ignored() -> None:
    job = fold(make_header(), entries((Requeue(), "op")), T0)
    assert job.pending_requeue is None and job.controls[0].effect is Effect.REQUEUE_IGNORED


def test_a_resubmit_is_pending_until_the_successor_is_recorded() -> None:
    successor = f"eval:{uuid.uuid4()}"
    job = fold(
        make_header(), entries((Cancel(), "op"), (Resubmit(), "op"), Resubmitted(successor=successor)), T0
    )
    assert not job.pending_resubmit and job.successor == successor
    again = fold(
        make_header(),
        entries((Cancel(), "op"), (Resubmit(), "op"), Resubmitted(successor=successor), (Resubmit(), "op")),
        T0,
    )
    assert again.controls[-1].effect is Effect.RESUBMIT_IGNORED


def test_abandon_cancels_and_waives_every_object_recorded_so_far() -> None:
    job = fold(make_header(), entries(_claim(1, A1), (Abandon(reason="worker gone for good"), "op")), T0)
    assert job.outcome is Outcome.CANCELLED and job.abandoned and not job.cleanup_pending
    assert job.submissions[0].waived and job.submissions[0].open


def test_submissions_record_attempt_worker_start_reports_and_close() -> None:
    history = entries(
        _claim(1, A1, attempt=1),
        WorkerReport(assignment_id=A1, worker="w1", kind=ReportKind.ACCEPTED),
        WorkerReport(assignment_id=A1, worker="w1", kind=ReportKind.FAILED, summary="oom"),
        AssignmentClosed(assignment_id=A1, outcome=AssignmentOutcome.FAILED, reason="oom"),
        _claim(2, A2, attempt=2),
    )
    job = fold(make_header(), history, T0)
    first, second = job.submissions
    assert (first.attempt, first.worker, first.reports, first.close_outcome) == (1, "w1", 2, "Failed")
    assert first.started_at == history[1].recorded_at and first.last_report is not None
    assert first.last_report.summary == "oom"
    assert second.open and job.current == second


def test_a_cluster_record_opens_starts_and_closes_attempts() -> None:
    c1 = uuid.UUID(int=7)
    history = entries(
        ClusterAttemptOpened(submission=1, cluster_attempt_id=c1, attempt=1),
        ClusterAttemptStarted(cluster_attempt_id=c1),
        ClusterAttemptClosed(cluster_attempt_id=c1, outcome=AttemptOutcome.SUCCEEDED),
        StatusChanged(status=RowStatus.COMPLETED),
        OutcomeCommitted(outcome=Outcome.SUCCEEDED),
        Settled(),
    )
    job = fold(make_header(JobKind.CLUSTER), history, T0)
    assert job.settled and job.status is RowStatus.COMPLETED and job.submissions[0].started_at is not None


def test_fold_prefix_is_the_job_as_it_was_at_that_revision() -> None:
    history = entries(_claim(1, A1), (Cancel(), "op"))
    assert fold_prefix(make_header(), history, 1, T0).outcome is Outcome.NONE


# --- Properties over generated histories ------------------------------------------------------------------


@given(histories())
def test_fold_is_deterministic_for_a_revision_whoever_folds_it_and_whenever(
    generated: History,
) -> None:
    header, history = generated
    job = fold(header, history, T0)
    assert fold(header, history, LATER) == job
    # another actor reads the same bytes back and re-encodes them: still the same Job
    reencoded = tuple(
        RawEntry(
            revision=e.revision,
            kind=e.kind,
            schema=e.schema,
            body=encode(decode_body(e.schema, e.body)),
            actor=e.actor,
            recorded_at=e.recorded_at,
        )
        for e in history
    )
    assert fold(header, reencoded, T0) == job
    assert job.revision == len(history)


@given(histories())
def test_an_outcome_once_committed_never_changes(generated: History) -> None:
    header, history = generated
    committed = None
    for revision in range(len(history) + 1):
        job = fold_prefix(header, history, revision, T0)
        if committed is not None:
            assert (job.outcome, job.cause, job.outcome_revision) == committed
        elif job.has_outcome:
            committed = (job.outcome, job.cause, job.outcome_revision)


@given(
    histories(kind=JobKind.EVALUATION, allow_outcomes=False),
    st.lists(control_intents(), max_size=6),
    st.sampled_from(["admin:alice", "api:bob"]),
)
def test_a_cancel_after_success_stays_succeeded_whatever_came_before_or_after(
    generated: History, later_intents: list[ControlIntent], operator: str
) -> None:
    header, history = generated
    success = entry(len(history) + 1, OutcomeCommitted(outcome=Outcome.SUCCEEDED, cause="built"))
    tail = entries(
        *[(i, operator) for i in later_intents], (Cancel(reason="too late"), operator), start=len(history) + 2
    )
    job = fold(header, (*history, success, *tail), T0)
    assert job.outcome is Outcome.SUCCEEDED and job.cause == "built"
    assert job.desired is Desired.CANCEL
    assert job.controls[-1].effect is Effect.CANCEL_AFTER_OUTCOME


# --- Histories the protocol could not have written, generated and refused ---------------------------------


def _refused(header: Header, history: tuple[RawEntry, ...]) -> InvalidHistory:
    with pytest.raises(InvalidHistory) as refused:
        fold(header, history, T0)
    return refused.value


def _replace(e: RawEntry, **changes: object) -> RawEntry:
    fields = {f: getattr(e, f) for f in ("revision", "kind", "schema", "body", "actor", "recorded_at")}
    fields.update(changes)
    return RawEntry(**fields)


def _claims(history: tuple[RawEntry, ...]) -> list[AssignmentClaimed]:
    found = []
    for e in history:
        body = decode_body(e.schema, e.body)
        if isinstance(body, AssignmentClaimed):
            found.append(body)
    return found


@given(histories(min_size=1), st.data())
def test_an_entry_of_neither_kind_is_refused(generated: History, data: st.DataObject) -> None:
    header, history = generated
    i = data.draw(st.integers(0, len(history) - 1))
    kind = data.draw(st.text(max_size=10).filter(lambda k: k not in ("control", "fact")))
    bad = (*history[:i], _replace(history[i], kind=kind), *history[i + 1 :])
    assert "neither" in _refused(header, bad).message


@given(histories(min_size=1), st.data())
def test_an_entry_of_both_kinds_is_refused(generated: History, data: st.DataObject) -> None:
    header, history = generated
    i = data.draw(st.integers(0, len(history) - 1))
    other = "fact" if history[i].kind == "control" else "control"
    bad = (*history[:i], _replace(history[i], kind=other), *history[i + 1 :])
    assert "both" in _refused(header, bad).message


@given(histories(kind=JobKind.EVALUATION), st.integers(min_value=2, max_value=50))
def test_a_submission_authorized_out_of_order_is_refused(generated: History, skip: int) -> None:
    header, history = generated
    number = len(_claims(history)) + skip
    bad = (*history, entry(len(history) + 1, _claim(number, uuid.uuid4())))
    assert "authorized after" in _refused(header, bad).message


@given(histories(kind=JobKind.EVALUATION, min_size=1), st.data())
def test_a_key_reserved_twice_is_refused(generated: History, data: st.DataObject) -> None:
    header, history = generated
    seed = entry(len(history) + 1, _claim(len(_claims(history)) + 1, uuid.uuid4()))
    history = (*history, seed)
    claims = _claims(history)
    reused = data.draw(st.sampled_from(claims)).assignment_id
    bad = (*history, entry(len(history) + 1, _claim(len(claims) + 1, reused)))
    assert "reserved twice" in _refused(header, bad).message


@given(histories(kind=JobKind.EVALUATION, min_size=1), st.data())
def test_a_second_canonical_object_for_one_submission_is_refused(
    generated: History, data: st.DataObject
) -> None:
    header, history = generated
    history = (*history, entry(len(history) + 1, _claim(len(_claims(history)) + 1, uuid.uuid4())))
    number = data.draw(st.integers(1, len(_claims(history))))
    bad = (*history, entry(len(history) + 1, _claim(number, uuid.uuid4())))
    assert "second canonical object" in _refused(header, bad).message


@given(histories())
def test_an_outcome_that_is_not_terminal_is_refused(generated: History) -> None:
    header, history = generated
    bad = (*history, entry(len(history) + 1, OutcomeCommitted(outcome=Outcome.NONE)))
    assert "not terminal" in _refused(header, bad).message


@given(histories(min_size=2), st.data())
def test_revisions_out_of_sequence_are_refused(generated: History, data: st.DataObject) -> None:
    header, history = generated
    i = data.draw(st.integers(0, len(history) - 1))
    wrong = data.draw(st.integers(0, 10_000).filter(lambda r: r != i + 1))
    bad = (*history[:i], _replace(history[i], revision=wrong), *history[i + 1 :])
    _refused(header, bad)


@given(histories(kind=JobKind.EVALUATION))
def test_closing_an_object_never_recorded_is_refused(generated: History) -> None:
    header, history = generated
    bad = (
        *history,
        entry(
            len(history) + 1, AssignmentClosed(assignment_id=uuid.uuid4(), outcome=AssignmentOutcome.FAILED)
        ),
    )
    assert "never recorded" in _refused(header, bad).message


@given(histories(kind=JobKind.EVALUATION, min_size=1))
def test_closing_an_object_twice_is_refused(generated: History) -> None:
    header, history = generated
    a = uuid.uuid4()
    close = AssignmentClosed(assignment_id=a, outcome=AssignmentOutcome.COMPLETED)
    n = len(_claims(history)) + 1
    # a new claim can only follow once nothing is open: close whatever the generator left open first
    prefix = _close_open(history)
    bad = renumber((*prefix, entry(0, _claim(n, a)), entry(0, close), entry(0, close)))
    assert "closed twice" in _refused(header, bad).message


def _close_open(history: tuple[RawEntry, ...]) -> tuple[RawEntry, ...]:
    open_ids = {c.assignment_id for c in _claims(history)}
    for e in history:
        body = decode_body(e.schema, e.body)
        if isinstance(body, AssignmentClosed):
            open_ids.discard(body.assignment_id)
    closes = tuple(
        entry(0, AssignmentClosed(assignment_id=a, outcome=AssignmentOutcome.ABANDONED)) for a in open_ids
    )
    return renumber((*history, *closes))


@given(histories(allow_outcomes=False))
def test_settling_without_an_outcome_is_refused(generated: History) -> None:
    header, history = generated
    bad = (*history, entry(len(history) + 1, Settled()))
    assert "without an outcome" in _refused(header, bad).message


@given(histories(kind=JobKind.EVALUATION))
def test_a_cluster_fact_on_an_evaluation_record_is_refused(generated: History) -> None:
    header, history = generated
    bad = (
        *history,
        entry(
            len(history) + 1, ClusterAttemptOpened(submission=1, cluster_attempt_id=uuid.uuid4(), attempt=1)
        ),
    )
    assert "does not belong on the record of" in _refused(header, bad).message


def test_an_entry_with_an_unknown_schema_is_a_schema_error_not_a_guess() -> None:
    good = entry(1, Cancel())
    with pytest.raises(SchemaError):
        fold(make_header(), (_replace(good, schema="gradient.control.v9"),), T0)


def test_a_header_whose_kind_or_lineage_contradicts_itself_is_refused() -> None:
    header = make_header(JobKind.EVALUATION)
    wrong_kind = Header(
        **{**{f: getattr(header, f) for f in header.__struct_fields__}, "kind": JobKind.CLUSTER}
    )
    with pytest.raises(InvalidHistory):
        fold(wrong_kind, (), T0)
    orphan = Header(**{**{f: getattr(header, f) for f in header.__struct_fields__}, "generation": 2})
    with pytest.raises(InvalidHistory):
        fold(orphan, (), T0)
