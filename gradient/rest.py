"""What every REST route shares: JSON error bodies, throttling and the error responses of the OpenAPI
document.

Error bodies keep DRF's shape, so clients written against it keep working, and every error is a JSON
object: a 400 maps each bad field to its messages (`{"members": ["..."]}`, with `non_field_errors` for
errors of the whole body), every other error is `{"detail": "..."}`. An unknown URL under /api/ and a
server error answer in JSON too, never with an HTML page. The throttles are in gradient.throttling (DRF's
APIView imports them while this module imports DRF's views).
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Callable
from typing import Any

from django.db import DataError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import reverse
from django.views import defaults
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter
from rest_framework import exceptions, serializers, status
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from gradient.core.ids import parse_uuid
from gradient.core.lines import first_line
from gradient.middleware import is_database_outage, outage_response

log = logging.getLogger("gradient.rest")


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's handler, with a validation error that is not about a field wrapped as non_field_errors so
    every error body is a JSON object, and a value the database refuses (DataError: a NUL, a number or a
    text out of its column's range that validation let through) answered as bad input, logged."""
    if isinstance(exc, DataError):
        log.warning("the database refused a value of %s: %s", context.get("request"), exc, exc_info=True)
        exc = exceptions.ValidationError(
            {"non_field_errors": ["A value cannot be stored: " + first_line(exc)]}
        )
    response = drf_exception_handler(exc, context)
    if response is None:
        return None  # not an API error: Django's handler500 answers (in JSON under /api/)
    if isinstance(exc, exceptions.ValidationError) and not isinstance(response.data, dict):
        response.data = {"non_field_errors": response.data}
    view = context.get("view")
    if (
        isinstance(exc, exceptions.ValidationError)
        and not getattr(view, "takes_forms", False)
        and _sent_a_form(context.get("request"))
    ):
        # `curl -d '{...}'` sends JSON labelled as a form: say so, not only which fields are missing.
        said = list(response.data.get("non_field_errors", []))
        response.data["non_field_errors"] = [*said, BODY_MUST_BE_JSON]
    return response


BODY_MUST_BE_JSON = "The body must be JSON, sent with Content-Type: application/json."


def _sent_a_form(request: Any) -> bool:
    if request is None or request.method in ("GET", "HEAD", "OPTIONS"):
        return False
    media = (request.content_type or "").split(";", 1)[0].strip().lower()
    return media in ("application/x-www-form-urlencoded", "multipart/form-data")


class Pages(LimitOffsetPagination):
    """`limit` (default 100, at most 1000) and `offset`; answers `{count, next, previous, results}`."""

    default_limit = 100
    max_limit = 1000


def paged(request: Request, view: Any, rows: Any, present: Callable[[list[Any]], Any]) -> Response:
    """One page of `rows` (a queryset or list, in its order) as `{count, next, previous, results}`, the
    page's rows shown by `present`."""
    paginator = Pages()
    page = paginator.paginate_queryset(rows, request, view=view) or []
    return paginator.get_paginated_response(present(list(page)))


def check_page_params(request: Request) -> None:
    """limit and offset must be non-negative integers: a 400, not a silently ignored parameter."""
    errors = {}
    for name in ("limit", "offset"):
        raw = request.query_params.get(name)
        if raw is not None and not (raw.isascii() and raw.isdigit()):
            errors[name] = [f"{name} must be a non-negative integer."]
    if errors:
        raise serializers.ValidationError(errors)


def wants_pages(request: Request) -> bool:
    """A list route of rest.md that answers a bare array (projects, workers) pages when asked to."""
    return "limit" in request.query_params or "offset" in request.query_params


def uuid_or_404(value: str) -> uuid.UUID:
    """An id from the URL path: anything that is no uuid is a 404, as no row has that id."""
    parsed = parse_uuid(value)
    if parsed is None:
        raise exceptions.NotFound("No such id.")
    return parsed


LOCATION = OpenApiParameter(
    "Location",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    description="The path of what was created (`/api/v1/<collection>/<id>`).",
    response=[201],
)


def created(body: Any, *, route: str, **kwargs: Any) -> Response:
    """A 201 with `Location`: the path of what it created (rest.md, Auth)."""
    response = Response(body, status=status.HTTP_201_CREATED)
    response["Location"] = reverse(route, kwargs={k: str(v) for k, v in kwargs.items()})
    return response


class ControlReceiptSerializer(serializers.Serializer[Any]):
    """The answer to a cancel or an abort: the intent is on the job's record; the job ends Aborted."""

    id = serializers.UUIDField()
    status = serializers.CharField(help_text="The job's status right after the intent was recorded.")
    message = serializers.CharField(help_text="What the intent did (or why it did nothing).")


class OperationSerializer(serializers.Serializer[Any]):
    """The answer to an operator's action (restart, prioritize, rebuild, drain): the intent is on the
    records it names, and the rows changed through the services."""

    id = serializers.UUIDField(help_text="The evaluation, build or worker acted on.")
    status = serializers.CharField(help_text="Its status right after the action.")
    message = serializers.CharField(help_text="What the action did, in words.")
    records = serializers.ListField(
        child=serializers.CharField(), help_text="The job records the control intent was appended to."
    )
    successor = serializers.UUIDField(
        allow_null=True, help_text="For a restart: the new evaluation that supersedes this one."
    )


def operation_body(result: Any) -> dict[str, Any]:
    return {
        "id": result.id,
        "status": result.status,
        "message": result.message,
        "records": list(result.records),
        "successor": result.successor,
    }


def _is_api(request: HttpRequest) -> bool:
    return request.path.startswith("/api/")


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if _is_api(request):
        return JsonResponse({"detail": "No such route."}, status=404)
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    # Called while the error is being handled: a database that is away is a 503 here too (an error raised
    # in a middleware, outside the views that DatabaseOutageMiddleware covers).
    exc = sys.exc_info()[1]
    if is_database_outage(exc):
        assert exc is not None
        return outage_response(request, exc)
    if _is_api(request):
        return JsonResponse({"detail": "Internal error; it was logged."}, status=500)
    return defaults.server_error(request)


# --- OpenAPI ----------------------------------------------------------------------------------------------

ERROR = {
    "type": "object",
    "description": "An error other than bad input.",
    "properties": {"detail": {"type": "string", "description": "What went wrong, in words."}},
    "required": ["detail"],
}
FIELD_ERRORS = {
    "type": "object",
    "description": "Bad input: each bad field (`non_field_errors` for the body as a whole) with its "
    "messages; nested for nested fields (`members`: one object per member).",
    "additionalProperties": {},
}
_COMMON = {
    "400": ("Bad input: field errors; nothing was changed.", "FieldErrors"),
    "401": ("No valid token: send `Authorization: Token <token>`.", "Error"),
    "403": ("Not allowed: not staff, or not a member of the job's project.", "Error"),
    "404": ("No such id.", "Error"),
    "415": ("The body's media type is not accepted (send `application/json`); nothing was changed.", "Error"),
    "429": ("Too many requests; retry after the `Retry-After` header's seconds.", "Error"),
}

_SUCCESS = {"200": "OK.", "201": "Created.", "202": "Accepted: the intent is recorded."}


def _json(component: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{component}"}}}


def add_error_responses(result: dict[str, Any], generator: Any, request: Any, public: Any) -> dict[str, Any]:
    """drf-spectacular post-processing hook: every operation documents the errors it can answer with,
    each with its JSON body."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas.setdefault("Error", ERROR)
    schemas.setdefault("FieldErrors", FIELD_ERRORS)
    for path, item in result.get("paths", {}).items():
        for method, operation in item.items():
            if method not in {"get", "post", "put", "patch", "delete"}:
                continue
            security = operation.get("security")
            anonymous = not security or {} in security
            parts = [p for p in path.split("/") if p and not p.startswith("{")]
            if len(parts) > 2:  # /api/v1/<resource>/...: one tag per resource
                operation["tags"] = [parts[2]]
            has_id = False
            for parameter in operation.get("parameters", []):
                if parameter.get("in") == "path" and parameter["name"].endswith("_id"):
                    has_id = True
                    noun = parameter["name"][: -len("_id")]
                    parameter.setdefault("description", f"The {noun}'s id (a UUID).")
            codes = ["429"]
            if "requestBody" in operation or any(
                p.get("in") == "query" for p in operation.get("parameters", [])
            ):
                codes.append("400")
            if "requestBody" in operation:
                codes.append("415")  # a body DRF's parsers cannot read (a malformed multipart, say)
            if not anonymous:
                codes += ["401", "403"]
            if has_id:
                codes.append("404")
            responses = operation.setdefault("responses", {})
            for code in codes:
                description, component = _COMMON[code]
                responses.setdefault(code, {"description": description})
            for code, response in responses.items():
                if not response.get("description"):
                    response["description"] = _SUCCESS.get(code, "")
                if code.startswith(("4", "5")) and "content" not in response:
                    component = "FieldErrors" if code == "400" else "Error"
                    response["content"] = _json(component)
    return result
