"""Running totals behind the counters and histograms of GET /metrics, kept in the database so that
every process (each `serve`, each Celery worker) answers with the service's figures.

Each process adds to its own row per (name, labels) (`metric_count`, keyed by hostname:pid too), so no
two processes ever wait on one row; a reader sums the rows. An addition is made after the caller's
transaction commits (work that rolled back is not counted). Gauges need no totals: /metrics counts
the rows they describe when it is asked.
"""

from __future__ import annotations

import os
import socket
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Final

from django.db import connection, transaction
from django.db.models import Sum

from gradient.recovery.models import MetricCount

PASS_DURATION: Final = "gradient_pass_duration_seconds"
CLAIMS_LOST: Final = "gradient_claims_lost_total"
# Derivations of an eval_result refused because the server holds their path otherwise (issue 36). Kept
# in metric_count, not yet a family of GET /metrics: rest.md lists those families exactly.
DERIVATION_CONFLICTS: Final = "gradient_derivation_conflicts_total"
# Passes take milliseconds to a few seconds; a pass slower than a minute is a problem to see.
PASS_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_UPSERT = (
    "INSERT INTO metric_count (name, labels, process, value) VALUES (%s, %s, %s, %s) "
    "ON CONFLICT (name, labels, process) DO UPDATE SET value = metric_count.value + excluded.value"
)


def _process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def labels_text(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={labels[k]}" for k in sorted(labels))


def labels_of(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.split(",") if part)


def _add_now(rows: Sequence[tuple[str, str, float]]) -> None:
    process = _process()
    with transaction.atomic(), connection.cursor() as cursor:
        for name, labels, amount in rows:
            cursor.execute(_UPSERT, [name, labels, process, amount])


def _add(rows: Sequence[tuple[str, str, float]]) -> None:
    transaction.on_commit(lambda: _add_now(rows), robust=True)


def count(name: str, labels: Mapping[str, str] | None = None, amount: float = 1.0) -> None:
    """Add `amount` to counter `name` (a `_total` name) once the caller's transaction commits."""
    _add([(name, labels_text(labels or {}), amount)])


def observe(name: str, value: float, labels: Mapping[str, str], buckets: Sequence[float]) -> None:
    """One observation of histogram `name`: its buckets (cumulative, `le`), `_sum` and `_count`."""
    base = labels_text(labels)
    rows = [(f"{name}_bucket", labels_text({**labels, "le": _le(b)}), 1.0) for b in buckets if value <= b]
    rows += [
        (f"{name}_bucket", labels_text({**labels, "le": "+Inf"}), 1.0),
        (f"{name}_sum", base, value),
        (f"{name}_count", base, 1.0),
    ]
    _add(rows)


def _le(bound: float) -> str:
    return repr(float(bound))


def totals() -> dict[str, dict[str, float]]:
    """Every total, summed over the processes: {name: {labels text: value}}."""
    result: dict[str, dict[str, float]] = defaultdict(dict)
    rows = MetricCount.objects.order_by().values("name", "labels").annotate(total=Sum("value"))
    for row in rows:
        result[row["name"]][row["labels"]] = float(row["total"] or 0)
    return result


RETIRED: Final = "retired"
_TAKE = "DELETE FROM metric_count WHERE process <> %s RETURNING name, labels, value"


def compact() -> int:
    """Fold every process's rows into one `retired` row per (name, labels), so rows do not pile up with
    each restart. Safe while processes add: a row is deleted and its value moved in one statement each
    (an addition racing it lands before the delete, and is moved, or after, in a fresh row). Totals are
    unchanged. Returns how many rows were folded."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(_TAKE, [RETIRED])
        taken = cursor.fetchall()
        folded: dict[tuple[str, str], float] = defaultdict(float)
        for name, labels, value in taken:
            folded[(name, labels)] += float(value)
        for (name, labels), value in folded.items():
            cursor.execute(_UPSERT, [name, labels, RETIRED, value])
    return len(taken)
