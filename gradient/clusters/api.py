"""REST routes of ../shared/spec/rest.md that the clusters app owns: create, read and abort a cluster.

Anyone signed in may create a cluster of jobs they may read (staff: any job; a submitter: the jobs of
its projects); staff alone may make it prioritized, and abort. A cluster is readable by staff, by its
creator and by members of a project one of its jobs belongs to. Bad input is a 400 with field errors, an
unknown id a 404, never a 500.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.db.models import Q, QuerySet
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from gradient.clusters.decisions.waiting_text import describe_cluster_waiting
from gradient.clusters.models import ClusterJob, ClusterMember
from gradient.clusters.services.lifecycle import (
    MAX_MEMBERS,
    ClusterInputError,
    MemberSpec,
    cluster_create,
    cluster_request_abort,
)
from gradient.core.vocab import ClusterStatus, member_of
from gradient.rest import (
    LOCATION,
    ControlReceiptSerializer,
    check_page_params,
    created,
    paged,
    uuid_or_404,
)
from gradient.scheduling.models import EvaluationBuild, Project

# --- Serializers -----------------------------------------------------------------------------------------


class MemberInputSerializer(serializers.Serializer[Any]):
    evaluation = serializers.UUIDField(required=False, allow_null=True, help_text="An evaluation's id.")
    build = serializers.UUIDField(required=False, allow_null=True, help_text="A shared build's id.")
    role = serializers.CharField(
        max_length=100, help_text="The member's role; members of one role are indexed 0, 1, ..."
    )
    primary = serializers.BooleanField(
        default=False, help_text="The cluster completes when the primary succeeds."
    )
    pin = serializers.CharField(
        max_length=200, required=False, allow_null=True, help_text="Name of the only worker that may seat it."
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if (attrs.get("evaluation") is None) == (attrs.get("build") is None):
            raise serializers.ValidationError("A member names exactly one job: evaluation or build.")
        return attrs


class ClusterCreateSerializer(serializers.Serializer[Any]):
    members = MemberInputSerializer(many=True, allow_empty=False, max_length=MAX_MEMBERS)  # type: ignore[call-arg]
    same_zone = serializers.BooleanField(default=False, help_text="Seat every member in one zone.")
    retry_budget = serializers.IntegerField(
        default=2, min_value=0, max_value=100, help_text="Bounds started attempts: 0 or 1 allow one."
    )
    priority = serializers.BooleanField(default=False, help_text="Placed before other clusters; staff only.")


class MemberSerializer(serializers.Serializer[Any]):
    role = serializers.CharField()
    index = serializers.IntegerField()
    evaluation = serializers.UUIDField(source="evaluation_id", allow_null=True)
    build = serializers.UUIDField(source="derivation_build_id", allow_null=True)
    primary = serializers.BooleanField()
    pin = serializers.CharField(allow_null=True)


class SeatSerializer(serializers.Serializer[Any]):
    role = serializers.CharField()
    index = serializers.IntegerField()
    worker_id = serializers.CharField()
    zone = serializers.CharField(allow_null=True, required=False)


class AttemptSerializer(serializers.Serializer[Any]):
    id = serializers.UUIDField()
    number = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    prepare_deadline = serializers.DateTimeField(allow_null=True)
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)
    outcome = serializers.CharField(allow_null=True)
    verdict = serializers.CharField(allow_null=True)
    reason = serializers.CharField()
    seats = SeatSerializer(many=True)


class ClusterSerializer(serializers.Serializer[Any]):
    id = serializers.UUIDField()
    status = serializers.CharField()
    same_zone = serializers.BooleanField()
    priority = serializers.BooleanField()
    attempts = serializers.IntegerField(help_text="Started attempts.")
    retry_budget = serializers.IntegerField()
    prepare_failures = serializers.IntegerField(help_text="Consecutive failed prepares.")
    retry_at = serializers.DateTimeField(allow_null=True)
    waiting_reason = serializers.JSONField(allow_null=True)
    waiting_reason_text = serializers.SerializerMethodField(
        help_text="Why it waits, in an operator's words (as the console shows it); empty when it does not."
    )
    waiting_since = serializers.DateTimeField(allow_null=True)
    created_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)
    members = serializers.SerializerMethodField()
    attempt_history = serializers.SerializerMethodField()

    @extend_schema_field(MemberSerializer(many=True))
    def get_waiting_reason_text(self, obj: ClusterJob) -> str:
        return describe_cluster_waiting(obj.waiting_reason)

    def get_members(self, obj: ClusterJob) -> Any:
        return MemberSerializer(obj.members.order_by("role", "index"), many=True).data

    @extend_schema_field(AttemptSerializer(many=True))
    def get_attempt_history(self, obj: ClusterJob) -> Any:
        return AttemptSerializer(obj.attempt_rows.order_by("number"), many=True).data


# --- Access ----------------------------------------------------------------------------------------------


def _project_ids(user: Any) -> set[uuid.UUID]:
    return set(Project.objects.filter(members=user).values_list("id", flat=True))


def _can_read(user: Any, cluster: ClusterJob) -> bool:
    if user.is_staff or cluster.created_by_id == user.pk:
        return True
    projects = _project_ids(user)
    members = ClusterMember.objects.filter(cluster_job=cluster)
    builds = EvaluationBuild.objects.filter(
        build_id__in=members.values("derivation_build_id"), evaluation__project_id__in=projects
    )
    return members.filter(evaluation__project_id__in=projects).exists() or builds.exists()


def cluster_for(user: Any, cluster_id: str) -> ClusterJob:
    cluster = ClusterJob.objects.filter(id=uuid_or_404(cluster_id)).first()
    if cluster is None:
        raise NotFound("No cluster with this id.")
    if not _can_read(user, cluster):
        raise NotFound("No cluster with this id.")  # another project's: not the caller's to learn
    return cluster


# --- Views -----------------------------------------------------------------------------------------------


def readable_clusters(user: Any) -> QuerySet[ClusterJob]:
    """The clusters `user` may read (as _can_read says of one)."""
    if user.is_staff:
        return ClusterJob.objects.all()
    projects = Project.objects.filter(members=user).values("id")
    members = ClusterMember.objects.filter(
        Q(evaluation__project_id__in=projects)
        | Q(
            derivation_build_id__in=EvaluationBuild.objects.filter(
                evaluation__project_id__in=projects
            ).values("build_id")
        )
    )
    return ClusterJob.objects.filter(Q(created_by_id=user.pk) | Q(id__in=members.values("cluster_job_id")))


class ClusterListItemSerializer(serializers.Serializer[Any]):
    id = serializers.UUIDField()
    status = serializers.CharField()
    same_zone = serializers.BooleanField()
    attempts = serializers.IntegerField(help_text="Started attempts.")
    created_at = serializers.DateTimeField()


class ClusterPageSerializer(serializers.Serializer[Any]):
    count = serializers.IntegerField(help_text="Clusters matching the filters.")
    next = serializers.URLField(allow_null=True, help_text="The next page, or null on the last one.")
    previous = serializers.URLField(allow_null=True)
    results = ClusterListItemSerializer(many=True)


class ClustersView(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("status", OpenApiTypes.STR, description="Filter by status, e.g. Queued."),
            OpenApiParameter("limit", OpenApiTypes.INT, description="Page size (default 100, at most 1000)."),
            OpenApiParameter("offset", OpenApiTypes.INT, description="Clusters to skip."),
        ],
        responses={200: ClusterPageSerializer},
        summary="List the cluster jobs you may read, newest first (always paged)",
        operation_id="v1_clusters_list",
    )
    def get(self, request: Request) -> Response:
        check_page_params(request)
        qs = readable_clusters(request.user)
        wanted_status = request.query_params.get("status")
        if wanted_status:
            if member_of(ClusterStatus, wanted_status) is None:
                raise serializers.ValidationError({"status": [f"Unknown status: {wanted_status}."]})
            qs = qs.filter(status=wanted_status)
        return paged(
            request,
            self,
            qs.order_by("-created_at", "id"),
            lambda page: ClusterListItemSerializer(page, many=True).data,
        )

    @extend_schema(
        request=ClusterCreateSerializer,
        responses={
            201: ClusterSerializer,
            400: OpenApiResponse(
                description="Bad members: unknown job (another project's too), unknown worker to pin to "
                "(one serving none of your projects too), job already in a cluster, ..."
            ),
            403: OpenApiResponse(description="Priority without staff"),
        },
        parameters=[LOCATION],
        summary="Create a cluster job: existing jobs started together on distinct workers, all or nothing",
    )
    def post(self, request: Request) -> Response:
        serializer = ClusterCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        user = request.user
        if data["priority"] and not user.is_staff:
            raise PermissionDenied("Only staff may create prioritized clusters.")
        # Another project's job, and a pin to a worker that serves none of the caller's projects, are
        # unknown to a caller who is not staff: the same 400 as an id or a name that does not exist
        # (cluster_create; issue 36, finding 8).
        members = [
            MemberSpec(
                role=m["role"],
                evaluation_id=m.get("evaluation"),
                build_id=m.get("build"),
                primary=m["primary"],
                pin=m.get("pin") or None,
            )
            for m in data["members"]
        ]
        try:
            cluster = cluster_create(
                members=members,
                same_zone=data["same_zone"],
                retry_budget=data["retry_budget"],
                priority=data["priority"],
                created_by=user,  # type: ignore[arg-type]
                now=timezone.now(),
            )
        except ClusterInputError as exc:
            raise serializers.ValidationError(exc.errors) from None
        return created(ClusterSerializer(cluster).data, route="cluster-detail", cluster_id=cluster.id)


class ClusterDetailView(APIView):
    @extend_schema(
        parameters=[OpenApiParameter("cluster_id", OpenApiTypes.UUID, OpenApiParameter.PATH)],
        responses={200: ClusterSerializer},
        summary="One cluster job, with its members and attempt history",
    )
    def get(self, request: Request, cluster_id: str) -> Response:
        return Response(ClusterSerializer(cluster_for(request.user, cluster_id)).data)


class ClusterAbortView(APIView):
    @extend_schema(
        request=None,
        parameters=[OpenApiParameter("cluster_id", OpenApiTypes.UUID, OpenApiParameter.PATH)],
        responses={
            202: OpenApiResponse(
                ControlReceiptSerializer, description="Abort recorded; the cluster ends Aborted"
            ),
            403: OpenApiResponse(description="Not staff"),
        },
        summary="Abort a cluster job (staff): a control intent on its record; running members get AbortJob",
    )
    def post(self, request: Request, cluster_id: str) -> Response:
        if not request.user.is_staff:
            raise PermissionDenied("Only staff may abort a cluster.")
        cluster = cluster_for(request.user, cluster_id)
        receipt = cluster_request_abort(
            cluster_id=cluster.id, actor=request.user.get_username(), now=timezone.now()
        )
        cluster.refresh_from_db()
        return Response(
            {
                "id": cluster.id,
                "status": cluster.status,
                "message": receipt.message if receipt is not None else "aborted",
            },
            status=status.HTTP_202_ACCEPTED,
        )
