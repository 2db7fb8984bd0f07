"""What PostgreSQL's plans did (auto_explain, on this test's connection): for tests that a statement's
plan handles rows in proportion to its work whatever the tables' statistics say (issue 30: planned on
statistics taken while the tables were empty, the queueing read the evaluation's links once per build)."""

from __future__ import annotations

import json
from typing import Any

from django.db import connection


class PlanWork:
    """Every statement's executed plan (auto_explain, as JSON notices to this connection): the most rows
    one plan node handled, all its loops together (rows returned and removed by its filters). A plan
    made on statistics that say a table is empty when it holds N rows reads N rows N times."""

    def __init__(self, only: str = "") -> None:
        self.worst = (0, "")
        self.only = only  # only the statements whose text holds this

    def __enter__(self) -> PlanWork:
        connection.ensure_connection()
        with connection.cursor() as cur:
            cur.execute(
                "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0; "
                "SET auto_explain.log_analyze = on; SET auto_explain.log_format = json; "
                "SET auto_explain.log_level = notice; SET auto_explain.log_timing = off; "
                # The statements of triggers and functions too (the change feed's trigger on new links
                # was such a plan: migration 0014).
                "SET auto_explain.log_nested_statements = on"
            )
        connection.connection.add_notice_handler(self._notice)
        return self

    def __exit__(self, *exc: object) -> None:
        connection.connection.remove_notice_handler(self._notice)
        with connection.cursor() as cur:
            cur.execute("SET auto_explain.log_min_duration = -1")

    def _notice(self, diag: Any) -> None:
        text = diag.message_primary or ""
        if "plan:" not in text:
            return
        plan = json.loads(text.split("plan:", 1)[1])
        if self.only not in plan.get("Query Text", ""):
            return
        self._walk(plan["Plan"], plan.get("Query Text", ""))

    def _walk(self, node: dict[str, Any], query: str) -> None:
        loops = node.get("Actual Loops", 1)
        handled = loops * (
            node.get("Actual Rows", 0)
            + node.get("Rows Removed by Filter", 0)
            + node.get("Rows Removed by Join Filter", 0)
            + node.get("Rows Removed by Index Recheck", 0)
        )
        if handled > self.worst[0]:
            scan = " ".join(
                str(node.get(k, "")) for k in ("Node Type", "Index Name", "Relation Name", "Filter")
            )
            self.worst = (int(handled), f"{scan} in {query[:300]}")
        for child in node.get("Plans", []):
            self._walk(child, query)


# The tables an ingest and its decision write, and those their statements read.
INGEST_TABLES = (
    "derivation_build",
    "derivation_build_dependency",
    "evaluation_build",
    "eval_ingest",
    "eval_ingest_input",
    "cached_path",
    "cached_path_claim",
)


def new_installation() -> None:
    """The ingest's tables as on a new installation: physically empty (TRUNCATE, in the test's transaction:
    a reused test database's tables keep the pages of the rows earlier tests rolled back, and a plan made
    on many pages is another plan) and every plan this connection keeps made anew (DISCARD PLANS: a
    PL/pgSQL trigger keeps its statements' plans for the life of the connection). Call before any row of
    the test is written: CASCADE empties what refers to these tables too."""
    with connection.cursor() as cur:
        cur.execute(f"TRUNCATE {', '.join(INGEST_TABLES)} CASCADE")
        cur.execute("DISCARD PLANS")
