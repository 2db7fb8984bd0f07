"""A cluster's waiting reason (WaitingReason.as_json) in words an operator understands, like a
scheduler's "why pending" line. Pure; tolerant of fields it does not know (a reason written by an
older or newer build still reads)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_SHORTAGE = {
    "no_idle_slot": "no connected worker that could take it is idle",
    "pin_not_idle": "its pinned worker is not idle",
    "no_capable_worker": "no connected worker can run it",
    "no_project_access": "no connected worker serves its project",
}


def _list(value: object) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _member(m: Mapping[str, Any]) -> str:
    why = _SHORTAGE.get(str(m.get("reason")), str(m.get("reason", "no seat")))
    pin = f" ({m['pin']})" if m.get("pin") else ""
    return f"{m.get('role', '?')}[{m.get('index', '?')}]: {why}{pin}"


def _members(items: Sequence[Mapping[str, Any]]) -> str:
    return "; ".join(_member(m) for m in items) or "no member named"


def describe_cluster_waiting(reason: Mapping[str, Any] | None) -> str:
    if not reason:
        return ""
    code = str(reason.get("code", ""))
    detail = f" ({reason['detail']})" if reason.get("detail") else ""
    if code == "no_seat":
        return f"No seat for every member: {_members(_list(reason.get('members')))}.{detail}"
    if code == "too_few_workers":
        return (
            f"Too few workers: {reason.get('needed', '?')} distinct workers needed, "
            f"{reason.get('seatable_workers', '?')} could seat a member.{detail}"
        )
    if code == "no_zone_fits":
        zones = "; ".join(
            f"zone {z.get('zone') or 'none'}: {z.get('seatable_workers', '?')} of {z.get('members', '?')} "
            f"workers" + (f", {_members(_list(z.get('unseated')))}" if z.get("unseated") else "")
            for z in _list(reason.get("zones"))
        )
        return f"No single zone can seat every member: {zones or 'no zone has a worker'}.{detail}"
    if code == "backoff":
        failures = reason.get("prepare_failures")
        after = f" after {failures} failed prepares" if failures else ""
        return f"Backing off{after}: not placed again before {reason.get('until', '?')}.{detail}"
    if code == "parked":
        return f"Parked: the placement waits for a change in the pool.{detail}"
    if code == "reserved":
        return f"Waiting for the cluster holding the reservation to start.{detail}"
    if code == "member_cannot_start":
        blocked = ", ".join(
            f"{b.get('role', '?')}[{b.get('index', '?')}]" for b in _list(reason.get("blocked"))
        )
        return f"A member's job cannot start yet: {blocked or 'unknown member'}.{detail}"
    if code == "no_members":
        return f"The cluster has no member left to place.{detail}"
    return f"Waiting: {code or 'unknown reason'}.{detail}"
