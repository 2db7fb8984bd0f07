"""Build logs on the server: pieces fenced by assignment_id, repeats stored once, gaps marked, the cap,
one log per assignment of a build, sealing into one zstandard blob, and retention with the build."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from django.utils import timezone
from hypothesis import given, settings
from hypothesis import strategies as st

from gradient.scheduling.decisions.logs import LogState, append_piece, cut_line, missing_line, plain_text
from gradient.scheduling.models import BuildLog, BuildLogChunk, DerivationBuild, EvaluationStatus
from gradient.scheduling.services import graph
from gradient.scheduling.services.assignment import Assignment
from gradient.scheduling.services.logs import (
    build_log_append,
    build_log_read,
    build_log_seal_pass,
    build_log_seal_step,
    build_log_tail,
)
from gradient.scheduling.services.offers import promote_retries
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, build, build_id_of, drv, report, wire

# --- the pure decision -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("\x1b[1;31merror:\x1b[0m make failed\n", "error: make failed\n"),  # colour
        ("\x1b[2K\x1b[1Gdone\n", "done\n"),  # erase line, cursor to column 1
        ("\x1b]0;building hello\x07hello\n", "hello\n"),  # a window title (OSC ... BEL)
        ("\x1b]8;;https://x\x1b\\link\x1b]8;;\x1b\\\n", "link\n"),  # a hyperlink (OSC ... ST)
        ("10%\r50%\r100%\n", "100%\n"),  # a progress bar rewritten in place: its last state
        ("windows line\r\n", "windows line\r\n"),  # CRLF stays
        ("<b>no markup</b> & [1;31m without ESC\n", "<b>no markup</b> & [1;31m without ESC\n"),
        ("", ""),
    ],
)
def test_plain_text_drops_terminal_escapes_and_keeps_every_other_character(raw: str, shown: str) -> None:
    assert plain_text(raw) == shown


@given(st.text(alphabet=st.characters(exclude_characters="\x1b\r")))
def test_plain_text_changes_no_text_without_escapes_or_carriage_returns(text: str) -> None:
    assert plain_text(text) == text


def test_pieces_in_order_are_stored_as_they_come() -> None:
    state = LogState()
    first = append_piece(state, offset=0, data="one\n", max_bytes=100)
    second = append_piece(first.state, offset=4, data="two\n", max_bytes=100)
    assert (first.text, second.text) == ("one\n", "two\n")
    assert second.state == LogState(received=8, length=8, size_bytes=8, at_line_start=True, cut=False)


def test_a_repeat_stores_only_what_is_new() -> None:
    state = append_piece(LogState(), offset=0, data="abcdef", max_bytes=100).state
    assert append_piece(state, offset=0, data="abc", max_bytes=100).text == ""
    assert append_piece(state, offset=2, data="cdef", max_bytes=100).text == ""
    overlap = append_piece(state, offset=3, data="defgh", max_bytes=100)
    assert overlap.text == "gh"
    assert overlap.state.received == 8


def test_a_gap_is_stored_after_a_line_saying_how_much_is_missing() -> None:
    state = append_piece(LogState(), offset=0, data="abc", max_bytes=100).state
    step = append_piece(state, offset=10, data="xyz\n", max_bytes=100)
    assert step.text == "\n" + missing_line(7) + "xyz\n"
    assert step.state.received == 14


def test_past_the_cap_one_line_says_the_log_was_cut_and_the_rest_is_dropped() -> None:
    state = append_piece(LogState(), offset=0, data="0123456789", max_bytes=15).state
    step = append_piece(state, offset=10, data="abcdefghij", max_bytes=15)
    assert step.text == "abcde\n" + cut_line(15)
    assert step.state.cut and step.state.size_bytes == 15
    assert append_piece(step.state, offset=20, data="more", max_bytes=15).text == ""


def test_the_cap_counts_bytes_and_never_splits_a_character() -> None:
    step = append_piece(LogState(), offset=0, data="ééé", max_bytes=5)  # 2 bytes each
    assert step.text == "éé\n" + cut_line(5)
    assert step.state.size_bytes == 4


def test_a_gap_to_the_last_position_a_column_holds_is_marked_and_ends_the_log() -> None:
    state = append_piece(LogState(), offset=0, data="a\n", max_bytes=100).state
    step = append_piece(state, offset=2**63 - 2, data="xyz", max_bytes=100)
    assert step.text == missing_line(2**63 - 4) + "xyz"
    assert step.state.received == 2**63 - 1
    assert append_piece(step.state, offset=2**63 - 1, data="more", max_bytes=100).text == ""


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab\né", min_size=0, max_size=60),
    cuts=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), max_size=12),
)
def test_pieces_in_any_order_with_repeats_keep_every_character_at_most_once(
    text: str, cuts: list[tuple[int, int]]
) -> None:
    """Whatever pieces of one text arrive, the stored log is the text in order, with markers where
    pieces are missing, and never holds a character twice."""
    state, stored = LogState(), ""
    for a, b in cuts:
        lo, hi = sorted((a % (len(text) + 1), b % (len(text) + 1)))
        step = append_piece(state, offset=lo, data=text[lo:hi], max_bytes=10_000)
        stored += step.text
        state = step.state
    assert state.length == len(stored)
    plain = "".join(line for line in stored.splitlines(keepends=True) if not line.startswith("[... "))
    assert len(plain.replace("\n", "")) <= len(text.replace("\n", ""))


# --- the service -------------------------------------------------------------------------------------


@pytest.fixture
def running(db: None) -> tuple[Any, Assignment]:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("hello")], now=timezone.now())
    worker = connected_worker([project])
    a = ask(worker.id)
    assert a is not None
    return worker, a


def piece(worker_id: uuid.UUID, a: Assignment, offset: int, data: str, **fields: Any) -> Any:
    message = {
        "type": "BuildLog",
        "job_id": a.job_key,
        "assignment_id": str(a.assignment_id),
        "build_id": build_id_of(a),
        "offset": offset,
        "data": data,
        **fields,
    }
    return build_log_append(worker_id=worker_id, message=wire(message), now=timezone.now())


def text_of(a: Assignment, offset: int = 0) -> str:
    build_row = DerivationBuild.objects.get(id=build_id_of(a))
    found = build_log_read(build=build_row, assignment_id=None, offset=offset)
    assert found is not None
    return found.text


def test_a_log_sent_in_pieces_reads_back_whole_and_from_an_offset(running: Any) -> None:
    worker, a = running
    assert piece(worker.id, a, 0, "hello\n").accepted
    assert piece(worker.id, a, 6, "world\n").accepted
    assert text_of(a) == "hello\nworld\n"
    assert text_of(a, 3) == "lo\nworld\n"
    assert text_of(a, 8) == "rld\n"
    assert text_of(a, 100) == ""
    build_row = DerivationBuild.objects.get(id=build_id_of(a))
    found = build_log_read(build=build_row, assignment_id=None, offset=0)
    assert found is not None and found.complete is False


def test_a_repeated_piece_is_stored_once(running: Any) -> None:
    worker, a = running
    piece(worker.id, a, 0, "hello\n")
    assert not piece(worker.id, a, 0, "hello\n").accepted
    assert BuildLogChunk.objects.count() == 1
    assert text_of(a) == "hello\n"


def test_a_gap_is_marked(running: Any) -> None:
    worker, a = running
    piece(worker.id, a, 0, "one\n")
    piece(worker.id, a, 10, "three\n")
    assert text_of(a) == "one\n" + missing_line(6) + "three\n"


def test_a_stale_or_foreign_piece_changes_nothing(running: Any) -> None:
    worker, a = running
    other = connected_worker(list(worker.projects.all()))
    piece(worker.id, a, 0, "mine\n")
    before = list(BuildLog.objects.values_list("id", "received", "length")), BuildLogChunk.objects.count()
    assert not piece(other.id, a, 5, "theirs\n").accepted  # another worker's piece
    assert not piece(worker.id, a, 5, "x\n", assignment_id=str(uuid.uuid4())).accepted
    assert not piece(worker.id, a, 5, "x\n", assignment_id="not-a-uuid").accepted
    assert not piece(worker.id, a, 5, "x\n", build_id=str(uuid.uuid4())).accepted  # not the job's build
    assert (
        list(BuildLog.objects.values_list("id", "received", "length")),
        BuildLogChunk.objects.count(),
    ) == before
    build(worker.id, a)  # closed: a late piece is stale
    assert not piece(worker.id, a, 5, "late\n").accepted
    assert text_of(a) == "mine\n"


@override_settings(GRADIENT_BUILD_LOG_MAX_BYTES=1000)
def test_a_small_cap_holds(running: Any) -> None:
    worker, a = running
    line = "x" * 99 + "\n"
    for i in range(30):
        piece(worker.id, a, i * 100, line)
    text = text_of(a)
    assert text.endswith(cut_line(1000))
    assert len(text.encode()) == 1000 + len(cut_line(1000).encode())
    log = BuildLog.objects.get()
    assert log.cut and log.size_bytes == 1000
    assert BuildLogChunk.objects.count() == 11  # ten pieces and the one that was cut; the rest dropped


def test_a_piece_at_the_largest_offset_is_stored_after_its_gap_line(running: Any) -> None:
    worker, a = running
    piece(worker.id, a, 0, "a\n")
    assert piece(worker.id, a, 2**63 - 1, "z").accepted
    assert text_of(a) == "a\n" + missing_line(2**63 - 3) + "z"


def test_a_nul_character_is_stored_as_a_replacement_character_in_its_place(running: Any) -> None:
    worker, a = running
    piece(worker.id, a, 0, "a\x00b")
    piece(worker.id, a, 3, "c")
    assert text_of(a) == "a\ufffdbc"


def test_a_retried_build_keeps_the_log_of_every_try(running: Any) -> None:
    worker, first = running
    piece(worker.id, first, 0, "first try\n")
    report(worker.id, first, "JobFailed", error="boom", kind="transient")
    promote_retries(now=timezone.now() + timedelta(hours=1))
    second = ask(worker.id)
    assert second is not None and second.assignment_id != first.assignment_id
    piece(worker.id, second, 0, "second try\n")
    build_row = DerivationBuild.objects.get(id=build_id_of(first))
    latest = build_log_read(build=build_row, assignment_id=None, offset=0)
    earlier = build_log_read(build=build_row, assignment_id=first.assignment_id, offset=0)
    assert latest is not None and latest.text == "second try\n" and not latest.complete
    assert earlier is not None and earlier.text == "first try\n" and earlier.complete
    assert build_log_read(build=build_row, assignment_id=uuid.uuid4(), offset=0) is None


def test_a_closed_assignments_log_is_sealed_into_one_compressed_blob(running: Any) -> None:
    worker, a = running
    lines = [f"[{i:05d}] compiling module_{i % 37}.c -O2 -Wall\n" for i in range(3000)]
    offset = 0
    for start in range(0, len(lines), 100):
        data = "".join(lines[start : start + 100])
        piece(worker.id, a, offset, data)
        offset += len(data)
    assert build_log_seal_step(now=timezone.now()) == 0  # still open: not sealed
    build(worker.id, a)
    assert build_log_seal_pass(now=timezone.now()) == 1
    log = BuildLog.objects.get()
    assert log.sealed_at is not None and BuildLogChunk.objects.count() == 0
    assert log.blob is not None and len(bytes(log.blob)) < offset / 5
    assert text_of(a) == "".join(lines)
    assert text_of(a, offset - 10) == "".join(lines)[-10:]
    assert build_log_tail(build=DerivationBuild.objects.get(id=build_id_of(a)), lines=2) == "".join(
        lines[-2:]
    ).rstrip("\n")
    assert build_log_seal_pass(now=timezone.now()) == 0


def test_the_tail_of_a_running_log_is_its_last_lines(running: Any) -> None:
    worker, a = running
    for i in range(50):
        piece(worker.id, a, i * 8, f"line {i:02d}\n")
    tail = build_log_tail(build=DerivationBuild.objects.get(id=build_id_of(a)), lines=3)
    assert tail == "line 47\nline 48\nline 49"


def test_deleting_a_build_with_plain_sql_deletes_its_log(running: Any, postgres_only: None) -> None:
    worker, a = running
    piece(worker.id, a, 0, "bye\n")
    with connection.cursor() as cursor:
        cursor.execute("UPDATE dispatched_job SET derivation_build_id = NULL")
        cursor.execute("DELETE FROM build_attempt")
        cursor.execute("DELETE FROM evaluation_build")
        cursor.execute("DELETE FROM derivation_build WHERE id = %s", [build_id_of(a)])
    assert not BuildLog.objects.exists() and not BuildLogChunk.objects.exists()
