"""A cluster's waiting reason in words: each code reads as a sentence with its details."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradient.clusters.decisions.waiting_text import describe_cluster_waiting


@pytest.mark.parametrize(
    ("reason", "words"),
    [
        (None, ""),
        (
            {"code": "no_seat", "members": [{"role": "server", "index": 0, "reason": "no_idle_slot"}]},
            "No seat for every member: server[0]: no connected worker that could take it is idle.",
        ),
        (
            {
                "code": "no_seat",
                "members": [{"role": "db", "index": 1, "reason": "pin_not_idle", "pin": "w7"}],
            },
            "No seat for every member: db[1]: its pinned worker is not idle (w7).",
        ),
        (
            {"code": "too_few_workers", "needed": 3, "seatable_workers": 2},
            "Too few workers: 3 distinct workers needed, 2 could seat a member.",
        ),
        (
            {"code": "no_zone_fits", "zones": [{"zone": "eu-1", "seatable_workers": 1, "members": 2}]},
            "No single zone can seat every member: zone eu-1: 1 of 2 workers.",
        ),
        (
            {"code": "backoff", "prepare_failures": 2, "until": "2026-01-01T00:00:00+00:00"},
            "Backing off after 2 failed prepares: not placed again before 2026-01-01T00:00:00+00:00.",
        ),
        ({"code": "reserved"}, "Waiting for the cluster holding the reservation to start."),
        (
            {"code": "member_cannot_start", "blocked": [{"role": "a", "index": 0}]},
            "A member's job cannot start yet: a[0].",
        ),
        ({"code": "something_new", "detail": "x"}, "Waiting: something_new. (x)"),
    ],
)
def test_each_code_reads_as_a_sentence(reason: dict[str, Any] | None, words: str) -> None:
    assert describe_cluster_waiting(reason) == words


@given(
    st.dictionaries(st.sampled_from(["code", "members", "zones", "blocked", "needed", "until"]), st.text())
)
def test_a_reason_of_unexpected_shape_still_reads_without_raising(reason: dict[str, Any]) -> None:
    assert isinstance(describe_cluster_waiting(reason), str)
