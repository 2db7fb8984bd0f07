"""When a waiting job is expected to start and end: plain arithmetic over counts and past durations.

The model is deliberately simple (spec/rest.md "Where a waiting job stands"): every job takes the
typical duration; the slots that can run the job turn over in waves; a busy slot is taken to be
halfway through its job. So a job with `ahead` jobs before it and `free = slots - busy` idle slots
starts now when `ahead < free`, else after `0.5 + (ahead - free) // slots` typical durations.

The typical duration is the median of past attempts: of the same derivation name and system when
there are any (basis `derivation`), else of the project's builds (`project`), else a configured default
(`default`). With no slot that can run the job there is no estimate at all (`none`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

Basis = Literal["derivation", "project", "default", "none"]
BASES: tuple[Basis, ...] = ("derivation", "project", "default", "none")


@dataclass(frozen=True, slots=True)
class Typical:
    secs: float
    basis: Basis


@dataclass(frozen=True, slots=True)
class Estimate:
    expected_start: datetime | None
    expected_finish: datetime | None
    basis: Basis


NO_ESTIMATE = Estimate(expected_start=None, expected_finish=None, basis="none")


def median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def typical_duration(
    derivation_secs: Sequence[float], project_secs: Sequence[float], default_secs: float
) -> Typical:
    """The duration a job is taken to last, and what that rests on: the first of the derivation's own
    past attempts, the project's, or the default that has any."""
    if (m := median(derivation_secs)) is not None:
        return Typical(m, "derivation")
    if (m := median(project_secs)) is not None:
        return Typical(m, "project")
    return Typical(max(0.0, default_secs), "default")


def start_delay_secs(*, ahead: int, slots: int, busy: int, typical_secs: float) -> float:
    """How long until a job with `ahead` jobs before it starts on `slots` slots, `busy` of them taken
    (see the module's docstring). Precondition: slots > 0."""
    free = max(0, slots - min(busy, slots))
    if ahead < free:
        return 0.0
    return typical_secs * (0.5 + (ahead - free) // slots)


def queue_estimate(*, now: datetime, ahead: int, slots: int, busy: int, typical: Typical) -> Estimate:
    """A waiting job's expected start and end; NO_ESTIMATE when no slot can run it."""
    if slots <= 0:
        return NO_ESTIMATE
    start = now + timedelta(
        seconds=start_delay_secs(ahead=ahead, slots=slots, busy=busy, typical_secs=typical.secs)
    )
    return Estimate(
        expected_start=start, expected_finish=start + timedelta(seconds=typical.secs), basis=typical.basis
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
