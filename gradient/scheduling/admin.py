"""The scheduling app in the console: projects are edited here; evaluations, shared builds and their
rows are views, and change only through the operator's actions (gradient.scheduling.services.operations
and evaluations), each behind a confirmation page and signed on the record."""

from __future__ import annotations

import re

from django.contrib import admin
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from gradient.console import (
    OperatedAdmin,
    Operation,
    ReadOnlyAdmin,
    ReadOnlyInline,
    RelativeHistory,
    ago,
    as_list,
    assignment_job_link,
    between,
    drv_name,
    since,
    when,
    with_relative_deadline,
)
from gradient.core.vocab import (
    BUILD_PENDING,
    EVALUATION_ACTIVE,
    EVALUATION_TERMINAL,
    BuildStatus,
    EvaluationKind,
    EvaluationStatus,
    JobKind,
)
from gradient.names import NameCheckedForm
from gradient.records.admin import RecordTimelineMixin
from gradient.scheduling import queue_position, selectors
from gradient.scheduling.admin_logs import BuildLogMixin, FailedBuildLogsMixin
from gradient.scheduling.admin_queue import build_standing, evaluation_expected_end, evaluation_standing
from gradient.scheduling.admin_waiting import WaitingReasonFilter, waiting_for, waiting_for_brief
from gradient.scheduling.models import (
    BuildAttempt,
    CachedPath,
    CandidateScore,
    DerivationBuild,
    DerivationBuildDependency,
    DispatchedJob,
    Evaluation,
    EvaluationBuild,
    Project,
    SentCandidate,
)
from gradient.scheduling.services import lifecycle, operations
from gradient.scheduling.services.evaluations import evaluation_request_cancel


@admin.register(Project)
class ProjectAdmin(RelativeHistory, admin.ModelAdmin):
    form = NameCheckedForm
    list_display = ["name", when("created_at", "created")]
    search_fields = ["name"]
    filter_horizontal = ["members"]


def _readable_lines(lines: list[str] | None) -> list[str]:
    """An evaluation's errors and warnings: a derivation named without its store hash."""
    return [
        re.sub(r"/nix/store/[0-9a-z]{32}-([^\s:]+?)(\.drv)?(?=[\s:]|$)", r"\1", str(line))
        for line in lines or []
    ]


def _link(obj: object, label: str) -> SafeString:
    meta = obj._meta  # type: ignore[attr-defined]
    url = reverse(f"admin:{meta.app_label}_{meta.model_name}_change", args=[obj.pk])  # type: ignore[attr-defined]
    return format_html('<a href="{}">{}</a>', url, label)


def _cancel(evaluation: Evaluation, actor: str) -> str:
    # Signed as every console action is (console.actor_of: `admin:<user>`), so a record's timeline
    # names the console the same way for a cancel as for a restart.
    receipt = evaluation_request_cancel(evaluation_id=evaluation.id, actor=actor, now=timezone.now())
    return receipt.message if receipt is not None else "cancelled"


def _restarted(result: operations.ActionResult) -> SafeString | str:
    """The restart's message with its new evaluation named and linked instead of its id."""
    successor = Evaluation.objects.filter(id=result.successor).first() if result.successor else None
    if successor is None:
        return result.message
    plain = f"restarted as evaluation {successor.id}"
    rest = result.message.removeprefix(plain)
    name = f"{successor.repository}@{successor.commit[:12]}"
    return format_html("restarted as {}{}", _link(successor, name), rest)


def _restart(evaluation: Evaluation, actor: str) -> SafeString | str:
    return _restarted(
        operations.evaluation_restart(evaluation_id=evaluation.id, actor=actor, now=timezone.now())
    )


def _restart_and_rebuild(evaluation: Evaluation, actor: str) -> SafeString | str:
    result = operations.evaluation_restart(
        evaluation_id=evaluation.id, actor=actor, now=timezone.now(), rebuild_failed=True
    )
    return _restarted(result)


def _restart_consequences(evaluation: Evaluation) -> list[str]:
    failed = operations.rebuildable_failed_builds(evaluation.id)
    if not failed:
        return []
    names = ", ".join(drv_name(b.drv_path) for b in failed[:5]) + (" …" if len(failed) > 5 else "")
    return [
        f"{len(failed)} failed build{'s' if len(failed) != 1 else ''} it needs ({names}) "
        f"{'is' if len(failed) == 1 else 'are'} still failed: they are queued afresh first, unless you "
        "untick “Also rebuild its failed builds” (then the new evaluation fails on them again)."
    ]


def _restarted_as(evaluation: Evaluation) -> Evaluation | None:
    lineage = selectors.evaluation_lineage(evaluation.id)
    return lineage.restarted_as if lineage is not None else None


def _prioritize_evaluation(evaluation: Evaluation, actor: str) -> str:
    result = operations.evaluation_prioritize(evaluation_id=evaluation.id, actor=actor, now=timezone.now())
    return result.message


EVALUATION_OPERATIONS = (
    Operation(
        name="cancel_evaluations",
        label="Cancel",
        description="Cancel the selected evaluations (a cancel intent on each record)",
        explain="Cancel: the evaluation ends Aborted, its running jobs get AbortJob, and its shared builds "
        "that no other active evaluation needs are aborted.",
        applies=lambda e: e.status in EVALUATION_ACTIVE,
        run=_cancel,
        summary=lambda n: f"Cancelled {n} evaluations; finished ones were left as they are.",
    ),
    Operation(
        name="restart_evaluations",
        label="Restart",
        description="Restart the selected finished evaluations (a new evaluation supersedes each)",
        explain="Restart: a new evaluation of the same repository and commit supersedes the finished one "
        "(its record's header names the old one, one generation later); shared builds that succeeded "
        "are reused.",
        applies=lambda e: e.status in EVALUATION_TERMINAL and e.kind == EvaluationKind.NORMAL,
        run=_restart,
        refused=(operations.ActionRefused,),
        consequences=_restart_consequences,
        option="Also rebuild its failed builds (a rebuild intent beside the restart's on its record)",
        option_applies=lambda e: bool(operations.rebuildable_failed_builds(e.id)),
        run_option=_restart_and_rebuild,
        option_default=True,
        lands_on=_restarted_as,
    ),
    Operation(
        name="prioritize_evaluations",
        label="Prioritize",
        description="Prioritize the selected active evaluations (Qos: ahead of the queue)",
        explain="Prioritize: the evaluation's job and its pending shared builds go ahead of every "
        "unprioritized job (+5000 in scoring).",
        applies=lambda e: e.status in EVALUATION_ACTIVE and not e.priority,
        run=_prioritize_evaluation,
        refused=(operations.ActionRefused,),
    ),
)


class EvaluationBuildInline(ReadOnlyInline):
    model = EvaluationBuild
    fields = readonly_fields = ("build_name", "build_status", "attr", "named", "blocks_evaluation")
    verbose_name = "shared build it needs"
    verbose_name_plural = "shared builds it needs"

    @admin.display(description="build")
    def build_name(self, obj: EvaluationBuild) -> SafeString:
        return _link(obj.build, drv_name(obj.build.drv_path))

    @admin.display(description="status")
    def build_status(self, obj: EvaluationBuild) -> str:
        return obj.build.status

    def get_queryset(self, request):  # type: ignore[no-untyped-def]
        return super().get_queryset(request).select_related("build")


@admin.register(Evaluation)
class EvaluationAdmin(FailedBuildLogsMixin, RecordTimelineMixin, OperatedAdmin):
    # The name links to the page (not the id), and the times come before the long columns, so a
    # 1 400 px screen shows them.
    list_display = [
        "name",
        "project_name",
        "status",
        "created",
        "took",
        "progress",
        waiting_for_brief,
        "kind",
    ]
    list_display_links = ["name"]
    list_filter = ["status", WaitingReasonFilter, "kind", "project"]
    search_fields = ["id", "repository", "commit"]
    date_hierarchy = "created_at"
    list_select_related = ["project"]
    list_per_page = 50
    inlines = [EvaluationBuildInline]
    operations = EVALUATION_OPERATIONS
    actions = [op.bulk() for op in EVALUATION_OPERATIONS]
    fields = readonly_fields = (  # type: ignore[assignment]
        "id",
        "project",
        "status",
        "progress",
        "where_it_stands",
        "expected_end",
        waiting_for,
        "next_step",
        "failed_builds",
        "failed_build_logs",
        "repository",
        "commit",
        "kind",
        "prioritized",
        "waits_for_workers",
        "created",
        "finished",
        "took",
        "waited",
        "evaluated",
        "created_by",
        "warnings_list",
        "errors_list",
        "lineage",
        "record_timeline",
    )

    def get_queryset(self, request):  # type: ignore[no-untyped-def]
        # The list shows neither; each can be hundreds of KiB (decisions.messages caps them).
        queryset = super().get_queryset(request)
        match = request.resolver_match
        if match is not None and match.url_name == "scheduling_evaluation_changelist":
            queryset = queryset.defer("warnings", "errors")
        return queryset

    def get_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        """No empty rows: what it waits for and what happens next only while it waits, its failed
        builds only once one failed."""
        fields = list(super().get_fields(request, obj))
        if obj is not None and obj.status != EvaluationStatus.WAITING:
            fields = [f for f in fields if f not in (waiting_for, "next_step")]
        if obj is None or not selectors.evaluation_failed_builds(obj.id):
            fields = [f for f in fields if f not in ("failed_builds", "failed_build_logs")]
        if obj is None or obj.status != EvaluationStatus.QUEUED:
            fields = [f for f in fields if f != "where_it_stands"]
        if obj is None or obj.status != EvaluationStatus.BUILDING:
            fields = [f for f in fields if f != "expected_end"]
        return fields

    @admin.display(description="where it stands")
    def where_it_stands(self, obj: Evaluation) -> SafeString | str:
        return evaluation_standing(obj)

    @admin.display(description="expected to end")
    def expected_end(self, obj: Evaluation) -> SafeString | str:
        return evaluation_expected_end(obj)

    def _eval_jobs(self, obj: Evaluation) -> list[DispatchedJob]:
        return list(
            DispatchedJob.objects.filter(evaluation_id=obj.id, kind=JobKind.EVAL)
            .only("dispatched_at", "finished_at")
            .order_by("dispatched_at")
        )

    # Waited and evaluated apart (as a build's waited and built): its duration above runs from its
    # creation to its end, builds included.
    @admin.display(description="waited")
    def waited(self, obj: Evaluation) -> str:
        """From its creation to its first hand-out (to now while it is still Queued)."""
        jobs = self._eval_jobs(obj)
        if not jobs:
            return since(obj.created_at) if obj.status == EvaluationStatus.QUEUED else "-"
        return between(obj.created_at, max(jobs[0].dispatched_at, obj.created_at))

    @admin.display(description="evaluated")
    def evaluated(self, obj: Evaluation) -> str:
        """Its latest evaluation job, from its hand-out to its end (so far, while it runs)."""
        jobs = self._eval_jobs(obj)
        if not jobs:
            return "-"
        return between(jobs[-1].dispatched_at, jobs[-1].finished_at or timezone.now())

    @admin.display(description="warnings")
    def warnings_list(self, obj: Evaluation) -> SafeString | str:
        return as_list(_readable_lines(obj.warnings))

    @admin.display(description="errors")
    def errors_list(self, obj: Evaluation) -> SafeString | str:
        return as_list(_readable_lines(obj.errors))

    @admin.display(description="evaluation", ordering="repository")
    def name(self, obj: Evaluation) -> str:
        repository = obj.repository if len(obj.repository) <= 48 else obj.repository[:47] + "…"
        return f"{repository}@{obj.commit[:12]}"

    @admin.display(description="id", ordering="id")
    def short_id(self, obj: Evaluation) -> str:
        return str(obj.id)

    @admin.display(description="project", ordering="project__name")
    def project_name(self, obj: Evaluation) -> str:
        return obj.project.name

    @admin.display(description="commit")
    def short_commit(self, obj: Evaluation) -> str:
        return obj.commit[:12]

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: Evaluation) -> SafeString | str:
        return ago(obj.created_at)

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, obj: Evaluation) -> SafeString | str:
        return ago(obj.finished_at)

    @admin.display(description="duration")
    def took(self, obj: Evaluation) -> str:
        end = obj.finished_at or timezone.now()
        return between(obj.created_at, max(end, obj.created_at))

    @admin.display(description="prioritized")
    def prioritized(self, obj: Evaluation) -> str:
        return "yes (+5000 in scoring)" if obj.priority else "no"

    @admin.display(description="waits for workers")
    def waits_for_workers(self, obj: Evaluation) -> str:
        if obj.wait_for_workers:
            return "yes: never aborted for want of a worker"
        if obj.status not in EVALUATION_ACTIVE:
            return "no"  # it ended: what the grace would do no longer applies
        return "no: aborted if no connected worker can build it for the grace"

    @admin.display(description="what happens next")
    def next_step(self, obj: Evaluation) -> SafeString | str:
        return with_relative_deadline(lambda at: selectors.evaluation_next_step(obj, at=at)) or "-"

    @admin.display(description="progress")
    def progress(self, obj: Evaluation) -> str:
        return str(selectors.evaluation_progress(obj.id))

    @admin.display(description="failed builds")
    def failed_builds(self, obj: Evaluation) -> SafeString | str:
        failed = selectors.evaluation_failed_builds(obj.id)
        if not failed:
            return "none"
        return format_html(
            "<table>{}</table>",
            format_html_join(
                "",
                "<tr><td>{}</td><td>{}</td><td><pre>{}</pre></td></tr>",
                ((_link(b, drv_name(b.drv_path)), b.status, b.last_error[-2000:] or "-") for b in failed),
            ),
        )

    @admin.display(description="lineage")
    def lineage(self, obj: Evaluation) -> SafeString | str:
        lineage = selectors.evaluation_lineage(obj.id)
        if lineage is None:
            return "no readable record"
        parts = [format_html("generation {}", lineage.generation)]
        if lineage.restarts is not None:
            parts.append(format_html("restarts {}", _link(lineage.restarts, self.name(lineage.restarts))))
        if lineage.restarted_as is not None:
            other = lineage.restarted_as
            parts.append(format_html("restarted as {} ({})", _link(other, self.name(other)), other.status))
        elif lineage.pending:
            parts.append(format_html("restart pending"))
        return format_html_join(", ", "{}", ((p,) for p in parts))


class DependencyInline(ReadOnlyInline):
    model = DerivationBuildDependency
    fk_name = "build"
    fields = readonly_fields = ("dependency_name", "dependency_status")
    verbose_name = "dependency"
    verbose_name_plural = "dependencies"

    @admin.display(description="dependency")
    def dependency_name(self, obj: DerivationBuildDependency) -> SafeString:
        return _link(obj.dependency, drv_name(obj.dependency.drv_path))

    @admin.display(description="status")
    def dependency_status(self, obj: DerivationBuildDependency) -> str:
        return obj.dependency.status

    def get_queryset(self, request):  # type: ignore[no-untyped-def]
        return super().get_queryset(request).select_related("build", "dependency")


class DependentInline(ReadOnlyInline):
    model = DerivationBuildDependency
    fk_name = "dependency"
    fields = readonly_fields = ("dependent_name", "dependent_status")
    verbose_name = "dependent"
    verbose_name_plural = "dependents"

    @admin.display(description="dependent")
    def dependent_name(self, obj: DerivationBuildDependency) -> SafeString:
        return _link(obj.build, drv_name(obj.build.drv_path))

    @admin.display(description="status")
    def dependent_status(self, obj: DerivationBuildDependency) -> str:
        return obj.build.status

    def get_queryset(self, request):  # type: ignore[no-untyped-def]
        return super().get_queryset(request).select_related("build", "dependency")


class SharingInline(ReadOnlyInline):
    model = EvaluationBuild
    fields = readonly_fields = ("evaluation_link", "evaluation_status", "attr")
    verbose_name = "evaluation that shares it"
    verbose_name_plural = "evaluations that share it"

    @admin.display(description="evaluation")
    def evaluation_link(self, obj: EvaluationBuild) -> SafeString:
        e = obj.evaluation
        return _link(e, f"{e.project.name}: {e.repository}@{e.commit[:12]}")

    @admin.display(description="status")
    def evaluation_status(self, obj: EvaluationBuild) -> str:
        return obj.evaluation.status

    def get_queryset(self, request):  # type: ignore[no-untyped-def]
        return super().get_queryset(request).select_related("evaluation__project")


class AttemptInline(ReadOnlyInline):
    model = BuildAttempt
    fields = readonly_fields = (
        "try_number",
        "attempt",
        "worker",
        "started",
        "took",
        "outcome",
        "failure_kind",
        "error_tail",
    )
    verbose_name = "attempt"
    verbose_name_plural = "attempts"

    def get_queryset(self, request):  # type: ignore[no-untyped-def]
        return super().get_queryset(request).select_related("worker").order_by("started_at", "number")

    @admin.display(description="try")
    def try_number(self, obj: BuildAttempt) -> int:
        """Every try of the build, counted across rebuilds (a rebuild starts `attempt` at 1 again)."""
        earlier = BuildAttempt.objects.filter(build_id=obj.build_id, started_at__lt=obj.started_at).count()
        return earlier + 1

    @admin.display(description="attempt")
    def attempt(self, obj: BuildAttempt) -> str:
        if self.try_number(obj) != obj.number:
            return f"{obj.number} (after a rebuild)"
        return str(obj.number)

    @admin.display(description="started")
    def started(self, obj: BuildAttempt) -> SafeString | str:
        return ago(obj.started_at)

    @admin.display(description="duration")
    def took(self, obj: BuildAttempt) -> str:
        return between(obj.started_at, obj.finished_at or timezone.now())

    @admin.display(description="error")
    def error_tail(self, obj: BuildAttempt) -> str:
        return obj.error[-500:] or "-"


def _rebuild(build: DerivationBuild, actor: str) -> str:
    return operations.build_rebuild(build_id=build.id, actor=actor, now=timezone.now()).message


def _prioritize_build(build: DerivationBuild, actor: str) -> str:
    return operations.build_prioritize(build_id=build.id, actor=actor, now=timezone.now()).message


BUILD_OPERATIONS = (
    Operation(
        name="rebuild_builds",
        label="Rebuild",
        description="Rebuild the selected finished or failed shared builds",
        explain="Rebuild: the shared build is queued afresh (its attempts and error cleared), and its "
        "dependents that failed only because of it wait for it again. Evaluations that ended keep their "
        "verdict; restart them for a new one.",
        applies=lambda b: b.status in lifecycle.BUILD_REBUILDABLE,
        run=_rebuild,
        refused=(operations.ActionRefused,),
    ),
    Operation(
        name="prioritize_builds",
        label="Prioritize",
        description="Prioritize the selected pending shared builds (Qos: ahead of the queue)",
        explain="Prioritize: the shared build goes ahead of every unprioritized build (+5000 in scoring).",
        applies=lambda b: b.status in BUILD_PENDING and not b.prioritized,
        run=_prioritize_build,
        refused=(operations.ActionRefused,),
    ),
)


@admin.register(DerivationBuild)
class DerivationBuildAdmin(BuildLogMixin, RecordTimelineMixin, OperatedAdmin):
    list_display = ["name", "system", "status", "drv_lost", "attempts", "queued", "waited", "built"]
    list_filter = ["status", "system", ("drv_lost_at", admin.EmptyFieldListFilter)]
    search_fields = ["id", "drv_path"]
    inlines = [SharingInline, DependencyInline, DependentInline, AttemptInline]
    operations = BUILD_OPERATIONS
    actions = [op.bulk() for op in BUILD_OPERATIONS]
    fields = readonly_fields = (
        "name",
        "drv_path",
        "id",
        "system",
        "features",
        "status",
        "why_it_waits",
        "where_it_stands",
        "is_prioritized",
        "attempts",
        "max_attempts",
        "failure_kind",
        "last_error",
        "output_paths",
        "queued",
        "finished",
        "waited",
        "built",
        "build_log",
        "record_timeline",
    )

    @admin.display(description="name", ordering="drv_path")
    def name(self, obj: DerivationBuild) -> str:
        return drv_name(obj.drv_path)

    @admin.display(description="required features")
    def features(self, obj: DerivationBuild) -> SafeString | str:
        return as_list(obj.required_features or [])

    @admin.display(description="outputs")
    def output_paths(self, obj: DerivationBuild) -> SafeString | str:
        outputs = obj.outputs or []
        return as_list(
            f"{o.get('name', '?')}: {o.get('path') or '(not known yet)'}" if isinstance(o, dict) else o
            for o in outputs
        )

    @admin.display(description=".drv lost", ordering="drv_lost_at")
    def drv_lost(self, obj: DerivationBuild) -> str:
        return "lost" if obj.drv_lost_at is not None else "no"

    @admin.display(description="queued", ordering="queued_at")
    def queued(self, obj: DerivationBuild) -> SafeString | str:
        return ago(obj.queued_at)

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, obj: DerivationBuild) -> SafeString | str:
        return ago(obj.finished_at)

    # Waited and built apart: one "duration" from queued to finished read 12.7 s for a 1.0 s attempt.
    @admin.display(description="waited")
    def waited(self, obj: DerivationBuild) -> str:
        """From queued to its latest attempt's start (or to now, while it is still queued)."""
        attempt = obj.build_attempts.order_by("-started_at").first()
        if attempt is None:
            return since(obj.queued_at) if obj.status == BuildStatus.QUEUED else "-"
        return between(obj.queued_at, attempt.started_at) if obj.queued_at else "-"

    @admin.display(description="built")
    def built(self, obj: DerivationBuild) -> str:
        """Its latest attempt, start to finish (so far, while it runs)."""
        attempt = obj.build_attempts.order_by("-started_at").first()
        if attempt is None:
            return "-"
        return between(attempt.started_at, attempt.finished_at or timezone.now())

    @admin.display(description="prioritized")
    def is_prioritized(self, obj: DerivationBuild) -> str:
        return "yes (+5000 in scoring)" if obj.prioritized else "no"

    @admin.display(description="why it waits")
    def why_it_waits(self, obj: DerivationBuild) -> str:
        # The builds ahead counted as the "where it stands" row beside it counts them (its workers'
        # hand-out order), so the two never disagree.
        standing = (
            queue_position.build_queue(obj, timezone.now()) if obj.status == BuildStatus.QUEUED else None
        )
        return selectors.build_waiting_text(obj, ahead=standing.ahead if standing is not None else None)

    def get_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        fields = super().get_fields(request, obj)
        # A build that is building, done or failed does not wait: no empty "why it waits" row.
        if obj is None or not selectors.build_waiting_text(obj):
            fields = [f for f in fields if f != "why_it_waits"]
        if obj is None or obj.status != BuildStatus.QUEUED:
            fields = [f for f in fields if f != "where_it_stands"]
        return fields

    @admin.display(description="where it stands")
    def where_it_stands(self, obj: DerivationBuild) -> SafeString | str:
        return build_standing(obj)


@admin.register(DispatchedJob)
class DispatchedJobAdmin(ReadOnlyAdmin):
    # The assignment by its short id (the row's link) and the job by name (a link to its page): the
    # job's name once, so that "outcome" fits a 1 400 px screen.
    list_display = [
        "assignment",
        "job_page",
        "kind",
        "outcome",
        "worker",
        "rounded_score",
        "dispatched",
        "took",
    ]
    list_display_links = ["assignment"]
    list_filter = ["kind", "outcome"]
    search_fields = ["id", "job_id", "worker__name", "derivation_build__drv_path", "evaluation__repository"]
    list_select_related = ["worker", "derivation_build", "evaluation"]

    @admin.display(description="assignment", ordering="dispatched_at")
    def job_name(self, obj: DispatchedJob) -> str:
        return obj.job_name

    @admin.display(description="assignment", ordering="dispatched_at")
    def assignment(self, obj: DispatchedJob) -> str:
        return str(obj.id)[:8]

    @admin.display(description="job")
    def job_page(self, obj: DispatchedJob) -> SafeString | str:
        return assignment_job_link(obj)

    @admin.display(description="score", ordering="score")
    def rounded_score(self, obj: DispatchedJob) -> str:
        return f"{obj.score:.1f}"

    @admin.display(description="dispatched", ordering="dispatched_at")
    def dispatched(self, obj: DispatchedJob) -> SafeString | str:
        return ago(obj.dispatched_at)

    @admin.display(description="duration")
    def took(self, obj: DispatchedJob) -> str:
        return between(obj.dispatched_at, obj.finished_at or timezone.now())


@admin.register(BuildAttempt)
class BuildAttemptAdmin(ReadOnlyAdmin):
    list_display = ["build", "number", "worker", "outcome", "failure_kind", "started_at", "finished_at"]
    list_filter = ["outcome", "failure_kind"]


@admin.register(CachedPath)
class CachedPathAdmin(ReadOnlyAdmin):
    list_display = ["path", "nar_size", "confirmed", "created_at"]
    list_filter = ["confirmed"]
    search_fields = ["path"]


@admin.register(SentCandidate)
class SentCandidateAdmin(ReadOnlyAdmin):
    list_display = ["worker", "job_id"]
    search_fields = ["job_id"]


@admin.register(CandidateScore)
class CandidateScoreAdmin(ReadOnlyAdmin):
    list_display = ["worker", "job_id", "missing_count", "missing_nar_size", "outputs_present", "updated_at"]
    search_fields = ["job_id"]
