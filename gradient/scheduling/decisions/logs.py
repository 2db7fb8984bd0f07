"""What one BuildLog piece adds to the stored log (../shared/spec/protocol.md, "Build logs").

Two positions are kept apart: the worker's (`received`, in characters of the stream the worker sent:
the piece's `offset` counts in it) and the stored text's (`length`, what a reader's `?offset=` counts
in, which holds the marker lines too). A piece below `received` is a repeat: only its new tail is
stored. A piece beyond it is a gap: a `[... N characters missing ...]` line comes first. The stored
text holds at most `max_bytes` bytes (UTF-8) of the worker's text; then one line says it was cut, and
every later piece is dropped.

Pure: plain values in, plain values out, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

MAX_POSITION = 2**63 - 1  # a position is stored in a 64-bit column


@dataclass(frozen=True, slots=True)
class LogState:
    """What is stored of one assignment's log of one build."""

    received: int = 0  # the worker's position: the next piece should start here
    length: int = 0  # characters stored (the worker's text and the marker lines)
    size_bytes: int = 0  # UTF-8 bytes of the worker's text stored (what the cap counts)
    at_line_start: bool = True  # the stored text is empty or ends with a newline
    cut: bool = False  # the cap was reached: everything later is dropped


@dataclass(frozen=True, slots=True)
class Append:
    """The text to store after what is stored (empty: nothing to store) and the state after it."""

    text: str
    state: LogState


def missing_line(count: int) -> str:
    return f"[... {count} characters missing ...]\n"


def cut_line(max_bytes: int) -> str:
    return f"[... the log was cut here: it reached {max_bytes} bytes (GRADIENT_BUILD_LOG_MAX_BYTES) ...]\n"


def build_cut_line(max_bytes: int) -> str:
    return (
        f"[... the log was cut here: the logs of all tries of this build reached {max_bytes} bytes "
        "(GRADIENT_BUILD_LOG_MAX_BYTES_PER_BUILD) ...]\n"
    )


def worker_cut_line(max_bytes: int) -> str:
    return (
        f"[... the log was cut here: this worker's logs reached {max_bytes} bytes within an hour "
        "(GRADIENT_BUILD_LOG_MAX_BYTES_PER_WORKER_HOUR) ...]\n"
    )


def _prefix_within(text: str, budget: int) -> str:
    """The longest prefix of `text` whose UTF-8 encoding fits in `budget` bytes."""
    if budget <= 0:
        return ""
    if len(text) * 4 <= budget:
        return text
    encoded = text.encode()
    if len(encoded) <= budget:
        return text
    return encoded[:budget].decode(errors="ignore")  # a character cut in two is left out


def append_piece(
    state: LogState, *, offset: int, data: str, max_bytes: int, cut_text: str | None = None
) -> Append:
    """The piece at `offset` with `data`, applied to `state`. `cut_text` is the line that ends a cut
    log (`cut_line(max_bytes)` unless another cap than the log's own is the one reached)."""
    if state.cut or state.received >= MAX_POSITION:
        return Append("", state)
    end = offset + len(data)
    if end <= state.received:
        return Append("", state)  # a repeat of what is held: nothing new
    marker = ""
    if offset > state.received:
        marker = ("" if state.at_line_start else "\n") + missing_line(offset - state.received)
    else:
        data = data[state.received - offset :]
    budget = max_bytes - state.size_bytes
    kept = _prefix_within(data, budget)
    cut = len(kept) < len(data)
    text = marker + kept
    if cut:
        ends_line = text.endswith("\n") or (not text and state.at_line_start)
        text += ("" if ends_line else "\n") + (cut_text or cut_line(max_bytes))
    kept_bytes = len(kept.encode()) if kept else 0
    at_line_start = text.endswith("\n") if text else state.at_line_start
    return Append(
        text,
        LogState(
            received=min(end, MAX_POSITION),
            length=state.length + len(text),
            size_bytes=state.size_bytes + kept_bytes,
            at_line_start=at_line_start,
            cut=cut,
        ),
    )


# Terminal escapes: CSI sequences (colour `m`, cursor moves, erases), OSC sequences (window titles,
# links; ended by BEL or ST), and a lone ESC before one more character. The log page renders colour
# (templates/member/log.html); the short panes beside an error show the text without them (issue 34,
# item 4: `␛[1;31merror:␛[0m` is not a line a person reads).
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_CARRIAGE = re.compile(r"[^\n]*\r(?=[^\n])")  # a line rewritten in place (progress bars): its last state


def plain_text(text: str) -> str:
    """`text` as a terminal would leave it to read, without colour: escape sequences dropped, a line
    rewritten with carriage returns kept as its last state. Nothing else changes."""
    return _CARRIAGE.sub("", _ESCAPES.sub("", text))


def tail_lines(text: str, count: int) -> str:
    """The last `count` lines of `text` (a trailing newline ends the last line, it opens none)."""
    lines = text.splitlines()
    return "\n".join(lines[-count:]) if count > 0 else ""


# --- Reading lines of a stored log ---------------------------------------------------------------------

MAX_LINE_RANGE = 100_000  # ?lines=a-b spans at most this many lines
MAX_MATCHES = 10_000  # ?q= answers at most this many matching lines


@dataclass(frozen=True, slots=True)
class LineQuery:
    """Which lines a reader wants: numbers `first`..`last` (1-based, inclusive; `last` None: to the end)
    and, with `text`, only those containing it (case-insensitive)."""

    first: int = 1
    last: int | None = None
    text: str = ""


def parse_line_range(raw: str) -> tuple[int, int | None] | str:
    """`120-180`, `120-` (to the end) or `120` (one line) → (first, last); otherwise why not, as a
    message for the 400."""
    head, dash, tail = raw.partition("-")
    if not (head.isascii() and head.isdigit() and len(head) <= 12) or int(head) < 1:
        return "lines must be a-b (line numbers from 1), a- or a single line number."
    first = int(head)
    if not dash:
        return (first, first)
    if tail == "":
        return (first, None)
    if not (tail.isascii() and tail.isdigit() and len(tail) <= 12) or int(tail) < first:
        return "lines must be a-b with b at least a."
    if int(tail) - first + 1 > MAX_LINE_RANGE:
        return f"lines spans at most {MAX_LINE_RANGE} lines; ask for the rest in another request."
    return (first, int(tail))


def select_lines(pieces: Iterable[str], query: LineQuery) -> Iterator[tuple[int, str]]:
    """The numbered lines of the text that `pieces` make up in order (a line may span pieces; a
    trailing newline ends the last line, it opens none), as the query picks them. Reads the pieces
    only as far as it needs: past `last` it stops, so only one piece and one line are held at a time."""
    needle = query.text.casefold()
    number = 0
    partial = ""

    def wanted(n: int, line: str) -> bool:
        return n >= query.first and (not needle or needle in line.casefold())

    for piece in pieces:
        text = partial + piece
        if needle and needle not in text.casefold():
            # No match in this piece: count its lines instead of splitting them (a search reads the
            # whole log; most pieces match nothing).
            end = text.rfind("\n")
            if end >= 0:
                number += text.count("\n", 0, end + 1)
                partial = text[end + 1 :]
                if query.last is not None and number >= query.last:
                    return
            else:
                partial = text
            continue
        parts = text.split("\n")
        partial = parts.pop()
        for line in parts:
            number += 1
            if query.last is not None and number > query.last:
                return
            if wanted(number, line):
                yield number, line
    if partial:
        number += 1
        if (query.last is None or number <= query.last) and wanted(number, partial):
            yield number, partial
