"""REST routes of ../shared/spec/rest.md that the scheduling app owns: evaluations and builds.

A submitter may submit to and read the projects it is a member of; staff may do everything. Bad input
is a 400 with field errors, an unknown id a 404 (another project's job too: its id is not the caller's
to learn), never a 500.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpResponse
from django.urls import reverse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.permissions import IsAdminUser
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from gradient.core.ids import parse_uuid
from gradient.core.vocab import EVALUATION_ACTIVE, BuildStatus, EvaluationStatus, member_of
from gradient.idempotency import scoped_key
from gradient.records.errors import IdempotencyConflict
from gradient.rest import (
    LOCATION,
    ControlReceiptSerializer,
    OperationSerializer,
    check_page_params,
    operation_body,
    paged,
    uuid_or_404,
)
from gradient.rest import created as created_response
from gradient.scheduling import queue_position, selectors
from gradient.scheduling.decisions.logs import MAX_LINE_RANGE, MAX_MATCHES, LineQuery, parse_line_range
from gradient.scheduling.decisions.waiting import describe
from gradient.scheduling.models import BuildLog, DerivationBuild, Evaluation, EvaluationBuild, Project
from gradient.scheduling.services import operations
from gradient.scheduling.services.evaluations import (
    SubmissionGone,
    evaluation_create,
    evaluation_request_cancel,
)
from gradient.scheduling.services.logs import build_log_lines, build_log_read

IDEMPOTENCY_HEADER = "Idempotency-Key"


def visible_projects(user: Any) -> QuerySet[Project]:
    return Project.objects.all() if user.is_staff else Project.objects.filter(members=user)


def evaluation_for(user: Any, evaluation_id: str) -> Evaluation:
    """The evaluation; 404 when unknown, and when it belongs to a project the user may not read (a 403
    would tell an outsider that the id exists: issue 36, finding 8)."""
    evaluation = Evaluation.objects.select_related("project").filter(id=uuid_or_404(evaluation_id)).first()
    if evaluation is None:
        raise NotFound("No evaluation with this id.")
    if not user.is_staff and not evaluation.project.members.filter(id=user.id).exists():
        raise NotFound("No evaluation with this id.")
    return evaluation


# --- Serializers -----------------------------------------------------------------------------------------


class EvaluationCreateSerializer(serializers.Serializer[Any]):
    project = serializers.CharField(max_length=200, help_text="The project's name.")
    repository = serializers.CharField(
        max_length=2048, help_text="A flake URL, a `sim:` URL or a store path."
    )
    commit = serializers.CharField(max_length=255)
    wildcards = serializers.ListField(
        child=serializers.CharField(max_length=500), default=list, max_length=100
    )
    wait_for_workers = serializers.BooleanField(default=False)
    priority = serializers.BooleanField(
        default=False, help_text="Prioritized (+5000 in scoring); staff only."
    )

    def validate_project(self, value: str) -> Project:
        project = Project.objects.filter(name=value).first()
        if project is None:
            raise serializers.ValidationError(f"Unknown project: {value}.")
        return project


class BuildRefSerializer(serializers.Serializer[Any]):
    id = serializers.UUIDField()
    name = serializers.CharField(help_text="The derivation's name without its store hash: hello-2.12.")
    drv_path = serializers.CharField()
    status = serializers.CharField()


class FailedBuildSerializer(serializers.Serializer[Any]):
    id = serializers.UUIDField()
    name = serializers.CharField(help_text="The derivation's name without its store hash: hello-2.12.")
    drv_path = serializers.CharField()
    status = serializers.CharField()
    last_error = serializers.CharField()


class QueueSerializer(serializers.Serializer[Any]):
    """Where a waiting job stands (spec/rest.md; gradient.scheduling.queue_position)."""

    position = serializers.IntegerField(
        help_text="1-based place in the order a worker that sent no scores is handed the jobs the same "
        "workers can run; 1 is the next one handed out."
    )
    ahead = serializers.IntegerField(help_text="position - 1.")
    slots = serializers.IntegerField(help_text="Connected slots of its kind that can run it.")
    busy = serializers.IntegerField(help_text="How many of those slots hold a job.")
    expected_start = serializers.DateTimeField(allow_null=True)
    expected_finish = serializers.DateTimeField(allow_null=True)
    basis = serializers.ChoiceField(
        choices=["derivation", "project", "default", "none"],
        help_text="What the estimate rests on: past tries of the same derivation, of the project, the "
        "configured default, or nothing (no slot can run it, or no history and no default; the times are "
        "null).",
    )


def queue_body(standing: queue_position.QueueStanding | None) -> dict[str, Any] | None:
    if standing is None:
        return None
    return QueueSerializer(standing).data


class HolderSerializer(serializers.Serializer[Any]):
    cluster = serializers.UUIDField(help_text="The cluster (`GET /api/v1/clusters/{id}`).")
    slots = serializers.IntegerField(help_text="How many of the slots it holds.")
    running = serializers.BooleanField(
        help_text="true: its members run on them; false: a reservation keeps them free for it while it "
        "waits to be placed (they take no single job meanwhile)."
    )
    until = serializers.DateTimeField(
        allow_null=True, help_text="When the reservation expires; null if running."
    )


class BusySlotsSerializer(serializers.Serializer[Any]):
    """What a waiting job waits for beside `queue` (issue 33): until when its slots are busy, and who
    holds them (gradient.scheduling.queue_position.QueueStanding)."""

    next_free = serializers.DateTimeField(
        allow_null=True,
        help_text="When the first busy slot is expected to free: its job's start plus that job's typical "
        "duration (its derivation's in the latest tries of the project, else theirs on average); null when "
        "none is busy or there is nothing to go on.",
    )
    busy_until = serializers.DateTimeField(
        allow_null=True, help_text="When the last busy slot is expected to free; null as next_free."
    )
    held = serializers.IntegerField(
        help_text="Free slots a waiting cluster's reservation holds: they take no single job (the estimate "
        "counts them as busy)."
    )
    holders = HolderSerializer(many=True, help_text="The clusters holding any of the slots.")


def busy_slots_body(standing: queue_position.QueueStanding | None) -> dict[str, Any] | None:
    if standing is None:
        return None
    return BusySlotsSerializer(standing).data


BUSY_SLOTS_HELP = (
    "While Queued, beside `queue`: until when its slots are busy and which clusters hold any (an addition "
    "to spec/rest.md's queue object); null otherwise"
)


class EvaluationSerializer(serializers.Serializer[Any]):
    id = serializers.UUIDField()
    project = serializers.CharField(source="project.name")
    kind = serializers.CharField()
    status = serializers.CharField()
    repository = serializers.CharField()
    commit = serializers.CharField()
    wildcards = serializers.ListField(child=serializers.CharField())
    wait_for_workers = serializers.BooleanField()
    priority = serializers.BooleanField()
    waiting_reason = serializers.JSONField(allow_null=True)
    waiting_reason_text = serializers.SerializerMethodField()
    waiting_since = serializers.DateTimeField(allow_null=True)
    warnings = serializers.SerializerMethodField(
        help_text="What the evaluation warned of (capped: GRADIENT_EVAL_MESSAGES_MAX_COUNT and _BYTES; a "
        "last line says how many were left out). Empty in lists: the evaluation's own route has them."
    )
    errors = serializers.SerializerMethodField(  # type: ignore[assignment]
        help_text="Its errors, capped as the warnings are. Empty in lists."
    )
    created_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)
    builds = serializers.SerializerMethodField(
        help_text="The shared builds it needs. Empty in lists (`progress` counts them there): the "
        "evaluation's own route has them."
    )
    progress = serializers.SerializerMethodField(
        help_text='Its builds by where they are, in words: "412/1030 built, 3 failed, 615 queued".'
    )
    failed_builds = serializers.SerializerMethodField(
        help_text="The builds that failed it (or await a retry), with their errors. Empty in lists "
        "(`progress` counts them there): the evaluation's own route has them."
    )
    waiting_next = serializers.SerializerMethodField(
        help_text='While it waits, what happens next in words ("aborted at 07:13:00 UTC unless a worker '
        'for aarch64-linux connects"); empty otherwise.'
    )
    queue = serializers.SerializerMethodField(
        help_text="Where it stands while Queued; null otherwise, and in lists (the evaluation's own route "
        "has it)."
    )
    expected_finish = serializers.SerializerMethodField(
        help_text="While Building, when its last build is expected to end (its remaining builds' critical "
        "path over the slots); null otherwise, and in lists."
    )

    busy_slots = serializers.SerializerMethodField(help_text=f"{BUSY_SLOTS_HELP}, and in lists.")

    def _standing(self, obj: Evaluation) -> queue_position.QueueStanding | None:
        """The evaluation's standing, read once for `queue` and `busy_slots`."""
        cache: dict[Any, queue_position.QueueStanding | None] = self.__dict__.setdefault("_standings", {})
        if obj.id not in cache:
            cache[obj.id] = queue_position.evaluation_queue(obj, timezone.now())
        return cache[obj.id]

    @extend_schema_field(QueueSerializer(allow_null=True))
    def get_queue(self, obj: Evaluation) -> dict[str, Any] | None:
        if not self.context.get("with_builds", True):
            return None
        return queue_body(self._standing(obj))

    @extend_schema_field(BusySlotsSerializer(allow_null=True))
    def get_busy_slots(self, obj: Evaluation) -> dict[str, Any] | None:
        if not self.context.get("with_builds", True):
            return None
        return busy_slots_body(self._standing(obj))

    @extend_schema_field(serializers.DateTimeField(allow_null=True))
    def get_expected_finish(self, obj: Evaluation) -> str | None:
        if not self.context.get("with_builds", True):
            return None
        finish = queue_position.evaluation_expected_finish(obj, timezone.now())
        return serializers.DateTimeField().to_representation(finish) if finish is not None else None

    # Lists leave them out (and never load them: EvaluationsView defers both columns): a page of 100
    # evaluations with large messages each made `serve` hold hundreds of MiB per request.
    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_warnings(self, obj: Evaluation) -> list[str]:
        return list(obj.warnings) if self.context.get("with_builds", True) else []

    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_errors(self, obj: Evaluation) -> list[str]:
        return list(obj.errors) if self.context.get("with_builds", True) else []

    def get_waiting_next(self, obj: Evaluation) -> str:
        return selectors.evaluation_next_step(obj)

    def get_waiting_reason_text(self, obj: Evaluation) -> str:
        return describe(obj.waiting_reason)

    def get_progress(self, obj: Evaluation) -> str:
        return str(selectors.evaluation_progress(obj.id))

    @extend_schema_field(FailedBuildSerializer(many=True))
    def get_failed_builds(self, obj: Evaluation) -> list[dict[str, Any]]:
        if not self.context.get("with_builds", True):
            return []
        return [
            {
                "id": b.id,
                "name": b.name,
                "drv_path": b.drv_path,
                "status": b.status,
                "last_error": b.last_error,
            }
            for b in selectors.evaluation_failed_builds(obj.id)
        ]

    @extend_schema_field(BuildRefSerializer(many=True))
    def get_builds(self, obj: Evaluation) -> list[dict[str, Any]]:
        if not self.context.get("with_builds", True):
            return []
        rows = obj.build_links.select_related("build").order_by("build__created_at", "build__drv_path")
        return [
            {
                "id": link.build.id,
                "name": link.build.name,
                "drv_path": link.build.drv_path,
                "status": link.build.status,
            }
            for link in rows
        ]


class DependencySerializer(serializers.Serializer[Any]):
    id = serializers.UUIDField()
    name = serializers.CharField()
    status = serializers.CharField()


class BuildSerializer(serializers.Serializer[Any]):
    id = serializers.UUIDField()
    name = serializers.CharField(help_text="The derivation's name without its store hash: hello-2.12.")
    drv_path = serializers.CharField()
    system = serializers.CharField()
    status = serializers.CharField()
    required_features = serializers.ListField(child=serializers.CharField())
    outputs = serializers.JSONField()
    attempts = serializers.IntegerField()
    failure_kind = serializers.CharField(allow_null=True)
    last_error = serializers.CharField(help_text='The failure\'s text ("" when none).')
    log_url = serializers.SerializerMethodField(
        help_text="The path of this build's log (`GET /api/v1/builds/{id}/log`), or null without one yet."
    )
    log_link = serializers.SerializerMethodField(
        help_text="`log_url` as an absolute URL, as the API index gives its links; null without a log."
    )
    dependencies = serializers.SerializerMethodField(help_text="The ids of the builds it needs.")
    dependency_builds = serializers.SerializerMethodField(
        help_text="The builds it needs, by name, in the order of `dependencies`."
    )
    created_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)
    queue = serializers.SerializerMethodField(help_text="Where it stands while Queued; null otherwise.")
    busy_slots = serializers.SerializerMethodField(help_text=f"{BUSY_SLOTS_HELP}.")

    def _standing(self, obj: DerivationBuild) -> queue_position.QueueStanding | None:
        """The build's standing, read once for `queue` and `busy_slots`."""
        cache: dict[Any, queue_position.QueueStanding | None] = self.__dict__.setdefault("_standings", {})
        if obj.id not in cache:
            cache[obj.id] = queue_position.build_queue(obj, timezone.now())
        return cache[obj.id]

    @extend_schema_field(QueueSerializer(allow_null=True))
    def get_queue(self, obj: DerivationBuild) -> dict[str, Any] | None:
        return queue_body(self._standing(obj))

    @extend_schema_field(BusySlotsSerializer(allow_null=True))
    def get_busy_slots(self, obj: DerivationBuild) -> dict[str, Any] | None:
        return busy_slots_body(self._standing(obj))

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_log_url(self, obj: DerivationBuild) -> str | None:
        if not BuildLog.objects.filter(build=obj).exists():
            return None
        return reverse("build-log", kwargs={"build_id": str(obj.id)})

    @extend_schema_field(serializers.URLField(allow_null=True))
    def get_log_link(self, obj: DerivationBuild) -> str | None:
        path = self.get_log_url(obj)
        request = self.context.get("request")
        return request.build_absolute_uri(path) if path is not None and request is not None else path

    def _dependencies(self, obj: DerivationBuild) -> list[DerivationBuild]:
        edges = obj.dependency_edges.select_related("dependency").order_by("dependency__drv_path")
        return [edge.dependency for edge in edges]

    def get_dependencies(self, obj: DerivationBuild) -> list[uuid.UUID]:
        return [d.id for d in self._dependencies(obj)]

    @extend_schema_field(DependencySerializer(many=True))
    def get_dependency_builds(self, obj: DerivationBuild) -> list[dict[str, Any]]:
        return [{"id": d.id, "name": d.name, "status": d.status} for d in self._dependencies(obj)]


class EvaluationPageSerializer(serializers.Serializer[Any]):
    count = serializers.IntegerField(help_text="Evaluations matching the filters.")
    next = serializers.URLField(allow_null=True, help_text="The next page, or null on the last one.")
    previous = serializers.URLField(allow_null=True)
    results = EvaluationSerializer(
        many=True,
        help_text="This page; `builds`, `failed_builds`, `warnings` and `errors` are omitted in lists (left "
        "empty; `progress` counts the builds): read one evaluation for them.",
    )


# --- Views -----------------------------------------------------------------------------------------------


class EvaluationsView(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter("status", OpenApiTypes.STR, description="Filter by status, e.g. Waiting."),
            OpenApiParameter("project", OpenApiTypes.STR, description="Filter by project name."),
            OpenApiParameter("limit", OpenApiTypes.INT, description="Page size (default 100, at most 1000)."),
            OpenApiParameter("offset", OpenApiTypes.INT, description="Evaluations to skip."),
        ],
        responses={200: EvaluationPageSerializer},
        summary="List evaluations you may read, newest first",
        operation_id="v1_evaluations_list",
    )
    def get(self, request: Request) -> Response:
        check_page_params(request)
        qs = (
            Evaluation.objects.filter(project__in=visible_projects(request.user))
            .select_related("project")
            .defer("warnings", "errors")
        )
        wanted_status = request.query_params.get("status")
        if wanted_status:
            if member_of(EvaluationStatus, wanted_status) is None:
                raise serializers.ValidationError({"status": [f"Unknown status: {wanted_status}."]})
            qs = qs.filter(status=wanted_status)
        if request.query_params.get("project"):
            qs = qs.filter(project__name=request.query_params["project"])
        return paged(
            request,
            self,
            qs.order_by("-created_at", "id"),
            lambda page: EvaluationSerializer(page, many=True, context={"with_builds": False}).data,
        )

    @extend_schema(
        request=EvaluationCreateSerializer,
        parameters=[
            OpenApiParameter(
                IDEMPOTENCY_HEADER,
                OpenApiTypes.STR,
                OpenApiParameter.HEADER,
                description="A repeat with the same key and body returns the same evaluation (200); "
                "the same key with another body is a 409.",
            ),
            LOCATION,
        ],
        responses={
            201: EvaluationSerializer,
            200: OpenApiResponse(EvaluationSerializer, description="An idempotent repeat"),
            403: OpenApiResponse(description="Not a member of the project"),
            409: OpenApiResponse(description="The Idempotency-Key names another submission"),
        },
        summary="Submit an evaluation",
    )
    def post(self, request: Request) -> Response:
        serializer = EvaluationCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        project: Project = data["project"]
        user = request.user
        if not user.is_staff and not project.members.filter(pk=user.pk).exists():  # type: ignore[misc]
            raise PermissionDenied("You may not submit to this project.")
        if data["priority"] and not user.is_staff:
            raise PermissionDenied("Only staff may submit prioritized evaluations.")
        key = request.headers.get(IDEMPOTENCY_HEADER) or None
        if key is not None and len(key) > 255:
            raise serializers.ValidationError({IDEMPOTENCY_HEADER: ["At most 255 characters."]})
        try:
            with transaction.atomic():
                evaluation, created = evaluation_create(
                    project=project,
                    repository=data["repository"],
                    commit=data["commit"],
                    wildcards=data["wildcards"],
                    wait_for_workers=data["wait_for_workers"],
                    priority=data["priority"],
                    created_by=user,  # type: ignore[arg-type]
                    idempotency_key=scoped_key(user, key) if key is not None else None,  # per user
                    now=timezone.now(),
                )
        except SubmissionGone:
            return Response(
                {"detail": f"{IDEMPOTENCY_HEADER} {key!r} names a submission that was since deleted."},
                status=status.HTTP_409_CONFLICT,
            )
        except IdempotencyConflict:
            return Response(
                {"detail": f"{IDEMPOTENCY_HEADER} {key!r} was used for another submission."},
                status=status.HTTP_409_CONFLICT,
            )
        body = EvaluationSerializer(evaluation).data
        if created:
            return created_response(body, route="evaluation-detail", evaluation_id=evaluation.id)
        return Response(body, status=status.HTTP_200_OK)


class EvaluationDetailView(APIView):
    @extend_schema(responses={200: EvaluationSerializer}, summary="One evaluation, with its shared builds")
    def get(self, request: Request, evaluation_id: str) -> Response:
        return Response(EvaluationSerializer(evaluation_for(request.user, evaluation_id)).data)


class EvaluationCancelView(APIView):
    @extend_schema(
        request=None,
        responses={
            202: OpenApiResponse(
                ControlReceiptSerializer, description="Cancel recorded; the evaluation ends Aborted"
            ),
            400: OpenApiResponse(description="The evaluation ended Completed or Failed: nothing changed"),
        },
        summary="Cancel an evaluation: a control intent on its record; running jobs get AbortJob",
        description="An evaluation that ended Completed or Failed is a 400 that changes nothing (its "
        "record gets no intent); one that is Aborted already answers 202 again (it stays cancelled).",
    )
    def post(self, request: Request, evaluation_id: str) -> Response:
        evaluation = evaluation_for(request.user, evaluation_id)
        if evaluation.status not in EVALUATION_ACTIVE and evaluation.status != EvaluationStatus.ABORTED:
            refused = f"Only an active evaluation can be cancelled; this one is {evaluation.status}."
            raise serializers.ValidationError({"non_field_errors": [refused]})
        receipt = evaluation_request_cancel(
            evaluation_id=evaluation.id,
            actor=request.user.get_username(),
            now=timezone.now(),
        )
        evaluation.refresh_from_db()
        return Response(
            {
                "id": evaluation.id,
                "status": evaluation.status,
                "message": receipt.message if receipt is not None else "cancelled",
            },
            status=status.HTTP_202_ACCEPTED,
        )


def build_for(user: Any, build_id: str) -> DerivationBuild:
    """The build; 404 when unknown, and when no evaluation of the user's projects needs it."""
    build = DerivationBuild.objects.filter(id=uuid_or_404(build_id)).first()
    if build is None:
        raise NotFound("No build with this id.")
    if not user.is_staff and not selectors.build_visible_to(build.id, user):
        raise NotFound("No build with this id.")
    return build


class BuildListItemSerializer(serializers.Serializer[Any]):
    id = serializers.UUIDField()
    name = serializers.CharField(help_text="The derivation's name without its store hash: hello-2.12.")
    drv_path = serializers.CharField()
    system = serializers.CharField()
    status = serializers.CharField()
    created_at = serializers.DateTimeField()


class BuildPageSerializer(serializers.Serializer[Any]):
    count = serializers.IntegerField(help_text="Builds matching the filters.")
    next = serializers.URLField(allow_null=True, help_text="The next page, or null on the last one.")
    previous = serializers.URLField(allow_null=True)
    results = BuildListItemSerializer(many=True)


class BuildsView(APIView):
    @extend_schema(
        parameters=[
            OpenApiParameter(
                "status", OpenApiTypes.STR, description="Filter by status, e.g. FailedPermanent."
            ),
            OpenApiParameter(
                "evaluation", OpenApiTypes.UUID, description="Only the builds this evaluation needs."
            ),
            OpenApiParameter("project", OpenApiTypes.STR, description="Filter by project name."),
            OpenApiParameter("limit", OpenApiTypes.INT, description="Page size (default 100, at most 1000)."),
            OpenApiParameter("offset", OpenApiTypes.INT, description="Builds to skip."),
        ],
        responses={200: BuildPageSerializer},
        summary="List the shared builds you may read, newest first (always paged)",
        operation_id="v1_builds_list",
    )
    def get(self, request: Request) -> Response:
        check_page_params(request)
        params = request.query_params
        qs = DerivationBuild.objects.all()
        if not request.user.is_staff:
            qs = qs.filter(
                id__in=EvaluationBuild.objects.filter(evaluation__project__members=request.user.pk).values(
                    "build_id"
                )
            )
        errors: dict[str, list[str]] = {}
        wanted_status = params.get("status")
        if wanted_status:
            if member_of(BuildStatus, wanted_status) is None:
                errors["status"] = [f"Unknown status: {wanted_status}."]
            qs = qs.filter(status=wanted_status)
        # The evaluation and project filters look only at what the caller may read: a shared build that
        # another project also needs must not say so (issue 36, finding 8: `?project=<another>` counted
        # that project's builds among the caller's).
        links = (
            EvaluationBuild.objects.all()
            if request.user.is_staff
            else EvaluationBuild.objects.filter(evaluation__project__members=request.user.pk)
        )
        if params.get("evaluation"):
            evaluation_id = parse_uuid(params["evaluation"])
            if evaluation_id is None:
                errors["evaluation"] = ["evaluation must be an evaluation id (a UUID)."]
                evaluation_id = uuid.UUID(int=0)
            qs = qs.filter(id__in=links.filter(evaluation_id=evaluation_id).values("build_id"))
        if params.get("project"):
            qs = qs.filter(
                id__in=links.filter(evaluation__project__name=params["project"]).values("build_id")
            )
        if errors:
            raise serializers.ValidationError(errors)
        return paged(
            request,
            self,
            qs.order_by("-created_at", "id"),
            lambda page: BuildListItemSerializer(page, many=True).data,
        )


class BuildDetailView(APIView):
    @extend_schema(responses={200: BuildSerializer}, summary="One shared build, with its dependencies")
    def get(self, request: Request, build_id: str) -> Response:
        build = build_for(request.user, build_id)
        return Response(BuildSerializer(build, context={"request": request}).data)


# --- The operator's actions (beside the routes of rest.md) ------------------------------------------------


def _operate(action: Any, **kwargs: Any) -> Response:
    """Run an operator action; one that does not apply now is a 400 that changed nothing."""
    try:
        result = action(now=timezone.now(), **kwargs)
    except operations.ActionRefused as exc:
        raise serializers.ValidationError({"non_field_errors": [str(exc)]}) from None
    return Response(operation_body(result), status=status.HTTP_202_ACCEPTED)


_ACCEPTED = {202: OperationSerializer}


class RestartSerializer(serializers.Serializer[Any]):
    rebuild_failed = serializers.BooleanField(
        default=False,
        help_text="Rebuild the evaluation's failed builds first (a `rebuild` intent each), so the new "
        "evaluation builds them again instead of failing on them at once; staff only.",
    )


class EvaluationRestartView(APIView):
    @extend_schema(
        request=RestartSerializer,
        responses=_ACCEPTED,
        summary="Restart a finished evaluation: a new evaluation of the same commit supersedes it",
        description="A `resubmit` intent on its record; the new evaluation's record header names the old "
        "one and is one generation later. With `rebuild_failed`, its failed builds are rebuilt first. "
        "400 when the evaluation has not finished.",
    )
    def post(self, request: Request, evaluation_id: str) -> Response:
        evaluation = evaluation_for(request.user, evaluation_id)
        body = RestartSerializer(data=request.data if isinstance(request.data, dict) else {})
        body.is_valid(raise_exception=True)
        rebuild_failed = body.validated_data["rebuild_failed"]
        if rebuild_failed and not request.user.is_staff:
            raise PermissionDenied("Only staff may rebuild builds.")
        return _operate(
            operations.evaluation_restart,
            evaluation_id=evaluation.id,
            actor=request.user.get_username(),
            rebuild_failed=rebuild_failed,
        )


class EvaluationPrioritizeView(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(
        request=None,
        responses=_ACCEPTED,
        summary="Prioritize an active evaluation and its pending builds (Qos: ahead of the queue); staff",
    )
    def post(self, request: Request, evaluation_id: str) -> Response:
        evaluation = evaluation_for(request.user, evaluation_id)
        return _operate(
            operations.evaluation_prioritize, evaluation_id=evaluation.id, actor=request.user.get_username()
        )


class BuildRebuildView(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(
        request=None,
        responses=_ACCEPTED,
        summary="Rebuild a finished or failed shared build: it is queued afresh; staff",
        description="A `rebuild` intent on the record of every evaluation that needs it. 400 when the "
        "build has not finished.",
    )
    def post(self, request: Request, build_id: str) -> Response:
        build = build_for(request.user, build_id)  # staff only: every build is visible
        return _operate(operations.build_rebuild, build_id=build.id, actor=request.user.get_username())


class BuildPrioritizeView(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(
        request=None,
        responses=_ACCEPTED,
        summary="Prioritize a pending shared build (Qos: ahead of the queue); staff",
    )
    def post(self, request: Request, build_id: str) -> Response:
        build = build_for(request.user, build_id)  # staff only: every build is visible
        return _operate(operations.build_prioritize, build_id=build.id, actor=request.user.get_username())


class LogNegotiation(BaseContentNegotiation):
    """The log is text/plain whatever the client accepts, and an error is the usual JSON object: no
    406 for a client that asks for text/plain only."""

    def select_parser(self, request: Request, parsers: Any) -> Any:
        return parsers[0] if parsers else None

    def select_renderer(self, request: Request, renderers: Any, format_suffix: Any = None) -> Any:
        return renderers[0], renderers[0].media_type


LOG_OFFSET_HEADER = "X-Log-Offset"
LOG_COMPLETE_HEADER = "X-Log-Complete"
LOG_ASSIGNMENT_HEADER = "X-Log-Assignment"
LOG_LINES_HEADER = "X-Log-Lines"
LOG_MORE_HEADER = "X-Log-More"


class BuildLogView(APIView):
    renderer_classes = [JSONRenderer]
    content_negotiation_class = LogNegotiation

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "assignment",
                OpenApiTypes.UUID,
                description="An earlier assignment of the build (its `dispatched_job` id); default: the "
                "latest assignment that sent a log.",
            ),
            OpenApiParameter(
                "offset", OpenApiTypes.INT, description="The text from this character on (default 0)."
            ),
            OpenApiParameter(
                "lines",
                OpenApiTypes.STR,
                description="Only these lines, numbered from 1: `120-180`, `120-` (to the end) or `120`; at "
                f"most {MAX_LINE_RANGE} of them. The answer is their text (header `{LOG_LINES_HEADER}`: "
                "the numbers of the first and last line sent). Read from the stored log piece by piece, "
                "never the whole log at once.",
            ),
            OpenApiParameter(
                "q",
                OpenApiTypes.STR,
                description="Only the lines containing this text (case-insensitive), each as "
                f"`<line number>:<line>`, as `grep -n` prints them; at most {MAX_MATCHES} (then header "
                f"`{LOG_MORE_HEADER}: true`). With `lines`, within those lines.",
            ),
            OpenApiParameter(
                LOG_LINES_HEADER,
                OpenApiTypes.STR,
                OpenApiParameter.HEADER,
                description="With `lines` or `q`: `<first>-<last>`, the numbers of the lines sent (empty "
                "when none).",
                response=[200],
            ),
            OpenApiParameter(
                "missing",
                OpenApiTypes.STR,
                enum=["404", "empty"],
                description="`empty`: a build without a log (yet) answers 204 instead of 404, for a page "
                "that follows a build before it starts (default `404`).",
            ),
            OpenApiParameter(
                LOG_OFFSET_HEADER,
                OpenApiTypes.INT,
                OpenApiParameter.HEADER,
                description="The character the text starts at (`offset`).",
                response=[200],
            ),
            OpenApiParameter(
                LOG_COMPLETE_HEADER,
                OpenApiTypes.STR,
                OpenApiParameter.HEADER,
                description="`true` once the assignment is closed, `false` while it is open.",
                response=[200],
                enum=["true", "false"],
            ),
            OpenApiParameter(
                LOG_ASSIGNMENT_HEADER,
                OpenApiTypes.UUID,
                OpenApiParameter.HEADER,
                description="The assignment whose log this is (a retried build has one per try).",
                response=[200],
            ),
        ],
        responses={
            (200, "text/plain"): OpenApiResponse(
                OpenApiTypes.STR,
                description="The log as far as it has arrived (live while the build runs).",
            ),
            204: OpenApiResponse(description="With `missing=empty`: the build has no log yet."),
            404: OpenApiResponse(description="No such build, or the build has no log (of that assignment)."),
        },
        summary="A build's log, as text; follow it with ?offset=",
        operation_id="v1_builds_log_retrieve",
    )
    def get(self, request: Request, build_id: str) -> HttpResponse:
        build = build_for(request.user, build_id)
        errors: dict[str, list[str]] = {}
        raw_offset = request.query_params.get("offset")
        offset = 0
        if raw_offset is not None:
            if raw_offset.isascii() and raw_offset.isdigit() and len(raw_offset) <= 18:
                offset = int(raw_offset)
            else:
                errors["offset"] = ["offset must be a non-negative integer."]
        raw_assignment = request.query_params.get("assignment")
        assignment_id: uuid.UUID | None = None
        if raw_assignment is not None:
            try:
                assignment_id = uuid.UUID(raw_assignment)
            except ValueError:
                errors["assignment"] = ["assignment must be an assignment id (a UUID)."]
        missing = request.query_params.get("missing", "404")
        if missing not in ("404", "empty"):
            errors["missing"] = ["missing must be 404 or empty."]
        raw_lines, needle = request.query_params.get("lines"), request.query_params.get("q")
        line_range: tuple[int, int | None] = (1, None)
        if raw_lines is not None:
            parsed = parse_line_range(raw_lines)
            if isinstance(parsed, str):
                errors["lines"] = [parsed]
            else:
                line_range = parsed
        if needle is not None and not needle:
            errors["q"] = ["q must not be empty."]
        if (raw_lines is not None or needle is not None) and raw_offset is not None:
            errors["offset"] = ["offset reads characters; it does not go with lines or q."]
        if errors:
            raise serializers.ValidationError(errors)
        if raw_lines is not None or needle is not None:
            query = LineQuery(first=line_range[0], last=line_range[1], text=needle or "")
            return _log_lines(build, assignment_id, query, missing=missing)
        found = build_log_read(build=build, assignment_id=assignment_id, offset=offset)
        if found is None:
            return _no_log(assignment_id, missing=missing)
        response = HttpResponse(found.text, content_type="text/plain; charset=utf-8")
        response[LOG_OFFSET_HEADER] = str(found.offset)
        response[LOG_COMPLETE_HEADER] = "true" if found.complete else "false"
        response[LOG_ASSIGNMENT_HEADER] = str(found.assignment_id)
        response["Cache-Control"] = "no-store"
        return response


def _no_log(assignment_id: uuid.UUID | None, *, missing: str) -> HttpResponse:
    """A build without a log (of that assignment): 204 with `missing=empty`, else 404."""
    if missing == "empty":
        nothing = HttpResponse(status=204)
        nothing[LOG_COMPLETE_HEADER] = "false"
        nothing["Cache-Control"] = "no-store"
        return nothing
    raise NotFound("This build has no log." if assignment_id is None else "No log of this assignment.")


def _log_lines(
    build: DerivationBuild, assignment_id: uuid.UUID | None, query: LineQuery, *, missing: str
) -> HttpResponse:
    found = build_log_lines(build=build, assignment_id=assignment_id, query=query)
    if found is None:
        return _no_log(assignment_id, missing=missing)
    if query.text:
        text = "".join(f"{n}:{line}\n" for n, line in found.lines)
    else:
        text = "".join(f"{line}\n" for _, line in found.lines)
    response = HttpResponse(text, content_type="text/plain; charset=utf-8")
    response[LOG_LINES_HEADER] = f"{found.lines[0][0]}-{found.lines[-1][0]}" if found.lines else ""
    response[LOG_COMPLETE_HEADER] = "true" if found.complete else "false"
    response[LOG_ASSIGNMENT_HEADER] = str(found.assignment_id)
    response["Cache-Control"] = "no-store"
    if found.more:
        response[LOG_MORE_HEADER] = "true"
    return response
