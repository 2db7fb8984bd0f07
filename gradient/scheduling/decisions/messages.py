"""An evaluation's warnings and errors, capped (issue 25, finding 4): what one more part's messages add
to those kept.

Every part of an eval_result may carry warnings and errors, and they add up (protocol.md, "Large
evaluations"); without a cap, 40 parts of one 900 KB warning made a 34 MiB evaluation row, rewritten at
every part. Each list (warnings, errors) keeps at most `max_count` messages and `max_bytes` bytes of
UTF-8; a message longer than `max_message_bytes` is cut (never within a character) with a note of its
size. Once a message does not fit, it and every later one are left out, and the list ends with one line
saying how many, which later parts update, as the build log's cut line does.

Pure: plain values in, plain values out, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_LEFT_OUT = re.compile(r"^\[\.\.\. (\d+) (?:warnings|errors) left out: ")


@dataclass(frozen=True, slots=True)
class MessageCap:
    max_count: int
    max_bytes: int
    max_message_bytes: int


def left_out_line(count: int, what: str, cap: MessageCap) -> str:
    return (
        f"[... {count} {what} left out: an evaluation keeps at most {cap.max_count} {what} and "
        f"{cap.max_bytes} bytes of them "
        "(GRADIENT_EVAL_MESSAGES_MAX_COUNT, GRADIENT_EVAL_MESSAGES_MAX_BYTES) ...]"
    )


def cut_message(message: str, max_bytes: int) -> str:
    """`message`, or its first `max_bytes` bytes (whole characters) and a note of its whole size."""
    data = message.encode("utf-8", errors="replace")
    if len(data) <= max_bytes:
        return message
    head = data[:max_bytes].decode("utf-8", errors="ignore")
    return f"{head} [... cut: the message was {len(data)} bytes ...]"


def with_messages(kept: Sequence[str], new: Sequence[str], *, what: str, cap: MessageCap) -> list[str]:
    """`kept` (a list this function made) with `new` added within `cap`; `what` is "warnings" or
    "errors", for the left-out line."""
    messages = list(kept)
    left_out = 0
    if messages and (marker := _LEFT_OUT.match(messages[-1])):
        left_out = int(marker.group(1))
        messages.pop()
    if not new and not left_out:
        return messages
    used = sum(len(m.encode("utf-8", errors="replace")) for m in messages)
    for message in new:
        if left_out:
            left_out += 1
            continue
        message = cut_message(str(message), cap.max_message_bytes)
        size = len(message.encode("utf-8", errors="replace"))
        if len(messages) >= cap.max_count or used + size > cap.max_bytes:
            left_out = 1
            continue
        messages.append(message)
        used += size
    if left_out:
        messages.append(left_out_line(left_out, what, cap))
    return messages
