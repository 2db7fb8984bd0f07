"""Where a newcomer lands: `/` goes to the console, and `/api/v1/` says what the API offers (with a
token: every route; without one: the 401 every route answers, with where to get a token and the docs)."""

from __future__ import annotations

from typing import Any

from django.urls import reverse
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

ROUTES = {
    "evaluations": "/api/v1/evaluations",
    "builds": "/api/v1/builds",
    "clusters": "/api/v1/clusters",
    "workers": "/api/v1/workers",
    "projects": "/api/v1/projects",
    "users": "/api/v1/users",
}


def _links(request: Request) -> dict[str, str]:
    return {
        "token": request.build_absolute_uri("/api/v1/auth/token"),
        "docs": request.build_absolute_uri(reverse("api-docs")),
        "schema": request.build_absolute_uri(reverse("schema")),
        "console": request.build_absolute_uri(reverse("admin:index")),
        "metrics": request.build_absolute_uri(reverse("metrics")),
    }


class ApiIndexView(APIView):
    @extend_schema(
        responses={
            200: OpenApiResponse(
                inline_serializer(
                    "ApiIndex",
                    {
                        "routes": serializers.DictField(child=serializers.CharField()),
                        "links": serializers.DictField(child=serializers.CharField()),
                    },
                ),
                description="The API's collections and where its docs are.",
            )
        },
        summary="What the API offers, with links",
    )
    def get(self, request: Request) -> Response:
        routes = {name: request.build_absolute_uri(path) for name, path in ROUTES.items()}
        return Response({"routes": routes, "links": _links(request)})

    def handle_exception(self, exc: Exception) -> Response:
        response = super().handle_exception(exc)
        if response.status_code == 401 and isinstance(response.data, dict):
            data: dict[str, Any] = dict(response.data)
            data["links"] = _links(self.request)
            response.data = data
        return response
