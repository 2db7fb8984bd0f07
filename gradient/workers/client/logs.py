"""A build's log on its way to the server: BuildLog pieces (../shared/spec/protocol.md, "Build logs").

The executor writes text as the builder prints it (`write`, never blocking, never awaiting); a sender
task sends what has gathered at most every 250 ms, or at once when 16 KiB have gathered, and `close`
sends the rest before the worker reports the build's `build_output` or `JobFailed`. Sending never slows
the build: what the buffer cannot hold while the connection is slow is dropped, and a marker line in
the log says how much. Each piece is at most 16 Ki characters, so at most 64 KiB in UTF-8.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from gradient.core.protocol import BuildLog

log = logging.getLogger("gradient.worker")

SEND_EVERY_SECS = 0.25
PIECE_CHARS = 16 * 1024
BUFFER_CHARS = 1024 * 1024  # what may wait for the connection; beyond it, text is dropped
CLOSE_TIMEOUT_SECS = 10.0


def dropped_line(count: int) -> str:
    return f"[... {count} characters dropped by the worker: the connection could not keep up ...]\n"


class LogStream:
    """One build's log of one assignment. `offset` counts the characters sent so far."""

    def __init__(
        self,
        send: Callable[[BuildLog], Awaitable[None]],
        *,
        job_id: str,
        assignment_id: str,
        build_id: str,
        every_secs: float = SEND_EVERY_SECS,
        piece_chars: int = PIECE_CHARS,
        buffer_chars: int = BUFFER_CHARS,
    ) -> None:
        self._send = send
        self.job_id = job_id
        self.assignment_id = assignment_id
        self.build_id = build_id
        self.every_secs = every_secs
        self.piece_chars = piece_chars
        self.buffer_chars = buffer_chars
        self.offset = 0
        self.dropped = 0  # characters dropped in all
        self._pending: list[str] = []
        self._pending_chars = 0
        self._dropping = 0  # characters dropped since the last send: the marker line to come
        self._wake = asyncio.Event()
        self._closed = False
        self._broken = False
        self._task: asyncio.Task[None] | None = None

    def write(self, text: str) -> None:
        """Add the builder's output. Never blocks: when the buffer is full the text is dropped (and,
        once the buffer drains, a marker line says how much)."""
        if self._closed or self._broken or not text:
            return
        if self._dropping or self._pending_chars + len(text) > self.buffer_chars:
            self._dropping += len(text)  # and everything after it until the next send, to keep order
            self.dropped += len(text)
        else:
            self._pending.append(text)
            self._pending_chars += len(text)
        if self._pending_chars >= self.piece_chars or self._dropping:
            self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"log {self.build_id}")

    async def close(self) -> None:
        """Send what is left and stop (at most CLOSE_TIMEOUT_SECS: the report must not wait for ever)."""
        self._closed = True
        self._wake.set()
        task = self._task
        if task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), CLOSE_TIMEOUT_SECS)
        except TimeoutError:
            task.cancel()
        except Exception:
            log.debug("the log of %s ended with an error", self.build_id, exc_info=True)

    def abandon(self) -> None:
        """The session is gone: stop without sending."""
        self._closed = self._broken = True
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.every_secs)
            self._wake.clear()
            await self._flush()
            if self._closed and not self._pending and not self._dropping:
                return
            if self._broken:
                return

    def _take(self) -> str:
        text = "".join(self._pending)
        self._pending.clear()
        self._pending_chars = 0
        if self._dropping:
            if text and not text.endswith("\n"):
                text += "\n"
            text += dropped_line(self._dropping)
            self._dropping = 0
        return text

    async def _flush(self) -> None:
        text = self._take()
        for start in range(0, len(text), self.piece_chars):
            piece = text[start : start + self.piece_chars]
            try:
                await self._send(
                    BuildLog(
                        job_id=self.job_id,
                        assignment_id=self.assignment_id,
                        build_id=self.build_id,
                        offset=self.offset,
                        data=piece,
                    )
                )
            except Exception as exc:  # the connection is gone: nobody to send the rest to
                log.debug("sending the log of %s failed: %s", self.build_id, exc)
                self._broken = True
                return
            self.offset += len(piece)
