"""GET /api/v1/evaluations/{id}/history: an evaluation's event-sourced record (rest.md).

Whether the evaluation exists and who may read it is for the app owning evaluations to say: records asks
the read access provider that app registered (selectors.record_read_access) and reads only its own tables."""

from __future__ import annotations

import json
from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from gradient.core.ids import parse_uuid
from gradient.records.models import JobRecord, RecordEntry
from gradient.records.schemas import JobKind, job_key_for
from gradient.records.selectors import ReadAccess, record_read_access


class HistoryEntrySerializer(serializers.Serializer[Any]):
    revision = serializers.IntegerField(help_text="1 for the first entry after the header.")
    schema = serializers.CharField(help_text="gradient.control.v1 or gradient.fact.v1.")
    kind = serializers.ChoiceField(choices=["control", "fact"])
    body = serializers.JSONField(help_text="The entry's JSON body, as written.")
    actor = serializers.CharField(help_text="Who appended it: an operator, the scheduler, ...")
    recorded_at = serializers.DateTimeField()


class HistorySerializer(serializers.Serializer[Any]):
    job_key = serializers.CharField()
    revision = serializers.IntegerField(help_text="The number of entries.")
    header_schema = serializers.CharField(help_text="gradient.header.v1.")
    header = serializers.JSONField(help_text="The header, written once: spec, digest, plan, lineage.")
    entries = HistoryEntrySerializer(many=True)
    settled = serializers.BooleanField()
    settled_at = serializers.DateTimeField(allow_null=True)
    tombstoned_at = serializers.DateTimeField(allow_null=True, help_text="Set when the entries were dropped.")


class EvaluationHistoryView(APIView):
    permission_classes = [IsAuthenticated]

    @extend_schema(
        operation_id="evaluation_history",
        summary="An evaluation's event-sourced record",
        description=(
            "The header written when the evaluation was submitted and every entry appended since, "
            "oldest first: control intents (cancel, hold, ...) and the scheduler's facts."
        ),
        parameters=[
            OpenApiParameter(
                "evaluation_id", OpenApiTypes.UUID, OpenApiParameter.PATH, description="The evaluation's id."
            )
        ],
        responses={
            200: HistorySerializer,
            401: OpenApiResponse(description="No valid token."),
            403: OpenApiResponse(description="Not staff and not a member of the evaluation's project."),
            404: OpenApiResponse(description="No such evaluation, or it has no record."),
        },
        tags=["evaluations"],
    )
    def get(self, request: Request, evaluation_id: str) -> Response:
        eval_id = parse_uuid(evaluation_id)
        if eval_id is None:
            raise NotFound("No such evaluation.")
        job_key = job_key_for(JobKind.EVALUATION, eval_id)
        access = record_read_access(job_key=job_key, user=request.user)
        if access is ReadAccess.NO_SUCH_JOB:
            raise NotFound("No such evaluation.")
        if access is not ReadAccess.ALLOWED:
            raise NotFound("No such evaluation.")  # another project's: not the caller's to learn
        record = JobRecord.objects.filter(job_key=job_key).first()
        if record is None:
            raise NotFound("This evaluation has no record.")
        entries = RecordEntry.objects.filter(record=record, revision__lte=record.revision).order_by(
            "revision"
        )
        data = {
            "job_key": record.job_key,
            "revision": record.revision,
            "header_schema": record.header_schema,
            "header": json.loads(record.header),
            "entries": [
                {
                    "revision": e.revision,
                    "schema": e.schema,
                    "kind": e.kind,
                    "body": json.loads(e.body),
                    "actor": e.actor,
                    "recorded_at": e.recorded_at,
                }
                for e in entries
            ],
            "settled": record.settled,
            "settled_at": record.settled_at,
            "tombstoned_at": record.tombstoned_at,
        }
        return Response(HistorySerializer(data).data)
