"""HTTP middleware of Gradient's own.

`refuse_nul`: a NUL character (`%00`) in the path or the query string is bad input (400), answered
before any view runs: no text column of PostgreSQL can hold one, so a filter such as `?project=a%00b`
would otherwise end in a database error (a 500). (Form and JSON fields are refused by Django's and DRF's
own validators.)

`ApiTrailingSlash`: `/api/v1/evaluations/` is `/api/v1/evaluations`, a 308 there (method and body kept).

`DatabaseOutageMiddleware`: while the database does not answer, every route answers 503 with
`Retry-After` (not a 500 with a traceback per request), logged once per interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.db import InterfaceError, OperationalError
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponsePermanentRedirect,
    JsonResponse,
)
from django.urls import Resolver404, resolve
from django.utils.decorators import sync_and_async_middleware
from django.utils.deprecation import MiddlewareMixin

from gradient.core.lines import first_line

log = logging.getLogger("gradient.http")

NUL = "\x00"
DETAIL = "A NUL character (%00) is not allowed in a URL."


def nul_refusal(request: HttpRequest) -> HttpResponse | None:
    """The 400 for a request with a NUL in its path or query string; None for any other."""
    found = NUL in request.path or any(
        NUL in key or any(NUL in v for v in values) for key, values in request.GET.lists()
    )
    if not found:
        return None
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": DETAIL}, status=400)
    return HttpResponseBadRequest(DETAIL)


@sync_and_async_middleware
def refuse_nul(get_response: Callable[[HttpRequest], Any]) -> Callable[[HttpRequest], Any]:
    if iscoroutinefunction(get_response):
        inner: Callable[[HttpRequest], Awaitable[HttpResponse]] = get_response

        async def async_middleware(request: HttpRequest) -> HttpResponse:
            return nul_refusal(request) or await inner(request)

        markcoroutinefunction(async_middleware)
        return async_middleware

    def middleware(request: HttpRequest) -> HttpResponse:
        return nul_refusal(request) or get_response(request)

    return middleware


# --- A REST route asked for with a trailing slash ------------------------------------------------------


class ApiTrailingSlash(MiddlewareMixin):
    """The REST routes are spelled without a trailing slash (rest.md); a client that adds one (as many
    frameworks do) is sent to the route, not given a 404. A path that is a route as it is stays."""

    PREFIX = "/api/v1/"

    def process_request(self, request: HttpRequest) -> HttpResponse | None:
        path = request.path_info
        if not path.startswith(self.PREFIX) or not path.endswith("/") or path == self.PREFIX:
            return None
        try:
            resolve(path)
            return None
        except Resolver404:
            pass
        target = path.rstrip("/")
        try:
            resolve(target)
        except Resolver404:
            return None
        query = request.META.get("QUERY_STRING", "")
        script_prefix = request.path[: len(request.path) - len(path)]
        response = HttpResponsePermanentRedirect(f"{script_prefix}{target}" + (f"?{query}" if query else ""))
        response.status_code = 308  # not 301: a POST stays a POST, with its body
        return response


# --- A database that does not answer -------------------------------------------------------------------

# How long a client is told to wait; the consumers' sessions are back within seconds of the database.
OUTAGE_RETRY_AFTER_SECS = 5
# At most one log line per this many seconds for the requests an outage turns away.
OUTAGE_LOG_EVERY_SECS = 10.0
OUTAGE_DETAIL = "The database does not answer; try again shortly."

_outage_log = {"at": -OUTAGE_LOG_EVERY_SECS, "suppressed": 0}


def is_database_outage(exc: BaseException | None) -> bool:
    """A database error of the kind a restart, a failover or a stopped server raises: the connection
    could not be made or was lost (Django's OperationalError and InterfaceError)."""
    return isinstance(exc, OperationalError | InterfaceError)


def outage_response(request: HttpRequest, exc: BaseException) -> HttpResponse:
    """503 with Retry-After, for any route: the service is not broken, its database is away. One WARNING
    line per OUTAGE_LOG_EVERY_SECS (the first line of the error; hosts and ports go to the log, never to
    the client), instead of Django's ERROR with a traceback for each request."""
    now = time.monotonic()
    if now - _outage_log["at"] >= OUTAGE_LOG_EVERY_SECS:
        first = first_line(exc)
        log.warning(
            "the database does not answer: %s %s answered 503 (%d more since the last line): %s",
            request.method,
            request.path,
            _outage_log["suppressed"],
            first,
        )
        _outage_log.update(at=now, suppressed=0)
    else:
        _outage_log["suppressed"] += 1
    response: HttpResponse
    if request.path.startswith(("/api/", "/metrics", "/healthz")):
        response = JsonResponse({"detail": OUTAGE_DETAIL}, status=503)
    else:
        response = HttpResponse(OUTAGE_DETAIL, status=503, content_type="text/plain; charset=utf-8")
    response["Retry-After"] = str(OUTAGE_RETRY_AFTER_SECS)
    response._has_been_logged = True  # type: ignore[attr-defined]  # Django's log_response: said above
    return response


class DatabaseOutageMiddleware(MiddlewareMixin):
    """A view (REST, /metrics, the console) whose database does not answer: 503 and Retry-After, not a
    500. An error raised outside any view (in a middleware) reaches gradient.rest.server_error, which
    answers the same."""

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if is_database_outage(exception):
            return outage_response(request, exception)
        return None
