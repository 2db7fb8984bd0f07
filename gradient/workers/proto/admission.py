"""Room for workers on /proto (issue 25, finding 1; issue 35, item 6): who gets a socket before saying
who they are.

A socket accepted on /proto is *silent* until its InitConnection is read, then *pending* until it is
answered (InitAck or Reject); both are unauthenticated. A pending socket has said who it is and will be
answered: it is never closed to make room and the per-address cap does not count it, so a fleet behind
one address (300 workers connecting at once through one NAT) all get in, however slowly a busy server
reads their InitConnections. The caps are on silent sockets:

- per client address, GRADIENT_PROTO_MAX_UNAUTHENTICATED_PER_ADDRESS (a trusted proxy's address stands
  for many clients and is capped only in total): over it, the address's oldest silent sockets that have
  been silent for GRADIENT_PROTO_SILENT_GRACE_SECS make room for the newcomer. One silent for less may
  be a worker whose InitConnection is on its way or not read yet: it is left alone, and the newcomer is
  taken all the same (the total bound below still holds);
- in total, GRADIENT_PROTO_MAX_UNAUTHENTICATED sockets of this process, silent and pending together:
  over it the oldest silent socket of the address that has the most silent ones makes room (those past
  the grace first). Only when every unauthenticated socket is pending is the newcomer refused (HTTP 503
  with Retry-After before the upgrade, "busy: try again"; a worker retries).

A socket closed to make room is answered Reject{503} (close 4503): "busy or making room, try again"
(protocol.md), never a 400 that a worker takes as final. So silent sockets push out each other, a
worker's socket is safe as soon as its InitConnection is read, and 300 silent sockets from one address
cannot keep a worker (from that address or another) out. Before, the 17th socket of an address closed
the oldest one whose InitConnection the busy server had not read yet, with a 400 the reference worker
took as final: 24 of 40 workers connecting at once from one address were closed.

Refusals and evictions are logged at most once per address per 10 s, with the count of those left
unlogged (before: 3 456 INFO lines in 30 s).

`plan_admission` is the decision, pure; `admit` keeps this process's unauthenticated sockets (oldest
first) and acts.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from gradient.core.lines import LineEvery
from gradient.throttling import is_trusted_proxy

log = logging.getLogger("gradient.workers")

EVICTED_CODE = 503  # "busy or making room: try again" (protocol.md); never a final code
EVICTED_REASON = "no InitConnection yet, and room was needed for a newer connection: try again"

_lines = LineEvery(every_secs=10.0)
# This process's unauthenticated sockets, oldest first (the dict under it keeps insertion order):
# consumer -> (its address, when it was accepted on the monotonic clock). Weak: a consumer that was
# never told of its disconnect is not kept alive by this.
_strangers: weakref.WeakKeyDictionary[Any, tuple[str, float]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class Stranger:
    key: Any
    address: str
    handshaking: bool  # pending: its InitConnection was read; never closed to make room, not per address
    since: float = 0.0  # accepted at (monotonic seconds)


@dataclass(frozen=True, slots=True)
class Admission:
    admitted: bool
    close: tuple[Any, ...]  # the keys of the strangers to close first, oldest first


def plan_admission(
    strangers: Sequence[Stranger],
    address: str,
    *,
    total_cap: int,
    per_address_cap: int | None,
    now: float = 0.0,
    grace_secs: float = 0.0,
) -> Admission:
    """Whether a new socket from `address` is taken, and which silent sockets (oldest first in
    `strangers`) are closed to make room for it. `per_address_cap` None: the address is not capped on
    its own. A silent socket younger than `grace_secs` at `now` is closed for the total cap only, after
    every older one."""
    silent = [s for s in strangers if not s.handshaking]
    closing: list[Any] = []
    if per_address_cap is not None:
        same = [s for s in silent if s.address == address]
        need = len(same) - per_address_cap + 1
        if need > 0:
            closing += [s.key for s in same if now - s.since >= grace_secs][:need]
    need = len(strangers) - len(closing) - total_cap + 1
    if need > 0:
        # The most crowded address gives up its oldest first: a worker, alone at its address, is then
        # the last to go however fast strangers from other addresses come.
        chosen = set(closing)
        left = [s for s in silent if s.key not in chosen]
        crowd = Counter(s.address for s in left)
        for _ in range(need):
            if not left:
                return Admission(False, ())
            candidates = [s for s in left if now - s.since >= grace_secs] or left
            most = max(crowd[s.address] for s in candidates)
            victim = next(s for s in candidates if crowd[s.address] == most)
            closing.append(victim.key)
            left.remove(victim)
            crowd[victim.address] -= 1
    return Admission(True, tuple(closing))


def _is_stranger(consumer: Any) -> bool:
    return getattr(consumer, "session", None) is None and not getattr(consumer, "closing", True)


async def admit(consumer: Any, address: str) -> bool:
    """Whether `consumer`'s socket (from `address`) is taken, closing older strangers to make room as
    the caps say; False: refuse it (close before the upgrade). Once accepted, `register` it."""
    per_address = settings.GRADIENT_PROTO_MAX_UNAUTHENTICATED_PER_ADDRESS
    capped = per_address > 0 and bool(address) and not is_trusted_proxy(address)
    # Under every cap (fewer strangers than the total; fewer of this address, silent or pending, than its
    # own cap), plan_admission takes the newcomer and closes nothing: said without building the list of
    # strangers, which a fleet of 1 000 connecting at once built for each (10 % of the event loop).
    if len(_strangers) < settings.GRADIENT_PROTO_MAX_UNAUTHENTICATED and (
        not capped or sum(1 for a, _ in _strangers.values() if a == address) < per_address
    ):
        return True
    for gone in [c for c in list(_strangers) if not _is_stranger(c)]:
        _strangers.pop(gone, None)
    strangers = [
        Stranger(c, a, bool(getattr(c, "handshaking", False)), since)
        for c, (a, since) in list(_strangers.items())
    ]
    plan = plan_admission(
        strangers,
        address,
        now=time.monotonic(),
        grace_secs=settings.GRADIENT_PROTO_SILENT_GRACE_SECS,
        total_cap=settings.GRADIENT_PROTO_MAX_UNAUTHENTICATED,
        # No address (a test's ASGI scope) or a proxy's: capped in total only.
        per_address_cap=None if per_address <= 0 or not address or is_trusted_proxy(address) else per_address,
    )
    shown = address or "a client"
    if not plan.admitted:
        _line(
            address,
            "refused %s: %d sockets have not completed the handshake, none silent",
            shown,
            len(strangers),
        )
        return False
    if plan.close:
        _line(address, "closed %d socket(s) without a handshake to make room for %s", len(plan.close), shown)
    for victim in plan.close:
        _strangers.pop(victim, None)
        await victim.make_room()
    return True


def register(consumer: Any, address: str) -> None:
    """`consumer` was accepted: unauthenticated until its handshake completes (or it closes)."""
    _strangers[consumer] = (address, time.monotonic())


def forget(consumer: Any) -> None:
    _strangers.pop(consumer, None)


def _line(address: str, message: str, *args: Any) -> None:
    unlogged = _lines.due(address, time.monotonic())
    if unlogged is not None:
        log.info(message + " (%d more like it since the last line)", *args, unlogged)
