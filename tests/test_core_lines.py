"""At most one log line per key per interval (gradient.core.lines), each saying how many it stands for."""

from __future__ import annotations

from gradient.core.lines import LineEvery


def test_one_line_per_key_per_interval_with_the_count_of_those_left_unlogged() -> None:
    lines = LineEvery(every_secs=10.0)
    assert lines.due("a", 0.0) == 0
    assert [lines.due("a", t) for t in (1.0, 2.0, 9.9)] == [None, None, None]
    assert lines.due("b", 5.0) == 0  # another key has its own interval
    assert lines.due("a", 10.0) == 3
    assert lines.due("a", 25.0) == 0


def test_a_flood_of_distinct_keys_stays_bounded() -> None:
    lines = LineEvery(every_secs=10.0, max_keys=100)
    logged = sum(lines.due(f"k{n}", 0.0) is not None for n in range(1000))
    assert logged == 100 and len(lines._last) == 100
    assert lines.due("late", 11.0) == 0  # the old keys are forgotten once their interval is over
