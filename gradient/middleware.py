"""HTTP middleware of Gradient's own.

`refuse_nul`: a NUL character (`%00`) in the path or the query string is bad input (400), answered
before any view runs: no text column of PostgreSQL can hold one, so a filter such as `?project=a%00b`
would otherwise end in a database error (a 500). (Form and JSON fields are refused by Django's and DRF's
own validators.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, JsonResponse
from django.utils.decorators import sync_and_async_middleware

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
