"""Where a waiting job stands, in the console's words (issue 33): the build and evaluation pages' "where
it stands" and an evaluation's expected end, from gradient.scheduling.queue_position (what REST's `queue`
object carries, with the start's range beside it). Times as everywhere in the console: relative, the
exact time on hover, ticking."""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from gradient.console import ago, duration
from gradient.scheduling import queue_position
from gradient.scheduling.models import DerivationBuild, Evaluation

BASIS_WORDS = {
    "derivation": "from past builds of this derivation",
    "project": "from past builds of its project (none of this derivation yet)",
    "default": "no history yet: the configured default duration",
    "none": "",
}
EVAL_BASIS_WORDS = {**BASIS_WORDS, "project": "from its project's past evaluations"}


def _range(now: datetime, low: datetime | None, high: datetime | None) -> str:
    if low is None or high is None or low == high:
        return ""
    earliest = duration(max(0.0, (low - now).total_seconds()))
    return f" (between {earliest} and {duration((high - now).total_seconds())} from now)"


def standing_text(
    standing: queue_position.QueueStanding, now: datetime, *, what: str, basis_words: dict[str, str]
) -> SafeString:
    """`position 3 of the builds the same workers can run (2 ahead) · 1 of 2 slots busy · expected to
    start in 2 min (between 1 min and 4 min from now), to end in 5 min; from past builds of this
    derivation`; `start unknown` without a basis."""
    head = f"position {standing.position} of the {what} the same workers can run ({standing.ahead} ahead)"
    if standing.slots == 0:
        slots = "no connected worker can run it now"
    else:
        slots = f"{standing.busy} of {standing.slots} slots busy"
    if standing.expected_start is None or standing.expected_finish is None:
        why = "no worker can run it" if standing.slots == 0 else "no history and no default duration"
        return format_html("{} · {} · start unknown ({})", head, slots, why)
    start = "now (a slot is free)" if standing.expected_start <= now else ago(standing.expected_start, now)
    return format_html(
        "{} · {} · expected to start {}{}, to end {}; {}",
        head,
        slots,
        start,
        _range(now, standing.earliest_start, standing.latest_start),
        ago(standing.expected_finish, now),
        basis_words[standing.basis],
    )


def build_standing(build: DerivationBuild) -> SafeString | str:
    now = timezone.now()
    standing = queue_position.build_queue(build, now)
    if standing is None:
        return ""
    return standing_text(standing, now, what="builds", basis_words=BASIS_WORDS)


def evaluation_standing(evaluation: Evaluation) -> SafeString | str:
    now = timezone.now()
    standing = queue_position.evaluation_queue(evaluation, now)
    if standing is None:
        return ""
    return standing_text(standing, now, what="evaluations of its project", basis_words=EVAL_BASIS_WORDS)


def evaluation_expected_end(evaluation: Evaluation) -> SafeString | str:
    """While it builds: when its last build is expected to end (its remaining builds' critical path over
    the slots)."""
    now = timezone.now()
    finish = queue_position.evaluation_expected_finish(evaluation, now)
    if finish is None:
        return "unknown (no worker can run its builds, or no history and no default duration)"
    return format_html("{} (its remaining builds' critical path over the build slots)", ago(finish, now))
