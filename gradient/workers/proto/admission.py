"""Room for workers on /proto (issue 25, finding 1): who gets a socket before saying who they are.

A socket that has not completed its handshake is a *stranger*. Strangers are capped per process
(GRADIENT_PROTO_MAX_UNAUTHENTICATED) and per client address
(GRADIENT_PROTO_MAX_UNAUTHENTICATED_PER_ADDRESS; a trusted proxy's address stands for many clients and
is capped only in total). Over a cap the newcomer is not refused: the *oldest* stranger that has not
sent its InitConnection yet is closed to make room (Reject{400}, close 4400): the address's oldest over
its own cap, and over the total the oldest of the address that has the most strangers. So a worker,
which says who it is within milliseconds, gets in however many strangers keep reopening: strangers push
out each other first. Only when every stranger in the way is in its handshake already is the newcomer
refused (HTTP 403 before the upgrade; a worker retries). Before, 300 strangers reopening as they were
closed kept the 256 slots full, and a real worker was refused for 30 s.

Refusals and evictions are logged at most once per address per 10 s, with the count of those left
unlogged (before: 3 456 INFO lines in 30 s).

`plan_admission` is the decision, pure; `admit` keeps this process's strangers (oldest first) and acts.
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

EVICTED_REASON = "no InitConnection yet, and room was needed for a newer connection"

_lines = LineEvery(every_secs=10.0)
# This process's strangers, oldest first (the dict under it keeps insertion order): consumer -> its
# address. Weak: a consumer that was never told of its disconnect is not kept alive by this.
_strangers: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class Stranger:
    key: Any
    address: str
    handshaking: bool  # its InitConnection is being checked: never closed to make room


@dataclass(frozen=True, slots=True)
class Admission:
    admitted: bool
    close: tuple[Any, ...]  # the keys of the strangers to close first, oldest first


def plan_admission(
    strangers: Sequence[Stranger], address: str, *, total_cap: int, per_address_cap: int | None
) -> Admission:
    """Whether a new socket from `address` is taken, and which strangers (oldest first in `strangers`)
    are closed to make room for it. `per_address_cap` None: the address is not capped on its own."""
    closing: list[Any] = []
    if per_address_cap is not None:
        same = [s for s in strangers if s.address == address]
        need = len(same) - per_address_cap + 1
        if need > 0:
            victims = [s.key for s in same if not s.handshaking][:need]
            if len(victims) < need:
                return Admission(False, ())
            closing += victims
    need = len(strangers) - len(closing) - total_cap + 1
    if need > 0:
        # The most crowded address gives up its oldest first: a worker, alone at its address, is then
        # the last to go however fast strangers from other addresses come.
        chosen = set(closing)
        left = [s for s in strangers if s.key not in chosen]
        crowd = Counter(s.address for s in left)
        for _ in range(need):
            candidates = [s for s in left if not s.handshaking]
            if not candidates:
                return Admission(False, ())
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
    for gone in [c for c in list(_strangers) if not _is_stranger(c)]:
        _strangers.pop(gone, None)
    strangers = [Stranger(c, a, bool(getattr(c, "handshaking", False))) for c, a in list(_strangers.items())]
    per_address = settings.GRADIENT_PROTO_MAX_UNAUTHENTICATED_PER_ADDRESS
    plan = plan_admission(
        strangers,
        address,
        total_cap=settings.GRADIENT_PROTO_MAX_UNAUTHENTICATED,
        # No address (a test's ASGI scope) or a proxy's: capped in total only.
        per_address_cap=None if per_address <= 0 or not address or is_trusted_proxy(address) else per_address,
    )
    shown = address or "a client"
    if not plan.admitted:
        _line(address, "refused %s: %d sockets have not completed the handshake", shown, len(strangers))
        return False
    if plan.close:
        _line(address, "closed %d socket(s) without a handshake to make room for %s", len(plan.close), shown)
    for victim in plan.close:
        _strangers.pop(victim, None)
        await victim.make_room()
    return True


def register(consumer: Any, address: str) -> None:
    """`consumer` was accepted: a stranger until its handshake completes (or it closes)."""
    _strangers[consumer] = address


def forget(consumer: Any) -> None:
    _strangers.pop(consumer, None)


def _line(address: str, message: str, *args: Any) -> None:
    unlogged = _lines.due(address, time.monotonic())
    if unlogged is not None:
        log.info(message + " (%d more like it since the last line)", *args, unlogged)
