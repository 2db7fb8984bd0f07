"""Build logs: the BuildLog report stored, the logs of closed assignments sealed, and logs read back
(docs/logs.md; ../shared/spec/protocol.md "Build logs", rest.md `GET /api/v1/builds/{id}/log`).

A piece is a report, fenced by its assignment_id like every other (fence.fenced_assignment, which
locks the assignment row, so the pieces of one assignment are stored one after another whichever
`serve` process receives them). What a piece adds is decided by the pure
gradient.scheduling.decisions.logs; storing it is one chunk row and the log row's counters, in the
report's one transaction. A closed assignment's chunks are joined into one zstandard blob by the
log-seal pass (build_log_seal_step), outside the reports' hot path.
"""

from __future__ import annotations

import codecs
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

import zstandard
from django.conf import settings
from django.db import transaction
from django.db.models import Sum

from gradient.core.ids import parse_uuid
from gradient.core.jobkey import JobKey
from gradient.core.protocol import BuildLog as BuildLogPiece
from gradient.core.vocab import JobKeyKind
from gradient.runtime import counters
from gradient.scheduling.decisions.logs import (
    MAX_MATCHES,
    LineQuery,
    LogState,
    append_piece,
    build_cut_line,
    select_lines,
    tail_lines,
    worker_cut_line,
)
from gradient.scheduling.models import BuildLog, BuildLogChunk, DerivationBuild, DispatchedJob
from gradient.scheduling.services.fence import DROPPED, fenced_assignment
from gradient.scheduling.services.lifecycle import ReportOutcome

# On an 8 MiB compiler log (bench/logs.py): level 3 is 9.4x smaller in 34 ms, level 10 13.6x in 204 ms,
# level 15 16.6x in 1.6 s. The seal is off the reports' path, so the middle.
ZSTD_LEVEL = 10
SEAL_BATCH = 50
SEAL_STEP_BYTES = 64 * 1024 * 1024  # a step stops after this much text: memory stays bounded
REPEAT = ReportOutcome(False, "nothing new: a repeat, or the log was cut")


def _state(log: BuildLog | None) -> LogState:
    if log is None:
        return LogState()
    return LogState(
        received=log.received,
        length=log.length,
        size_bytes=log.size_bytes,
        at_line_start=log.at_line_start,
        cut=log.cut,
    )


def _piece_build(message: BuildLogPiece) -> uuid.UUID | None:
    """The build a piece is about, or None when it is not its job's: a build job has its own only."""
    key = JobKey.parse(message.job_id, kinds={JobKeyKind.BUILD})
    build_id = parse_uuid(message.build_id)
    return build_id if key is not None and build_id is not None and key.id == build_id else None


def build_log_append(*, worker_id: uuid.UUID, message: BuildLogPiece, now: datetime) -> ReportOutcome:
    """Store what a BuildLog piece adds to its assignment's log of its build, in one transaction. A
    piece that is not about the job's open assignment on this worker, or names a build that is not the
    job's, is dropped; a repeat stores nothing."""
    if _piece_build(message) is None:
        return DROPPED
    with transaction.atomic():
        row = fenced_assignment(
            worker_id=worker_id, job_key=message.job_id, assignment_id=message.assignment_id
        )
        if row is None:
            return DROPPED
        return build_log_append_fenced(row=row, message=message, now=now)


def build_log_append_fenced(*, row: DispatchedJob, message: BuildLogPiece, now: datetime) -> ReportOutcome:
    """build_log_append for a piece whose assignment `row` the caller has fenced and locked, in the
    caller's transaction (a batch of reports)."""
    build_id = _piece_build(message)
    if build_id is None:
        return DROPPED
    worker_id = row.worker_id
    log = BuildLog.objects.filter(assignment_id=row.id, build_id=build_id).first()
    state = _state(log)
    # PostgreSQL text holds no NUL; one character for one keeps every offset where it was.
    data = message.data.replace("\x00", "\ufffd")
    max_bytes, cut_text = (
        (state.size_bytes, None) if state.cut else _log_budget(worker_id, build_id, row.id, state, now)
    )
    step = append_piece(state, offset=message.offset, data=data, max_bytes=max_bytes, cut_text=cut_text)
    if step.state == state:
        return REPEAT
    new = step.state
    _count_worker_bytes(worker_id, new.size_bytes - state.size_bytes, now)
    fields = {
        "received": new.received,
        "length": new.length,
        "size_bytes": new.size_bytes,
        "at_line_start": new.at_line_start,
        "cut": new.cut,
    }
    if log is None:
        log = BuildLog.objects.create(build_id=build_id, assignment_id=row.id, **fields)
    else:
        BuildLog.objects.filter(id=log.id).update(updated_at=now, **fields)
    if step.text:
        BuildLogChunk.objects.create(log_id=log.id, start=state.length, data=step.text)
    return ReportOutcome(True, f"log: {len(step.text)} characters stored")


# --- The caps beyond one log's own (issue 25, finding 3) ------------------------------------------------
# A worker that takes a build, logs and fails it `canceled` in a loop (canceled spends no attempt, and
# each try starts a log of its own) stored 125 MiB in 30 s. So the logs of all tries of one build are
# capped together, and so are one worker's log bytes per hour, counted in `rate_counter`
# (runtime.counters, as the throttles count: the window starts at its first hit and lasts an hour) so
# every `serve` process shares the count. Counted in KiB: the column is a 32-bit integer.

_WORKER_KEY = "log-bytes\x1f{worker_id}"
_HOUR_SECS = 3600


def _worker_bytes_this_hour(worker_id: uuid.UUID, now: datetime) -> int:
    hits, _ = counters.hit(_WORKER_KEY.format(worker_id=worker_id), _HOUR_SECS, now=now, add=0)
    return hits * 1024


def _count_worker_bytes(worker_id: uuid.UUID, size: int, now: datetime) -> None:
    if size <= 0 or settings.GRADIENT_BUILD_LOG_MAX_BYTES_PER_WORKER_HOUR <= 0:
        return
    counters.hit(_WORKER_KEY.format(worker_id=worker_id), _HOUR_SECS, now=now, add=-(-size // 1024))


def _log_budget(
    worker_id: uuid.UUID, build_id: uuid.UUID, assignment_id: uuid.UUID, state: LogState, now: datetime
) -> tuple[int, str | None]:
    """The most this log may hold, and the line that says why it was cut when it is not its own cap:
    the least of its own cap, what the build's other tries left of the build's, and what it holds plus
    what this worker has left of its hour (which counts what this log holds already)."""
    own = settings.GRADIENT_BUILD_LOG_MAX_BYTES
    limits: list[tuple[int, str | None]] = [(own, None)]
    per_build = settings.GRADIENT_BUILD_LOG_MAX_BYTES_PER_BUILD
    if per_build > 0:
        others = (
            BuildLog.objects.filter(build_id=build_id)
            .exclude(assignment_id=assignment_id)
            .aggregate(total=Sum("size_bytes"))["total"]
            or 0
        )
        limits.append((max(0, per_build - others), build_cut_line(per_build)))
    per_worker = settings.GRADIENT_BUILD_LOG_MAX_BYTES_PER_WORKER_HOUR
    if per_worker > 0:
        left = max(0, per_worker - _worker_bytes_this_hour(worker_id, now))
        limits.append((state.size_bytes + left, worker_cut_line(per_worker)))
    return min(limits, key=lambda limit: limit[0])


# --- Sealing ------------------------------------------------------------------------------------------


def compress(text: str) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(text.encode())


def decompress(blob: bytes | memoryview) -> str:
    return zstandard.ZstdDecompressor().decompress(bytes(blob)).decode()


def build_log_seal_step(*, now: datetime, batch_size: int = SEAL_BATCH) -> int:
    """Seal one batch of logs whose assignment is closed: the chunks joined into one compressed blob,
    then deleted. Returns how many were sealed (0: nothing left). Rows another process is sealing are
    skipped. A closed assignment gets no more pieces (they are fenced), so its chunks are complete."""
    with transaction.atomic():
        logs = list(
            BuildLog.objects.select_for_update(skip_locked=True, of=("self",))
            .filter(sealed_at__isnull=True, assignment__finished_at__isnull=False)
            .order_by("created_at")
            .only("id", "size_bytes")[:batch_size]
        )
        sealed = done_bytes = 0
        for log in logs:
            text = "".join(
                BuildLogChunk.objects.filter(log_id=log.id).order_by("start").values_list("data", flat=True)
            )
            BuildLog.objects.filter(id=log.id).update(blob=compress(text), sealed_at=now, updated_at=now)
            BuildLogChunk.objects.filter(log_id=log.id).delete()
            sealed += 1
            done_bytes += log.size_bytes
            if done_bytes >= SEAL_STEP_BYTES:
                break  # the rest in the next step
        return sealed


def build_log_seal_pass(*, now: datetime) -> int:
    """Every pass interval: seal every log of a closed assignment. Returns how many."""
    sealed = 0
    while step := build_log_seal_step(now=now):
        sealed += step
    return sealed


# --- Reading ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogText:
    """What a reader gets of one log: the text from `offset` on, and whether the log is complete (its
    assignment is closed: nothing more will arrive)."""

    log_id: int
    assignment_id: uuid.UUID
    offset: int
    text: str
    complete: bool
    cut: bool


def _text_from(log: BuildLog, offset: int) -> str:
    if log.sealed_at is not None and log.blob is not None:
        return decompress(log.blob)[offset:]
    chunks = list(
        BuildLogChunk.objects.filter(log_id=log.id, start__gte=_first_chunk_start(log.id, offset))
        .order_by("start")
        .values_list("start", "data")
    )
    if not chunks:
        return ""
    first_start = chunks[0][0]
    return "".join(data for _, data in chunks)[max(0, offset - first_start) :]


def _first_chunk_start(log_id: int, offset: int) -> int:
    """The start of the chunk holding character `offset` (0 when before every chunk)."""
    start = (
        BuildLogChunk.objects.filter(log_id=log_id, start__lte=offset)
        .order_by("-start")
        .values_list("start", flat=True)
        .first()
    )
    return start or 0


def latest_log(build: DerivationBuild) -> BuildLog | None:
    """The log of the build's latest assignment that sent one."""
    return (
        BuildLog.objects.filter(build=build)
        .select_related("assignment")
        .order_by("-assignment__dispatched_at", "-created_at")
        .first()
    )


def _log_of(build: DerivationBuild, assignment_id: uuid.UUID | None) -> BuildLog | None:
    if assignment_id is None:
        return latest_log(build)
    return (
        BuildLog.objects.filter(build=build, assignment_id=assignment_id).select_related("assignment").first()
    )


def build_log_read(*, build: DerivationBuild, assignment_id: uuid.UUID | None, offset: int) -> LogText | None:
    """The build's log (the latest assignment's that sent one, or `assignment_id`'s) from character
    `offset` on, or None when there is no such log."""
    log = _log_of(build, assignment_id)
    if log is None:
        return None
    # The state before the text: a piece arriving in between makes the text longer, never shorter. A
    # log sealed in between (its chunks gone) is read again, from its blob.
    complete = log.assignment.finished_at is not None
    text = _text_from(log, offset)
    if log.sealed_at is None and len(text) < log.length - offset:
        log.refresh_from_db()
        text = _text_from(log, offset)
    return LogText(
        log_id=log.id,
        assignment_id=log.assignment_id,
        offset=offset,
        text=text,
        complete=complete,
        cut=log.cut,
    )


def build_log_tail(*, build: DerivationBuild, lines: int = 25) -> str:
    """The last `lines` lines of the build's latest log ("" without one): what the console shows
    beside a failure."""
    log = latest_log(build)
    if log is None:
        return ""
    # The tail is in the last few chunks; read back until enough lines are in.
    if log.sealed_at is not None and log.blob is not None:
        return tail_lines(decompress(log.blob), lines)
    text = ""
    for data in BuildLogChunk.objects.filter(log_id=log.id).order_by("-start").values_list("data", flat=True):
        text = data + text
        if text.count("\n") > lines:
            break
    return tail_lines(text, lines)


def build_log_window(*, build: DerivationBuild, max_chars: int = 64 * 1024) -> LogText | None:
    """The end of the build's latest log, at most `max_chars` characters from a line's start: what the
    console shows first (the whole log is a click away, and it follows from `offset + len(text)`)."""
    log = latest_log(build)
    if log is None:
        return None
    start = max(0, log.length - max_chars)
    found = build_log_read(build=build, assignment_id=log.assignment_id, offset=start)
    if found is None or start == 0:
        return found
    cut = found.text.find("\n")
    if cut < 0 or cut + 1 >= len(found.text):
        return found
    return LogText(
        log_id=found.log_id,
        assignment_id=found.assignment_id,
        offset=start + cut + 1,
        text=found.text[cut + 1 :],
        complete=found.complete,
        cut=found.cut,
    )


PIECE_BYTES = 64 * 1024


def _pieces(log: BuildLog) -> Iterator[str]:
    """The log's text in pieces, in order, never all of it at once: a sealed log decompressed as a
    stream, an open one's chunks fetched a few at a time (a server-side cursor)."""
    if log.sealed_at is not None and log.blob is not None:
        reader = zstandard.ZstdDecompressor().stream_reader(bytes(log.blob))
        decoder = codecs.getincrementaldecoder("utf-8")()
        while block := reader.read(PIECE_BYTES):
            yield decoder.decode(block)
        yield decoder.decode(b"", final=True)
        return
    chunks = BuildLogChunk.objects.filter(log_id=log.id).order_by("start").values_list("data", flat=True)
    yield from chunks.iterator(chunk_size=32)


@dataclass(frozen=True)
class LogLines:
    """Numbered lines of one log, as a LineQuery picked them; `more` when ?q= matched more than
    MAX_MATCHES lines (the first ones are here)."""

    assignment_id: uuid.UUID
    complete: bool
    lines: list[tuple[int, str]]
    more: bool


def build_log_lines(
    *, build: DerivationBuild, assignment_id: uuid.UUID | None, query: LineQuery
) -> LogLines | None:
    """The lines of the build's log (as build_log_read picks the log) that `query` asks for, read from
    the stored chunks or the sealed blob piece by piece, stopping past the last line wanted; None
    without such a log."""
    log = _log_of(build, assignment_id)
    if log is None:
        return None
    complete = log.assignment.finished_at is not None
    lines: list[tuple[int, str]] = []
    more = False
    for numbered in select_lines(_pieces(log), query):
        if len(lines) == MAX_MATCHES:
            more = True
            break
        lines.append(numbered)
    return LogLines(assignment_id=log.assignment_id, complete=complete, lines=lines, more=more)
