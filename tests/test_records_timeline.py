"""The timeline: every entry as one readable line, with what each control intent did."""

from __future__ import annotations

import uuid

from hypothesis import given

from gradient.records.decisions.fold import fold
from gradient.records.schemas import AssignmentClaimed, Cancel, Outcome, OutcomeCommitted, RawEntry, tag_of
from gradient.records.timeline import describe, timeline
from tests.support.records import T0, History, entries, histories, make_header


def test_a_cancel_after_success_reads_as_such() -> None:
    a = uuid.UUID("12345678-0000-4000-8000-000000000000")
    history = entries(
        AssignmentClaimed(submission=1, assignment_id=a, worker="w7", attempt=2),
        OutcomeCommitted(outcome=Outcome.SUCCEEDED, cause="built"),
        (Cancel(reason="oops"), "admin:alice"),
    )
    rows = timeline(history, fold(make_header(), history, T0))
    assert [(r.revision, r.actor, r.what, r.effect) for r in rows] == [
        (1, "scheduler", "submission 1: claimed for w7, attempt 2", ""),
        (2, "scheduler", "outcome succeeded: built", ""),
        (3, "admin:alice", "cancel requested: oops", "cancel after outcome"),
    ]
    assert rows[2].at == history[2].recorded_at and '"intent": "cancel"' in rows[2].body


def test_an_entry_this_build_cannot_read_is_shown_not_hidden() -> None:
    bad = RawEntry(revision=1, kind="fact", schema="gradient.fact.v3", body="{}", actor="x", recorded_at=T0)
    (row,) = timeline([bad])
    assert row.what.startswith("unreadable gradient.fact.v3 entry")


@given(histories())
def test_every_entry_a_writer_produces_has_its_own_line(generated: History) -> None:
    header, history = generated
    rows = timeline(history, fold(header, history, T0))
    assert [r.revision for r in rows] == [e.revision for e in history]
    for row in rows:
        assert row.what and not row.what.startswith("unreadable")
    for control in fold(header, history, T0).controls:
        assert rows[control.revision - 1].effect


def test_describe_names_every_kind_of_entry_in_words() -> None:
    assert describe(Cancel()) == "cancel requested"
    assert describe(OutcomeCommitted(outcome=Outcome.FAILED)) == "outcome failed"
    assert tag_of(Cancel()) == "cancel"
