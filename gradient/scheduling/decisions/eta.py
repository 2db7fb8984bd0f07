"""When a waiting job is expected to start and end: plain arithmetic over counts and past durations.

The model is deliberately simple (spec/rest.md "Where a waiting job stands"): the slots that can run the
job are a pool that turns over at `slots / d` jobs a second, `d` the mean duration of the jobs it runs
(the jobs ahead: its project's recent builds, else the job's own typical duration), a busy slot halfway
through its job. So a job with `ahead` jobs before it and `free = slots - busy` idle slots starts now
when `ahead < free`, else after `d * (ahead - free + 0.5) / slots`; it ends one typical duration of its
own later. (With one slot: half of the running job, then each job ahead in full.)

The typical duration is the median of past attempts: of the same derivation name and system when
there are any (basis `derivation`), else of the project's builds (`project`), else a configured default
(`default`). With no slot that can run the job, or no history and no default (a default of 0 turns it
off), there is no estimate at all (`none`): the job's start is unknown.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

Basis = Literal["derivation", "project", "default", "none"]
BASES: tuple[Basis, ...] = ("derivation", "project", "default", "none")


@dataclass(frozen=True, slots=True)
class Typical:
    secs: float
    basis: Basis
    # The spread of the same sample (its 10th and 90th percentiles): the estimate's range. A default
    # has no spread (low = high = secs): the console says it rests on no history instead.
    low_secs: float | None = None
    high_secs: float | None = None

    @property
    def low(self) -> float:
        return self.secs if self.low_secs is None else self.low_secs

    @property
    def high(self) -> float:
        return self.secs if self.high_secs is None else self.high_secs


@dataclass(frozen=True, slots=True)
class Estimate:
    expected_start: datetime | None
    expected_finish: datetime | None
    basis: Basis
    # The range of the start: the same arithmetic with the sample's 10th and 90th percentiles.
    earliest_start: datetime | None = None
    latest_start: datetime | None = None


NO_ESTIMATE = Estimate(expected_start=None, expected_finish=None, basis="none")


def median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank q-quantile (0 < q <= 1) of `values`; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _typical(values: Sequence[float], basis: Basis) -> Typical | None:
    m = median(values)
    if m is None:
        return None
    return Typical(m, basis, percentile(values, 0.1), percentile(values, 0.9))


def typical_duration(
    derivation_secs: Sequence[float], project_secs: Sequence[float], default_secs: float
) -> Typical:
    """The duration a job is taken to last, and what that rests on: the first of the derivation's own
    past attempts, the project's, or the default that has any; `none` without history and with no
    default (0 or less)."""
    if (t := _typical(derivation_secs, "derivation")) is not None:
        return t
    if (t := _typical(project_secs, "project")) is not None:
        return t
    if default_secs <= 0:
        return Typical(0.0, "none")
    return Typical(default_secs, "default")


def start_delay_secs(*, ahead: int, slots: int, busy: int, typical_secs: float) -> float:
    """How long until a job with `ahead` jobs before it starts on `slots` slots, `busy` of them taken,
    the jobs ahead and running lasting `typical_secs` on average (see the module's docstring).
    Precondition: slots > 0."""
    free = max(0, slots - min(busy, slots))
    if ahead < free:
        return 0.0
    return typical_secs * (ahead - free + 0.5) / slots


def queue_estimate(
    *,
    now: datetime,
    ahead: int,
    slots: int,
    busy: int,
    typical: Typical,
    ahead_typical: Typical | None = None,
) -> Estimate:
    """A waiting job's expected start and end; NO_ESTIMATE when no slot can run it or nothing to go on.
    `typical`: the job's own duration; `ahead_typical`: that of the jobs ahead and running (their mean
    and its spread; the job's own when None or without basis)."""
    if slots <= 0 or typical.basis == "none":
        return NO_ESTIMATE
    pool = typical if ahead_typical is None or ahead_typical.basis == "none" else ahead_typical

    def start(secs: float) -> datetime:
        return now + timedelta(
            seconds=start_delay_secs(ahead=ahead, slots=slots, busy=busy, typical_secs=secs)
        )

    expected = start(pool.secs)
    return Estimate(
        expected_start=expected,
        expected_finish=expected + timedelta(seconds=typical.secs),
        basis=typical.basis,
        earliest_start=start(pool.low),
        latest_start=start(pool.high),
    )


HANDOUT_GAP_MAX_SECS = 5.0
"""A worker's gap between the end of one try and the start of its next longer than this is idleness
(nothing to run), not the cost of a hand-out."""


def slot_turnover(tries: Sequence[tuple[Hashable, float, float]], basis: Basis) -> Typical | None:
    """What a slot spends on each job: the mean of the tries' durations plus the mean gap between a
    worker's try and its next one in the sample (the hand-out: the worker's report, its RequestJob,
    the claim; short gaps only). `tries`: (worker, start, end) in seconds of any epoch. p10/p90 of the
    durations, shifted by the same gap, are its range. A try without a worker (None: its worker is
    gone, or it was never one's) counts in the durations but has no gap: tries of different workers
    chained as if one had run them all made up gaps between them."""
    if not tries:
        return None
    durations = [end - start for _, start, end in tries]
    by_worker: dict[Hashable, list[tuple[float, float]]] = {}
    for worker, start, end in tries:
        if worker is not None:
            by_worker.setdefault(worker, []).append((start, end))
    gaps = []
    for spans in by_worker.values():
        spans.sort()
        for (_, end), (next_start, _) in zip(spans, spans[1:], strict=False):
            if 0.0 <= next_start - end <= HANDOUT_GAP_MAX_SECS:
                gaps.append(next_start - end)
    gap = sum(gaps) / len(gaps) if gaps else 0.0
    low, high = percentile(durations, 0.1), percentile(durations, 0.9)
    return Typical(
        sum(durations) / len(durations) + gap,
        basis,
        None if low is None else low + gap,
        None if high is None else high + gap,
    )


def longest_chain(edges: Sequence[tuple[str, str]], nodes: Sequence[str]) -> int:
    """The most builds on one path of dependencies among `nodes` (edges (build, dependency), both in
    `nodes`): the critical path counted in builds. 0 without nodes."""
    needs: dict[str, list[str]] = {n: [] for n in nodes}
    for build, dependency in edges:
        if build in needs and dependency in needs:
            needs[build].append(dependency)
    depth: dict[str, int] = {}
    entered: set[str] = set()  # a cycle (never in a valid graph) is cut where it closes
    for root in needs:
        stack: list[tuple[str, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in depth:
                continue
            if expanded:
                depth[node] = 1 + max((depth.get(d, 0) for d in needs[node]), default=0)
                continue
            if node in entered:
                continue
            entered.add(node)
            stack.append((node, True))
            stack.extend((d, False) for d in needs[node] if d not in depth)
    return max(depth.values(), default=0)


def evaluation_finish(
    *, now: datetime, remaining: int, chain: int, slots: int, typical_secs: float
) -> datetime | None:
    """When a Building evaluation's last build is expected to end: its remaining builds take at least
    their critical path (`chain` builds one after another) and at least their work spread over the
    slots. None when no slot can run them; `now` when none remain."""
    if remaining <= 0:
        return now
    if slots <= 0:
        return None
    waves = max(chain, math.ceil(remaining / slots))
    return now + timedelta(seconds=typical_secs * waves)
