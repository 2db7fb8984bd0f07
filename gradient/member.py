"""The read-only web view for project members (`/my/`): the evaluations of their projects (status,
waiting in words, progress), an evaluation's builds, a build's log. Staff keep the console; a member
signs in here with the same account as for REST and sees what REST lets them read (a project they are a
member of; staff see every project), with the console's names and time style. Nothing here changes
anything."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import path
from django.views.decorators.http import require_safe

from gradient.console import ago, between, with_relative_deadline
from gradient.core.ids import parse_uuid
from gradient.scheduling import selectors
from gradient.scheduling.decisions.logs import plain_text
from gradient.scheduling.decisions.waiting import describe
from gradient.scheduling.models import DerivationBuild, Evaluation, Project
from gradient.scheduling.services.logs import build_log_window
from gradient.throttling import limit_admin_login

PAGE_SIZE = 50
LOGIN = "/my/login/"


def projects_of(user: Any) -> QuerySet[Project]:
    """What REST lets the user read (scheduling.api.visible_projects): staff every project."""
    return Project.objects.all() if user.is_staff else Project.objects.filter(members=user)


def evaluation_name(evaluation: Evaluation) -> str:
    return f"{evaluation.repository}@{evaluation.commit[:12]}"


def _evaluation_or_refuse(user: Any, raw_id: str) -> Evaluation:
    evaluation_id = parse_uuid(raw_id)
    evaluation = (
        Evaluation.objects.select_related("project").filter(id=evaluation_id).first()
        if evaluation_id
        else None
    )
    if evaluation is None:
        raise Http404("No evaluation with this id.")
    if not user.is_staff and not evaluation.project.members.filter(id=user.id).exists():
        raise PermissionDenied("You are not a member of this evaluation's project.")
    return evaluation


def _build_or_refuse(user: Any, raw_id: str) -> DerivationBuild:
    build_id = parse_uuid(raw_id)
    build = DerivationBuild.objects.filter(id=build_id).first() if build_id else None
    if build is None:
        raise Http404("No build with this id.")
    if not user.is_staff and not selectors.build_visible_to(build.id, user):
        raise PermissionDenied("No evaluation of your projects needs this build.")
    return build


def _row(evaluation: Evaluation) -> dict[str, Any]:
    return {
        "evaluation": evaluation,
        "name": evaluation_name(evaluation),
        "created": ago(evaluation.created_at),
        "took": between(evaluation.created_at, evaluation.finished_at),
        "progress": str(selectors.evaluation_progress(evaluation.id)),
        "waiting": describe(evaluation.waiting_reason),
    }


@require_safe  # read-only: a POST is a 405
@login_required(login_url=LOGIN)
def evaluations(request: HttpRequest) -> HttpResponse:
    rows = (
        Evaluation.objects.filter(project__in=projects_of(request.user))
        .select_related("project")
        .defer("warnings", "errors")
        .order_by("-created_at", "id")
    )
    project = request.GET.get("project")
    if project:
        rows = rows.filter(project__name=project)
    page = Paginator(rows, PAGE_SIZE).get_page(request.GET.get("page"))
    return render(
        request,
        "member/evaluations.html",
        {
            "title": "Your evaluations",
            "page": page,
            "rows": [_row(e) for e in page.object_list],
            "projects": list(projects_of(request.user).order_by("name").values_list("name", flat=True)),
            "project": project or "",
        },
    )


@require_safe  # read-only: a POST is a 405
@login_required(login_url=LOGIN)
def evaluation(request: HttpRequest, evaluation_id: str) -> HttpResponse:
    found = _evaluation_or_refuse(request.user, evaluation_id)
    links = found.build_links.select_related("build").order_by("build__created_at", "build__drv_path")
    return render(
        request,
        "member/evaluation.html",
        {
            "title": evaluation_name(found),
            "row": _row(found),
            "next_step": with_relative_deadline(lambda at: selectors.evaluation_next_step(found, at=at)),
            "failed": selectors.evaluation_failed_builds(found.id),
            "builds": [link.build for link in links],
        },
    )


@require_safe  # read-only: a POST is a 405
@login_required(login_url=LOGIN)
def build(request: HttpRequest, build_id: str) -> HttpResponse:
    found = _build_or_refuse(request.user, build_id)
    log = build_log_window(build=found)
    return render(
        request,
        "member/build.html",
        {
            "title": found.name,
            "build": found,
            "created": ago(found.created_at),
            "log": log,
            "log_text": plain_text(log.text) if log is not None else "",
            "log_url": f"/api/v1/builds/{found.id}/log",
            "log_page": f"/my/builds/{found.id}/log/",
        },
    )


@require_safe
@login_required(login_url=LOGIN)
def build_log(request: HttpRequest, build_id: str) -> HttpResponse:
    """The whole log with line numbers and anchors (#L120), ANSI colour, search and a download: the
    page reads the REST log route (the session authorizes it) and renders it in the browser, every
    character as text."""
    found = _build_or_refuse(request.user, build_id)
    assignment = parse_uuid(request.GET.get("assignment", "")) if request.GET.get("assignment") else None
    url = f"/api/v1/builds/{found.id}/log" + (f"?assignment={assignment}" if assignment else "")
    return render(
        request,
        "member/log.html",
        {"title": f"Log of {found.name}", "build": found, "log_url": url, "assignment": assignment},
    )


class MemberLoginView(auth_views.LoginView):
    template_name = "member/login.html"
    redirect_authenticated_user = True
    extra_context = {"title": "Sign in"}

    def get_default_redirect_url(self) -> str:
        return "/my/"


urlpatterns = [
    path("", evaluations, name="member-evaluations"),
    path("evaluations/<str:evaluation_id>/", evaluation, name="member-evaluation"),
    path("builds/<str:build_id>/", build, name="member-build"),
    path("builds/<str:build_id>/log/", build_log, name="member-build-log"),
    # Failed logins are limited as the console's and the token route's are (gradient.throttling).
    path("login/", limit_admin_login(MemberLoginView.as_view()), name="member-login"),  # type: ignore[arg-type]
    path("logout/", auth_views.LogoutView.as_view(next_page=LOGIN), name="member-logout"),
]
