"""Where a waiting job stands, in the console's words (issue 33): the build and evaluation pages' "where
it stands" and an evaluation's expected end, from gradient.scheduling.queue_position (what REST's `queue`
object carries, with the start's range beside it). Times as everywhere in the console: relative, the
exact time on hover, ticking."""

from __future__ import annotations

from datetime import datetime

from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
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


def _free_at(at: datetime, now: datetime) -> SafeString | str:
    return "now" if at <= now else ago(at, now)


def _busy_until(standing: queue_position.QueueStanding, now: datetime) -> SafeString | str:
    """`, the first expected to free in 20 s, the last in 3 min` (each busy slot's job: its start plus
    its typical duration); nothing when none is busy or there is nothing to go on."""
    if standing.busy == 0 or standing.next_free is None or standing.busy_until is None:
        return ""
    if standing.busy == 1 or standing.busy_until == standing.next_free:
        return format_html(", expected to free {}", _free_at(standing.next_free, now))
    return format_html(
        ", the first expected to free {}, the last {}",
        _free_at(standing.next_free, now),
        _free_at(standing.busy_until, now),
    )


def _cluster_link(cluster: object) -> SafeString:
    url = reverse("admin:clusters_clusterjob_change", args=[str(cluster)])
    return format_html('<a href="{}">a cluster</a>', url)


def _holders(standing: queue_position.QueueStanding, now: datetime) -> SafeString | str:
    """` (1 running a cluster's members; 2 free ones held for a cluster waiting to be placed, until in
    3 min)`, each cluster linked; nothing when no cluster holds any."""
    parts = []
    for holder in standing.holders:
        if holder.running:
            parts.append(format_html("{} running {}'s members", holder.slots, _cluster_link(holder.cluster)))
        else:
            until = format_html(", until {}", ago(holder.until, now)) if holder.until is not None else ""
            parts.append(
                format_html(
                    "{} free one{} held for {} waiting to be placed{}",
                    holder.slots,
                    "" if holder.slots == 1 else "s",
                    _cluster_link(holder.cluster),
                    until,
                )
            )
    if not parts:
        return ""
    return format_html(" ({})", format_html_join("; ", "{}", ((p,) for p in parts)))


def standing_text(
    standing: queue_position.QueueStanding, now: datetime, *, what: str, basis_words: dict[str, str]
) -> SafeString:
    """`position 3 of the builds the same workers can run (2 ahead) · 1 of 2 slots busy, expected to
    free in 40 s · expected to start in 2 min (between 1 min and 4 min from now), to end in 5 min; from
    past builds of this derivation`; `start unknown` without a basis. Clusters holding slots are named
    after the busy count (_holders)."""
    head = f"position {standing.position} of the {what} the same workers can run ({standing.ahead} ahead)"
    if standing.slots == 0:
        slots: SafeString | str = "no connected worker can run it now"
    else:
        slots = format_html(
            "{} of {} slots busy{}{}",
            standing.busy,
            standing.slots,
            _busy_until(standing, now),
            _holders(standing, now),
        )
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
