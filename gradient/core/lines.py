"""Log lines: at most one per key per interval (`LineEvery`), and an error in one line (`first_line`).

At most one log line per key per interval: for what a client can make the service log (a refused
connection, a timed-out request), so a flood costs a few lines, each saying how many it stands for.

Pure but for its own memory: `now` is passed in (a monotonic clock's seconds)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LineEvery:
    """`due(key, now)`: None while `key` had a line less than `every_secs` ago (that call is counted),
    else how many calls since its last line went unlogged (0 for the first); then log one. Keys whose
    interval has passed are forgotten now and then, so a flood of distinct keys stays bounded."""

    every_secs: float
    max_keys: int = 10_000
    _last: dict[str, tuple[float, int]] = field(default_factory=dict)

    def due(self, key: str, now: float) -> int | None:
        last = self._last.get(key)
        if last is not None and now - last[0] < self.every_secs:
            self._last[key] = (last[0], last[1] + 1)
            return None
        if len(self._last) >= self.max_keys:
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.every_secs}
            if len(self._last) >= self.max_keys:  # all recent: a flood of keys; keep the line count low
                return None
        self._last[key] = (now, 0)
        return last[1] if last is not None else 0


def first_line(exc: BaseException) -> str:
    """An error in one line, for a log or an answer: its message's first line, or its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
