"""REST routes of ../shared/spec/rest.md that the workers app owns: the token login, users, projects
and workers (register, list, deactivate).

Users and projects live here too, with the first routes that need them; the views only validate and
call services. Bad input is a 400 with field errors, an unknown id a 404, never a 500.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.validators import UnicodeUsernameValidator
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    PolymorphicProxySerializer,
    extend_schema,
)
from rest_framework import serializers, status
from rest_framework.authtoken.views import ObtainAuthToken
from rest_framework.exceptions import AuthenticationFailed, NotFound, Throttled, ValidationError
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from gradient.auth import issue_token
from gradient.core.ids import parse_uuid
from gradient.names import check_name
from gradient.parsers import JSONParser
from gradient.rest import (
    LOCATION,
    OperationSerializer,
    check_page_params,
    created,
    operation_body,
    paged,
    wants_pages,
)
from gradient.scheduling.models import Project
from gradient.scheduling.services import operations, projects
from gradient.throttling import AnonThrottle, UserThrottle, login_failed, login_refused_for
from gradient.workers import services
from gradient.workers.models import Worker
from gradient.workers.selectors import workers_with_session_state

# --- Serializers -----------------------------------------------------------------------------------


class ProjectNamesField(serializers.ListField):
    """A list of project names, resolved to Project rows; an unknown name is a field error."""

    child = serializers.CharField(max_length=200)

    def to_internal_value(self, data: Any) -> list[Project]:
        names: list[str] = list(dict.fromkeys(super().to_internal_value(data)))
        projects = {p.name: p for p in Project.objects.filter(name__in=names)}
        unknown = [n for n in names if n not in projects]
        if unknown:
            raise serializers.ValidationError(f"Unknown project(s): {', '.join(unknown)}.")
        return [projects[n] for n in names]


class TokenRequestSerializer(serializers.Serializer[Any]):
    username = serializers.CharField()
    password = serializers.CharField(style={"input_type": "password"}, trim_whitespace=False)


class TokenSerializer(serializers.Serializer[Any]):
    token = serializers.CharField()


class UserCreateSerializer(serializers.Serializer[Any]):
    username = serializers.CharField(max_length=150, validators=[UnicodeUsernameValidator()])
    password = serializers.CharField(write_only=True, trim_whitespace=False, max_length=4096)
    is_staff = serializers.BooleanField(default=False)
    projects = ProjectNamesField(default=list)

    def validate_username(self, value: str) -> str:
        if get_user_model().objects.filter(username=value).exists():
            raise serializers.ValidationError("A user with that username already exists.")
        return value


class UserSerializer(serializers.Serializer[Any]):
    id = serializers.IntegerField()
    username = serializers.CharField()
    is_staff = serializers.BooleanField()
    projects = serializers.ListField(child=serializers.CharField())


class NameField(serializers.CharField):
    """A name: a JSON string only (`{"name": 123}` is no name), at most 200 characters."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_length=200, **kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            raise serializers.ValidationError("A name is a string.")
        return str(super().to_internal_value(data))


def _checked_name(value: str, existing: Any, what: str) -> str:
    try:
        check_name(value, existing, what)
    except DjangoValidationError as exc:
        raise serializers.ValidationError(exc.messages) from None
    return value


class ProjectCreateSerializer(serializers.Serializer[Any]):
    name = NameField()

    def validate_name(self, value: str) -> str:
        return _checked_name(value, Project.objects.values_list("name", flat=True), "project")


class ProjectSerializer(serializers.Serializer[Any]):
    id = serializers.UUIDField()
    name = serializers.CharField()


class WorkerCreateSerializer(serializers.Serializer[Any]):
    name = NameField()
    projects = ProjectNamesField(default=list)

    def validate_name(self, value: str) -> str:
        return _checked_name(value, Worker.objects.values_list("name", flat=True), "worker")


class WorkerUpdateSerializer(serializers.Serializer[Any]):
    projects = ProjectNamesField(
        help_text="The names of the projects whose jobs the worker may take, replacing the ones it had."
    )


class WorkerCreatedSerializer(serializers.Serializer[Any]):
    id = serializers.UUIDField()
    token = serializers.CharField(help_text="The worker's token: shown only here, stored hashed.")


class WorkerSerializer(serializers.Serializer[Any]):
    id = serializers.UUIDField()
    name = serializers.CharField()
    connected = serializers.BooleanField(help_text="The worker has an open session.")
    draining = serializers.BooleanField(help_text="Its open session said Draining.")
    architectures = serializers.ListField(child=serializers.CharField())
    system_features = serializers.ListField(child=serializers.CharField())
    zone = serializers.CharField(allow_null=True)
    last_seen = serializers.DateTimeField(allow_null=True)
    active = serializers.BooleanField()
    projects = serializers.SerializerMethodField()
    capabilities = serializers.SerializerMethodField()
    max_concurrent_builds = serializers.IntegerField()
    cpu_count = serializers.IntegerField(allow_null=True)
    ram_total_mb = serializers.IntegerField(allow_null=True)
    cpu_core_score = serializers.IntegerField(allow_null=True)
    endpoint = serializers.CharField(allow_null=True)
    metrics = serializers.SerializerMethodField()

    def get_projects(self, worker: Worker) -> list[str]:
        return sorted(p.name for p in worker.projects.all())

    def get_capabilities(self, worker: Worker) -> dict[str, bool]:
        return {"fetch": worker.can_fetch, "eval": worker.can_eval, "build": worker.can_build}

    def get_metrics(self, worker: Worker) -> dict[str, Any]:
        return {
            "cpu_usage_pct": worker.cpu_usage_pct,
            "ram_free_mb": worker.ram_free_mb,
            "disk_speed_mbps": worker.disk_speed_mbps,
            "upload_speed_mbps": worker.upload_speed_mbps,
            "download_speed_mbps": worker.download_speed_mbps,
            "build_peak_ram_mb": worker.build_peak_ram_mb,
            "reported_at": worker.metrics_at.isoformat() if worker.metrics_at else None,
        }


PAGE_PARAMETERS = [
    OpenApiParameter(
        "limit",
        OpenApiTypes.INT,
        description="Page size (default 100, at most 1000): the answer is then "
        "`{count, next, previous, results}` instead of an array.",
    ),
    OpenApiParameter("offset", OpenApiTypes.INT, description="Rows to skip (the answer is then a page)."),
]


def _array_or_page(name: str, item: type[serializers.Serializer[Any]]) -> PolymorphicProxySerializer:
    """An array of `item` (rest.md's answer), or with limit/offset a page of them."""
    page = type(
        f"{name}Page",
        (serializers.Serializer,),
        {
            "count": serializers.IntegerField(),
            "next": serializers.URLField(allow_null=True),
            "previous": serializers.URLField(allow_null=True),
            "results": item(many=True),
        },
    )
    return PolymorphicProxySerializer(
        component_name=name, serializers=[item(many=True), page], resource_type_field_name=None, many=False
    )


# --- Views -----------------------------------------------------------------------------------------


class AuthTokenView(ObtainAuthToken):
    """POST /api/v1/auth/token: {username, password} -> {token}; send it as `Authorization: Token ...`."""

    throttle_classes = [AnonThrottle, UserThrottle]  # DRF's view has none: password guessing is bounded
    parser_classes = [FormParser, MultiPartParser, JSONParser]  # DRF's, with gradient.parsers' JSON
    takes_forms = True  # a login form is a form: its errors need no "the body must be JSON"

    @extend_schema(
        request=TokenRequestSerializer,
        responses={
            200: TokenSerializer,
            400: OpenApiResponse(description="A field is missing or malformed"),
            401: OpenApiResponse(description="The username and password name no active user"),
        },
        auth=[],
        summary="Exchange a username and password for an API token",
    )
    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        # Failed logins are limited per account and per address (gradient.throttling): over a limit the
        # password is not even checked.
        username = request.data.get("username") if isinstance(request.data, dict) else None
        username = username if isinstance(username, str) else ""
        wait = login_refused_for(request, username)
        if wait is not None:
            raise Throttled(wait=wait, detail="Too many failed logins.")
        serializer = self.get_serializer(data=request.data)
        if not serializer.is_valid():
            login_failed(request, username)
            given = isinstance(request.data, dict) and all(
                isinstance(request.data.get(f), str) and request.data.get(f) for f in ("username", "password")
            )
            if given and set(serializer.errors) == {"non_field_errors"}:
                # Both fields given, and they name no active user: the credentials are wrong (401);
                # a missing or malformed field stays a 400 with field errors.
                raise AuthenticationFailed(serializer.errors["non_field_errors"][0])
            raise ValidationError(serializer.errors)
        # A new hashed, expiring token per login (gradient.auth), in the shape DRF's view answered.
        return Response({"token": issue_token(serializer.validated_data["user"])})


def _user_data(user: Any) -> dict[str, Any]:
    return {
        "id": user.id,
        "username": user.username,
        "is_staff": user.is_staff,
        "projects": sorted(user.gradient_projects.values_list("name", flat=True)),
    }


def _user_or_404(user_id: str) -> Any:
    user = (
        get_user_model().objects.filter(id=int(user_id)).first()
        if user_id.isascii() and user_id.isdigit() and len(user_id) <= 18
        else None
    )
    if user is None:
        raise NotFound("No user with this id.")
    return user


class UsersView(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(
        parameters=PAGE_PARAMETERS,
        responses={200: _array_or_page("UserList", UserSerializer)},
        summary="List users (an array; with limit or offset, a page)",
        operation_id="api_v1_users_list",
    )
    def get(self, request: Request) -> Response:
        rows = get_user_model().objects.order_by("username").prefetch_related("gradient_projects")
        if wants_pages(request):
            check_page_params(request)
            return paged(request, self, rows, lambda page: [_user_data(u) for u in page])
        return Response([_user_data(u) for u in rows])

    @extend_schema(
        request=UserCreateSerializer,
        responses={201: UserSerializer},
        parameters=[LOCATION],
        summary="Create a user",
    )
    def post(self, request: Request) -> Response:
        serializer = UserCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        try:
            user = projects.user_create(
                username=data["username"],
                password=data["password"],
                is_staff=data["is_staff"],
                projects=data["projects"],
            )
        except IntegrityError:  # a concurrent create won the name
            raise serializers.ValidationError(
                {"username": ["A user with that username already exists."]}
            ) from None
        return created(_user_data(user), route="user-detail", user_id=user.id)


class ProjectsView(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(
        parameters=PAGE_PARAMETERS,
        responses={200: _array_or_page("ProjectList", ProjectSerializer)},
        summary="List projects (an array; with limit or offset, a page)",
        operation_id="api_v1_projects_list",
    )
    def get(self, request: Request) -> Response:
        rows = Project.objects.order_by("name")
        if wants_pages(request):
            check_page_params(request)
            return paged(request, self, rows, lambda page: [{"id": p.id, "name": p.name} for p in page])
        return Response([{"id": p.id, "name": p.name} for p in rows])

    @extend_schema(
        request=ProjectCreateSerializer,
        responses={201: ProjectSerializer},
        parameters=[LOCATION],
        summary="Create a project",
    )
    def post(self, request: Request) -> Response:
        serializer = ProjectCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            project = projects.project_create(name=serializer.validated_data["name"])
        except IntegrityError:
            raise serializers.ValidationError(
                {"name": ["A project with that name already exists."]}
            ) from None
        return created(
            {"id": project.id, "name": project.name}, route="project-detail", project_id=project.id
        )


class UserDetailView(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(
        parameters=[
            OpenApiParameter("user_id", OpenApiTypes.INT, OpenApiParameter.PATH, description="The user's id.")
        ],
        responses={200: UserSerializer},
        summary="One user",
    )
    def get(self, request: Request, user_id: str) -> Response:
        return Response(_user_data(_user_or_404(user_id)))


class ProjectDetailView(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(responses={200: ProjectSerializer}, summary="One project")
    def get(self, request: Request, project_id: str) -> Response:
        parsed = parse_uuid(project_id)
        project = Project.objects.filter(id=parsed).first() if parsed is not None else None
        if project is None:
            raise NotFound("No project with this id.")
        return Response({"id": project.id, "name": project.name})


def _worker_or_404(worker_id: str) -> Worker:
    parsed = parse_uuid(worker_id)
    worker = workers_with_session_state().filter(id=parsed).first() if parsed is not None else None
    if worker is None:
        raise NotFound("No worker with this id.")
    return worker


class WorkersView(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(
        parameters=PAGE_PARAMETERS,
        responses={200: _array_or_page("WorkerList", WorkerSerializer)},
        summary="List workers (an array; with limit or offset, a page)",
        operation_id="api_v1_workers_list",
    )
    def get(self, request: Request) -> Response:
        rows = workers_with_session_state().order_by("name")
        if wants_pages(request):
            check_page_params(request)
            return paged(request, self, rows, lambda page: WorkerSerializer(page, many=True).data)
        return Response(WorkerSerializer(rows, many=True).data)

    @extend_schema(
        request=WorkerCreateSerializer,
        responses={201: WorkerCreatedSerializer},
        parameters=[LOCATION],
        summary="Register a worker; its token is shown only in this answer",
    )
    def post(self, request: Request) -> Response:
        serializer = WorkerCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            worker, token = services.worker_register(
                name=serializer.validated_data["name"], projects=serializer.validated_data["projects"]
            )
        except IntegrityError:
            raise serializers.ValidationError({"name": ["A worker with that name already exists."]}) from None
        return created({"id": worker.id, "token": token}, route="worker-detail", worker_id=worker.id)


class WorkerDetailView(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(responses={200: WorkerSerializer}, summary="One worker")
    def get(self, request: Request, worker_id: str) -> Response:
        return Response(WorkerSerializer(_worker_or_404(worker_id)).data)

    @extend_schema(
        request=WorkerUpdateSerializer,
        responses={200: WorkerSerializer},
        summary="Set the projects a worker serves",
        description="`projects` replaces the worker's projects: from its next request it is offered and "
        "given only their evaluations and the builds their evaluations need; running jobs keep running. "
        "An unknown project name is a 400 that changes nothing.",
    )
    def patch(self, request: Request, worker_id: str) -> Response:
        worker = _worker_or_404(worker_id)
        serializer = WorkerUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        services.worker_set_projects(worker_id=worker.id, projects=serializer.validated_data["projects"])
        return Response(WorkerSerializer(_worker_or_404(str(worker.id))).data)


class WorkerDeactivateView(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(
        request=None,
        responses={200: WorkerSerializer},
        summary="Deactivate a worker: it is refused from now on (403) and its open session is closed",
    )
    def post(self, request: Request, worker_id: str) -> Response:
        worker = _worker_or_404(worker_id)
        # signed on the records of the jobs it runs, as every operator action (issue 16)
        operations.worker_request_deactivate(
            worker_id=worker.id, actor=request.user.get_username(), now=timezone.now()
        )
        return Response(WorkerSerializer(_worker_or_404(str(worker.id))).data)


class WorkerDrainView(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(
        request=None,
        responses={202: OperationSerializer},
        summary="Drain a connected worker: it gets nothing new from any server, its running jobs finish",
        description="A `drain_worker` intent on the records of the evaluations it runs. The mark is its "
        "open session's: a worker that reconnects is not draining.",
    )
    def post(self, request: Request, worker_id: str) -> Response:
        worker = _worker_or_404(worker_id)
        result = operations.worker_request_drain(
            worker_id=worker.id, actor=request.user.get_username(), now=timezone.now()
        )
        return Response(operation_body(result), status=status.HTTP_202_ACCEPTED)


class WorkerActivateView(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(
        request=None, responses={200: WorkerSerializer}, summary="Allow a deactivated worker again"
    )
    def post(self, request: Request, worker_id: str) -> Response:
        worker = _worker_or_404(worker_id)
        services.worker_activate(worker_id=worker.id)
        return Response(WorkerSerializer(_worker_or_404(str(worker.id))).data)
