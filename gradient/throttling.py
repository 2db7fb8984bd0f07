"""Rate limits: the REST throttles and the login guard (the token route and the admin's login page).

- **Shared count.** Every hit is one atomic upsert into the `rate_counter` table (`hit`), so all `serve`
  processes on one database share the count and a restart does not reset it. A counter's window starts
  at its first hit and lasts the rate's period; the next hit after it starts a new one.
- **Client address.** `client_address` is the peer's address (`REMOTE_ADDR`), never a header a client
  can write, unless the peer is one of `GRADIENT_TRUSTED_PROXIES` (addresses or networks): then it is
  the last address of `X-Forwarded-For` that is not a trusted proxy, the one the nearest proxy saw.
- **Logins.** Failed logins are counted per account and per address (`GRADIENT_LOGIN_THROTTLE_ACCOUNT`,
  `GRADIENT_LOGIN_THROTTLE_ADDRESS`); over either limit a login is refused (429) before the password is
  checked, whether it is right or not, until the window ends.

Rates are read from the settings on every request ("20000/hour"; "" turns a limit off), so an operator
(or a test) can change them without a restart of the code that holds them.
"""

from __future__ import annotations

import hashlib
import ipaddress
import unicodedata
from collections.abc import Callable
from functools import lru_cache, wraps
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from rest_framework.throttling import BaseThrottle

from gradient.runtime.counters import hit

PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_rate(rate: str | None) -> tuple[int, int] | None:
    """ "20/minute" -> (20, 60); None or "" -> None (no limit). The period is its first letter: s, m,
    h or d, optionally after a number ("5/15m")."""
    if not rate:
        return None
    count, _, period = rate.partition("/")
    period = period.strip()
    digits = "".join(ch for ch in period if ch.isdigit())
    unit = period[len(digits) :][:1].lower()
    if unit not in PERIODS:
        raise ValueError(f"a rate is N/<s|m|h|d>, got {rate!r}")
    return int(count), PERIODS[unit] * (int(digits) if digits else 1)


def _key(*parts: str) -> str:
    raw = "\x1f".join(parts)
    if len(raw) <= 200:
        return raw
    return f"{parts[0]}\x1f{hashlib.sha256(raw.encode()).hexdigest()}"


# --- Addresses ----------------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _networks(spec: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(part.strip(), strict=False) for part in spec.split(",") if part.strip())


def _trusted(address: str) -> bool:
    spec = settings.GRADIENT_TRUSTED_PROXIES
    if not spec or not address:
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in _networks(spec))


def is_trusted_proxy(address: str) -> bool:
    """`address` is one of GRADIENT_TRUSTED_PROXIES (its connections stand for many clients)."""
    return _trusted(address)


def client_address(request: Any) -> str:
    """Who is asking: the peer, or, behind trusted proxies, the address the nearest one saw."""
    meta = request.META
    remote = str(meta.get("REMOTE_ADDR") or "")
    if not _trusted(remote):
        return remote
    chain = [part.strip() for part in str(meta.get("HTTP_X_FORWARDED_FOR", "")).split(",") if part.strip()]
    for address in reversed(chain):
        if not _trusted(address):
            return address
    return chain[0] if chain else remote


# --- The REST throttles ---------------------------------------------------------------------------------


class _CountedThrottle(BaseThrottle):
    scope = ""

    def rate(self) -> str | None:
        raise NotImplementedError

    def ident_of(self, request: Any) -> str | None:
        raise NotImplementedError

    def allow_request(self, request: Any, view: Any) -> bool:
        parsed = parse_rate(self.rate())
        ident = self.ident_of(request)
        if parsed is None or ident is None:
            return True
        limit, period = parsed
        hits, self._wait = hit(_key(self.scope, ident), period)
        return hits <= limit

    def wait(self) -> float | None:
        return max(1.0, getattr(self, "_wait", 1.0))


class UserThrottle(_CountedThrottle):
    """Requests per signed-in user (settings.GRADIENT_API_THROTTLE_USER, e.g. "20000/hour")."""

    scope = "user"

    def rate(self) -> str | None:
        return settings.GRADIENT_API_THROTTLE_USER or None

    def ident_of(self, request: Any) -> str | None:
        user = getattr(request, "user", None)
        return str(user.pk) if user is not None and user.is_authenticated else None


class AnonThrottle(_CountedThrottle):
    """Requests per client address without a token (settings.GRADIENT_API_THROTTLE_ANON)."""

    scope = "anon"

    def rate(self) -> str | None:
        return settings.GRADIENT_API_THROTTLE_ANON or None

    def ident_of(self, request: Any) -> str | None:
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            return None
        return client_address(request)


# --- Logins ---------------------------------------------------------------------------------------------


def login_name(username: str) -> str:
    """The account a login names, as the login itself reads it: trimmed (DRF's field and Django's login
    form both strip whitespace, Unicode's too: a tab, U+3000) and NFKC-normalized (the admin's form does
    it, so a full-width `ａｌｉｃｅ` signs in as `alice`). Case is kept: the user model compares names
    exactly. The account's lock is keyed on this, so no spelling of a locked name that would sign in to
    the same account escapes it."""
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", username).strip())


def _login_limits(request: Any, username: str) -> list[tuple[str, int, int]]:
    limits = []
    account = parse_rate(settings.GRADIENT_LOGIN_THROTTLE_ACCOUNT)
    name = login_name(username)
    if account is not None and name:
        limits.append((_key("login-account", name), *account))
    address = parse_rate(settings.GRADIENT_LOGIN_THROTTLE_ADDRESS)
    if address is not None:
        limits.append((_key("login-address", client_address(request)), *address))
    return limits


def login_refused_for(request: Any, username: str) -> float | None:
    """Seconds to wait when the account or the address is over its failed-login limit, else None."""
    waits = []
    for key, limit, period in _login_limits(request, username):
        hits, wait = hit(key, period, add=0)
        if hits >= limit:
            waits.append(wait)
    return max(1.0, max(waits)) if waits else None


def login_failed(request: Any, username: str) -> None:
    """Count one failed login for the account and the address."""
    for key, _limit, period in _login_limits(request, username):
        hit(key, period)


def limit_admin_login(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """The admin's login view, with failed logins limited per account and per address: over a limit, a
    POST is answered 429 without checking the password. A failed POST is one that shows the form again
    (200); a signed-in one redirects."""

    @wraps(view)
    def limited(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.method != "POST":
            return view(request, *args, **kwargs)
        username = str(request.POST.get("username", ""))
        wait = login_refused_for(request, username)
        if wait is not None:
            response = HttpResponse(
                f"Too many failed logins; try again in {int(wait) + 1} s.",
                status=429,
                content_type="text/plain",
            )
            response["Retry-After"] = str(int(wait) + 1)
            return response
        response = view(request, *args, **kwargs)
        if response.status_code == 200:
            login_failed(request, username)
        return response

    return limited
