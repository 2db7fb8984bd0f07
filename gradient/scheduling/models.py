"""Evaluations, shared builds and the assignment rows that hand them to workers.

Statuses are the reference notes' names, stored verbatim, so SQL readers and REST clients see the
same words the design pages use. They are defined once, in gradient.core.vocab (the `as` imports below
keep them importable from here).
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Substr
from django.utils import timezone

from gradient.core import jobkey
from gradient.core.vocab import BUILD_ABORTABLE as BUILD_ABORTABLE
from gradient.core.vocab import BUILD_LASTING_FAILURE as BUILD_LASTING_FAILURE
from gradient.core.vocab import BUILD_PENDING as BUILD_PENDING
from gradient.core.vocab import BUILD_SUCCESS as BUILD_SUCCESS
from gradient.core.vocab import (
    EVALUATION_ACTIVE,
    EVALUATION_TERMINAL,
    BuildAttemptOutcome,
    BuildStatus,
    DispatchOutcome,
    EvaluationKind,
    EvaluationStatus,
    FlakeSourceKind,
    JobKind,
    choices,
)
from gradient.core.vocab import EVALUATION_EVALUATING as EVALUATION_EVALUATING
from gradient.core.vocab import FailureKind as BuildFailureKind


def eval_key(evaluation_id: uuid.UUID | str) -> str:
    return jobkey.eval_key(evaluation_id)


def build_key(build_id: uuid.UUID | str) -> str:
    return jobkey.build_key(build_id)


STORE_PREFIX_LEN = len("/nix/store/") + 32 + 1
NAME_START = STORE_PREFIX_LEN + 1
"""Where a derivation's name starts in a drv_path of the default store (SQL's SUBSTRING is 1-based)."""


def _name(drv_path: str) -> str:
    """A derivation's name without its store hash (as the console shows it)."""
    base = drv_path.rsplit("/", 1)[-1].removesuffix(".drv")
    head, sep, rest = base.partition("-")
    return rest if sep and len(head) == 32 else base


class Project(models.Model):
    """A namespace of evaluations. Workers are authorized per project; so are REST submitters."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200, unique=True)
    members = models.ManyToManyField(
        settings.AUTH_USER_MODEL,
        blank=True,
        related_name="gradient_projects",
        help_text="REST clients that may submit to and read this project (staff may do everything).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "project"
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Evaluation(models.Model):
    """One submitted flake evaluation, and through its shared builds, everything it needs built."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="evaluations")
    kind = models.CharField(max_length=16, choices=choices(EvaluationKind), default=EvaluationKind.NORMAL)
    status = models.CharField(
        max_length=24, choices=choices(EvaluationStatus), default=EvaluationStatus.QUEUED
    )
    repository = models.CharField(max_length=2048)
    commit = models.CharField(max_length=255)
    wildcards = models.JSONField(default=list, blank=True)
    wait_for_workers = models.BooleanField(
        default=False, help_text="Keep waiting for a capable worker instead of aborting after the grace."
    )
    priority = models.BooleanField(default=False, help_text="Prioritized (+5000 in scoring).")
    source_kind = models.CharField(
        max_length=16, choices=choices(FlakeSourceKind), default=FlakeSourceKind.REPOSITORY
    )
    flake_source = models.CharField(
        max_length=1024, null=True, blank=True, help_text="Store path the fetch produced (fetch_result)."
    )
    followup_pending = models.BooleanField(
        default=False,
        help_text="A fetch-only job completed; the next eval job is the cached follow-up under the same key.",
    )
    waiting_reason = models.JSONField(null=True, blank=True)
    waiting_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the current waiting reason was first recorded (survives restarts).",
    )
    lost_dispatches = models.PositiveIntegerField(default=0)
    warnings = models.JSONField(default=list, blank=True)
    errors = models.JSONField(default=list, blank=True)
    recovery_of = models.ForeignKey(
        "DerivationBuild",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="drv_recoveries",
        help_text="For a DrvRecovery evaluation: the shared build whose .drv it recovers.",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "evaluation"
        ordering = ["-created_at"]
        indexes = [
            models.Index(
                fields=["created_at"],
                name="idx-evaluation-queued",
                condition=Q(status=EvaluationStatus.QUEUED),
            ),
            models.Index(
                fields=["status", "created_at"],
                name="idx-evaluation-active",
                condition=Q(status__in=EVALUATION_ACTIVE),
            ),
            models.Index(fields=["project", "-created_at"], name="idx-evaluation-project"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(finished_at__isnull=True) | Q(status__in=EVALUATION_TERMINAL),
                name="evaluation-finished-only-when-terminal",
                violation_error_message="Only a terminal evaluation has finished_at.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.project.name}: {self.repository}@{self.commit[:12]} ({self.status})"

    @property
    def job_key(self) -> str:
        return eval_key(self.id)


class DerivationBuild(models.Model):
    """The shared build: one per derivation path, shared by every evaluation that needs it."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    drv_path = models.CharField(max_length=1024, unique=True)
    system = models.CharField(max_length=64, help_text="Nix system; `builtin` skips the system check.")
    required_features = models.JSONField(default=list, blank=True)
    outputs = models.JSONField(default=list, blank=True, help_text="[{name, path}]")
    inputs_digest = models.CharField(
        max_length=64,
        blank=True,
        default="",
        help_text="sha256 of its input derivation paths as first reported (decisions.derivations); "
        "a later report naming other inputs is refused. Empty: stored before it was kept.",
    )
    status = models.CharField(max_length=20, choices=choices(BuildStatus), default=BuildStatus.CREATED)
    prioritized = models.BooleanField(default=False)
    attempts = models.PositiveIntegerField(
        default=0,
        help_text="Build attempts spent. A canceled try spends none while one worker has canceled the "
        "build at most GRADIENT_BUILD_FREE_CANCELS times in a row; each further cancel by that worker "
        "spends one, like a transient failure.",
    )
    max_attempts = models.PositiveIntegerField(default=3)
    retry_at = models.DateTimeField(null=True, blank=True, help_text="Backoff: not handed out before this.")
    timeout_secs = models.PositiveIntegerField(default=14400)
    max_silent_secs = models.PositiveIntegerField(default=3600)
    failure_kind = models.CharField(max_length=32, choices=choices(BuildFailureKind), null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    drv_lost_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="No worker could obtain the .drv: not queued until a DrvRecovery evaluation restores it.",
    )
    ingest = models.ForeignKey(
        "EvalIngest",
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="+",
        help_text="The eval_result in parts that created it: not queued while that result is still arriving.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    queued_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    dependencies: models.ManyToManyField[DerivationBuild, DerivationBuildDependency] = models.ManyToManyField(
        "self",
        symmetrical=False,
        through="DerivationBuildDependency",
        through_fields=("build", "dependency"),
        related_name="dependents",
        blank=True,
    )

    class Meta:
        db_table = "derivation_build"
        ordering = ["created_at"]
        verbose_name = "shared build"  # the README's name, in the console too
        indexes = [
            # (queued_at, id): RequestJob's preselect walks Queued builds in (queued_at, id) order, and
            # builds queued together share one queued_at; on queued_at alone PostgreSQL top-N sorts
            # every pending row (124-171 ms at 50 000 pending, 0.5 ms with the id).
            models.Index(
                fields=["queued_at", "id"],
                name="idx-derivation_build-queued",
                condition=Q(status=BuildStatus.QUEUED),
            ),
            # RequestJob's other two heads of the queue (selectors.queued_build_refs): the prioritized
            # builds, and those past the WaitTime cap in id order (their tie-break).
            models.Index(
                fields=["queued_at", "id"],
                name="idx-build-queued-prioritized",
                condition=Q(status=BuildStatus.QUEUED, prioritized=True),
            ),
            models.Index(
                fields=["id"],
                name="idx-build-queued-id",
                condition=Q(status=BuildStatus.QUEUED),
            ),
            models.Index(
                fields=["updated_at"],
                name="idx-derivation_build-building",
                condition=Q(status=BuildStatus.BUILDING),
            ),
            models.Index(
                fields=["created_at"],
                name="idx-derivation_build-created",
                condition=Q(status=BuildStatus.CREATED),
            ),
            # Builds that failed lastingly (few): what a decision looks up to fail their dependents.
            models.Index(
                fields=["id"],
                name="idx-derivation_build-failed",
                condition=Q(status__in=BUILD_LASTING_FAILURE),
            ),
            # The built derivations of one name and system (the name after /nix/store/<hash>-): what a
            # waiting build's typical duration is read from (queue_position.build_typical).
            models.Index(
                Substr("drv_path", NAME_START),
                F("system"),
                name="idx-derivation_build-name",
                condition=Q(status__in=BUILD_SUCCESS),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.drv_path} ({self.status})"

    @property
    def name(self) -> str:
        """The derivation's name without its store hash: hello-2.12."""
        return _name(self.drv_path)

    @property
    def job_key(self) -> str:
        return build_key(self.id)


class DerivationBuildDependency(models.Model):
    """An edge: `build` needs `dependency` built (or substituted) first."""

    # No index of their own: the unique edge index leads with build, idx-derivation_build_dep-dep is the
    # dependency's. Every index is written for each of a large evaluation's edges (docs/performance.md).
    build = models.ForeignKey(
        DerivationBuild, on_delete=models.CASCADE, related_name="dependency_edges", db_index=False
    )
    dependency = models.ForeignKey(
        DerivationBuild, on_delete=models.CASCADE, related_name="dependent_edges", db_index=False
    )

    class Meta:
        db_table = "derivation_build_dependency"
        verbose_name = "dependency"
        verbose_name_plural = "dependencies"
        constraints = [
            models.UniqueConstraint(
                fields=["build", "dependency"],
                name="derivation_build_dependency-unique-edge",
                violation_error_message="This dependency edge exists already.",
            ),
            models.CheckConstraint(
                condition=~Q(build=models.F("dependency")),
                name="derivation_build_dependency-no-self-edge",
                violation_error_message="A build cannot depend on itself.",
            ),
        ]
        indexes = [models.Index(fields=["dependency"], name="idx-derivation_build_dep-dep")]

    def __str__(self) -> str:
        return f"needs {_name(self.dependency.drv_path)}"


class EvaluationBuild(models.Model):
    """Links an evaluation to a shared build it needs. `named` marks the builds its wildcards selected;
    `blocks_evaluation` is false for a build the evaluation no longer waits on."""

    # No index of their own: evaluation_build-unique leads with evaluation, idx-evaluation_build-build is
    # the build's.
    evaluation = models.ForeignKey(
        Evaluation, on_delete=models.CASCADE, related_name="build_links", db_index=False
    )
    build = models.ForeignKey(
        DerivationBuild, on_delete=models.CASCADE, related_name="evaluation_links", db_index=False
    )
    attr = models.CharField(max_length=1024, null=True, blank=True)
    named = models.BooleanField(default=False)
    blocks_evaluation = models.BooleanField(default=True)

    class Meta:
        db_table = "evaluation_build"
        constraints = [
            models.UniqueConstraint(
                fields=["evaluation", "build"],
                name="evaluation_build-unique",
                violation_error_message="The evaluation already needs this build.",
            ),
        ]
        indexes = [models.Index(fields=["build"], name="idx-evaluation_build-build")]

    def __str__(self) -> str:
        return f"needs {_name(self.build.drv_path)}"


class CachedPath(models.Model):
    """A store path some worker saw in its cache, with its NAR size (offered as `required_paths[].nar_size`).
    For whom it counts as cached (protocol.md, "Tenants"): every project when `confirmed`, otherwise only
    the projects that have a CachedPathClaim of it."""

    path = models.CharField(max_length=1024, unique=True)
    nar_size = models.BigIntegerField()
    confirmed = models.BooleanField(
        default=False,
        help_text="Cached for every project: an output a build job reported (built, or substituted by the "
        "worker the build was handed to), or any claim with GRADIENT_TRUSTED_CACHE.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "cached_path"
        constraints = [
            models.CheckConstraint(
                condition=Q(nar_size__gte=0),
                name="cached_path-nar_size-non-negative",
                violation_error_message="A NAR size cannot be negative.",
            ),
        ]

    def __str__(self) -> str:
        return self.path


class CachedPathClaim(models.Model):
    """A project's word that a store path is in the cache: an eval_result's `cached_outputs`, for every
    project the reporting worker serves (and the evaluation's). It makes a build Substituted for those
    projects' evaluations only (graph.decide_builds)."""

    path = models.CharField(max_length=1024)
    # No index of its own: cached_path_claim-unique leads with the path, which every lookup names.
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="+", db_index=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "cached_path_claim"
        constraints = [
            models.UniqueConstraint(
                fields=["path", "project"],
                name="cached_path_claim-unique",
                violation_error_message="The project claimed this path already.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.path} (claimed)"


class DispatchedJob(models.Model):
    """One hand-out of a job to a worker. Its id is the `assignment_id` every report echoes; it is open
    while `finished_at` is null, and at most one row per job key is open (idx-dispatched_job-open-job)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    kind = models.CharField(max_length=8, choices=choices(JobKind))
    job_id = models.CharField(max_length=64, help_text="The job key: eval:<uuid> or build:<uuid>.")
    # Indexed only where set (idx-dispatched_job-eval, -cluster below): a shared build's
    # assignment has neither, and each index entry is written again at the close (not a HOT update).
    evaluation = models.ForeignKey(
        Evaluation,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="dispatches",
        db_index=False,
    )
    derivation_build = models.ForeignKey(
        DerivationBuild, null=True, blank=True, on_delete=models.SET_NULL, related_name="dispatches"
    )
    # No index of its own on every assignment of the worker: see Meta.indexes (open, and finished).
    worker = models.ForeignKey(
        "workers.Worker", on_delete=models.PROTECT, related_name="dispatches", db_index=False
    )
    cluster_attempt = models.ForeignKey(
        "clusters.ClusterAttempt",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,  # also ON DELETE SET NULL in PostgreSQL itself (clusters migration 0002)
        related_name="member_dispatches",
        db_index=False,
    )
    score = models.FloatField(default=0)
    score_breakdown = models.JSONField(default=dict, blank=True)
    missing_nar_size = models.BigIntegerField(null=True, blank=True)
    missing_count = models.IntegerField(null=True, blank=True)
    job = models.JSONField(default=dict, blank=True, help_text="The Job as sent in AssignJob.")
    phase = models.CharField(max_length=32, blank=True, default="", help_text="Latest JobUpdate kind.")
    queued_at = models.DateTimeField(null=True, blank=True, help_text="When the job became pending.")
    dispatched_at = models.DateTimeField(help_text="When the claim won.")
    accepted_at = models.DateTimeField(null=True, blank=True)
    last_report_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=16, choices=choices(DispatchOutcome), null=True, blank=True)
    reason = models.TextField(blank=True, default="", help_text="Why it closed, in words.")

    class Meta:
        db_table = "dispatched_job"
        ordering = ["-dispatched_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["job_id"],
                condition=Q(finished_at__isnull=True),
                name="idx-dispatched_job-open-job",
                violation_error_message="This job already has an open assignment.",
            ),
            models.CheckConstraint(
                condition=Q(finished_at__isnull=True, outcome__isnull=True)
                | Q(finished_at__isnull=False, outcome__isnull=False),
                name="dispatched_job-outcome-iff-finished",
                violation_error_message="An assignment has an outcome exactly when it is finished.",
            ),
        ]
        indexes = [
            # A worker's assignments in two halves, open and finished, and no index of all of them: the
            # claim statement counts a worker's open builds with a plan made once per connection, maybe
            # on the statistics of an empty or freshly written table (a serve's start after a restore, a
            # benchmark), and with an index of every assignment of the worker beside the open one the
            # planner could take either at the same cost (it took the whole history once in a CI run:
            # tests/test_scheduling_claims.py); the finished half cannot serve that count at all.
            # Reads of every assignment of a worker (its page, PROTECT on its deletion) take both.
            models.Index(
                fields=["worker", "kind"],
                name="idx-dispatched_job-open-worker",
                condition=Q(finished_at__isnull=True),
            ),
            models.Index(
                fields=["worker", "-dispatched_at"],
                name="idx-dispatched_job-worker-done",
                condition=Q(finished_at__isnull=False),
            ),
            models.Index(
                fields=["dispatched_at"],
                name="idx-dispatched_job-open-age",
                condition=Q(finished_at__isnull=True),
            ),
            models.Index(fields=["job_id", "-dispatched_at"], name="idx-dispatched_job-job"),
            # The latest hand-outs, newest first (the pool's mean wait, selectors.pool_view): without it
            # that read sorted every hand-out of the last hour, 40 ms at 60 000 and growing with them.
            models.Index(fields=["dispatched_at"], name="idx-dispatched_job-dispatched"),
            models.Index(
                fields=["evaluation"],
                name="idx-dispatched_job-eval",
                condition=Q(evaluation__isnull=False),
            ),
            models.Index(
                fields=["cluster_attempt"],
                name="idx-dispatched_job-cluster",
                condition=Q(cluster_attempt__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.job_name} on {self.worker.name} ({self.outcome or 'open'})"

    @property
    def job_name(self) -> str:
        """The job by name: a derivation's name, or an evaluation's repository@commit."""
        build, evaluation = self.derivation_build, self.evaluation
        if build is not None:
            return f"build {build.name}"
        if evaluation is not None:
            return f"evaluation {evaluation.repository}@{evaluation.commit[:12]}"
        return self.job_id


class BuildAttempt(models.Model):
    """One try at realising a shared build on a worker."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    build = models.ForeignKey(DerivationBuild, on_delete=models.CASCADE, related_name="build_attempts")
    # No constraint in the database: the attempt is written by the statement that writes its assignment
    # (claims._CLAIM_BUILDS), and at each claim's commit the deferred check locked the new assignment row
    # again (a quarter of PostgreSQL's time per hand-out, bench/handout.py). Django's SET_NULL still
    # applies when an assignment is deleted through the ORM (none is deleted otherwise).
    dispatched_job = models.ForeignKey(
        DispatchedJob,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="build_attempts",
        db_constraint=False,
    )
    worker = models.ForeignKey(
        "workers.Worker", null=True, blank=True, on_delete=models.SET_NULL, related_name="build_attempts"
    )
    number = models.PositiveIntegerField()
    outcome = models.CharField(
        max_length=16, choices=choices(BuildAttemptOutcome), default=BuildAttemptOutcome.RUNNING
    )
    failure_kind = models.CharField(max_length=32, choices=choices(BuildFailureKind), null=True, blank=True)
    error = models.TextField(blank=True, default="")
    elapsed_ms = models.BigIntegerField(null=True, blank=True)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "build_attempt"
        ordering = ["build", "number"]
        constraints = [
            models.UniqueConstraint(
                fields=["build"],
                condition=Q(outcome=BuildAttemptOutcome.RUNNING),
                name="idx-build_attempt-running",
                violation_error_message="A shared build has at most one running attempt.",
            ),
        ]
        indexes = [
            # The latest ended tries, newest first (queue_position's history of a project: what the jobs
            # ahead last). Only ended tries: the claim's insert (finished_at NULL) writes no entry.
            models.Index(
                fields=["-finished_at"],
                name="idx-build_attempt-ended",
                condition=Q(finished_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        worker = self.worker
        return f"attempt {self.number} on {worker.name if worker is not None else '-'} ({self.outcome})"


# --- Offer state: what each worker was offered and how it scored it ---------------------------------


class SentCandidate(models.Model):
    """A candidate already offered to a worker: offers send only what is missing here. Returning a job
    to the pool deletes its rows, which is what "clearing its sent flag" means."""

    # No constraint in the database and no index of its own (the unique (worker, job_id) serves a
    # worker's rows): a connecting worker is sent up to 1 000 candidates in one statement, and each row
    # checked its worker again at commit (1 000 lookups of one id). Deleting a worker still deletes
    # its rows (Django's CASCADE); a session's end deletes them anyway.
    worker = models.ForeignKey(
        "workers.Worker",
        on_delete=models.CASCADE,
        related_name="sent_candidates",
        db_constraint=False,
        db_index=False,
    )
    job_id = models.CharField(max_length=64)
    sent_at = models.DateTimeField(
        default=timezone.now, help_text="When it was offered: RescoreWait waits up to 4 passes for its score."
    )

    class Meta:
        db_table = "sent_candidate"
        constraints = [
            models.UniqueConstraint(
                fields=["worker", "job_id"],
                name="sent_candidate-unique",
                violation_error_message="This candidate was already sent to this worker.",
            ),
        ]
        indexes = [models.Index(fields=["job_id"], name="idx-sent_candidate-job")]

    def __str__(self) -> str:
        return f"{self.job_id} sent to {self.worker_id}"


class SentList(models.Model):
    """A first offer shared by workers alike (offers._shared_first_offer: a fleet connecting at once to
    a deep queue is sent the same up to 1 000 candidates), stored once: the job keys, in order. Each
    worker sent it has a SentOffer pointing here instead of a SentCandidate row per key; its first
    delta writes the keys still Queued as its own rows. Returning a job to the pool takes its key out
    of every list (offers.forget_sent). A list no worker points at goes after a minute."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    job_ids = models.JSONField(default=list, help_text="The job keys offered, in the offer's order.")
    made_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "sent_list"

    def __str__(self) -> str:
        return f"first offer of {len(self.job_ids)} made at {self.made_at:%H:%M:%S}"


class SentOffer(models.Model):
    """A worker sent a shared first offer (SentList) and no delta since: its sent set is the list's keys
    plus its SentCandidate rows, until its next delta or full list writes them as rows."""

    worker = models.OneToOneField(
        "workers.Worker", on_delete=models.CASCADE, primary_key=True, related_name="sent_offer"
    )
    sent_list = models.ForeignKey(SentList, on_delete=models.CASCADE, related_name="offers")
    sent_at = models.DateTimeField(default=timezone.now, help_text="When this worker was sent the list.")

    class Meta:
        db_table = "sent_offer"

    def __str__(self) -> str:
        return f"first offer sent to {self.worker_id}"


class CandidateScore(models.Model):
    """A worker's RequestJobChunk answer for one candidate: what it would have to fetch."""

    # As SentCandidate.worker: a worker's RequestJobChunk stores up to 1 000 scores at once.
    worker = models.ForeignKey(
        "workers.Worker",
        on_delete=models.CASCADE,
        related_name="candidate_scores",
        db_constraint=False,
        db_index=False,
    )
    job_id = models.CharField(max_length=64)
    missing_count = models.IntegerField()
    missing_nar_size = models.BigIntegerField()
    outputs_present = models.BooleanField(default=False)
    updated_at = models.DateTimeField()

    class Meta:
        db_table = "candidate_score"
        constraints = [
            models.UniqueConstraint(
                fields=["worker", "job_id"],
                name="candidate_score-unique",
                violation_error_message="One score per worker and candidate.",
            ),
        ]
        indexes = [models.Index(fields=["job_id"], name="idx-candidate_score-job")]

    def __str__(self) -> str:
        return f"{self.job_id} on {self.worker_id}: {self.missing_nar_size} B missing"


class EvalIngest(models.Model):
    """An eval_result arriving in parts on one assignment (protocol.md, "Large evaluations"). Each part
    is stored as it arrives; `decided_at` is set when the final part arrived and the graph was decided.
    Builds it created are held (never queued) while it is undecided and its assignment open; a part
    after the final one is dropped."""

    assignment = models.OneToOneField(
        DispatchedJob, primary_key=True, on_delete=models.CASCADE, related_name="eval_ingest"
    )
    evaluation = models.ForeignKey(Evaluation, on_delete=models.CASCADE, related_name="ingests")
    parts = models.PositiveIntegerField(default=0)
    derivations = models.PositiveIntegerField(
        default=0, help_text="Derivations received (one named twice counts twice)."
    )
    started_at = models.DateTimeField()
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "eval_ingest"

    def __str__(self) -> str:
        state = "decided" if self.decided_at else "arriving"
        return f"eval_result of {self.assignment_id}: {self.parts} parts, {state}"


class EvalIngestInput(models.Model):
    """An input of a build not known yet when its part arrived: the input's derivation may come in a
    later part. A build with such a row is never queued (its dependency edges are incomplete); the row
    becomes an edge when the input arrives, and goes when the result's final part shows the input is
    not part of it."""

    ingest = models.ForeignKey(EvalIngest, on_delete=models.CASCADE, related_name="pending_inputs")
    build = models.ForeignKey(DerivationBuild, on_delete=models.CASCADE, related_name="+")
    input_drv_path = models.CharField(max_length=1024)

    class Meta:
        db_table = "eval_ingest_input"
        constraints = [
            models.UniqueConstraint(
                fields=["ingest", "build", "input_drv_path"],
                name="eval_ingest_input-unique",
                violation_error_message="This pending input is noted already.",
            ),
        ]
        indexes = [
            models.Index(fields=["ingest", "input_drv_path"], name="idx-eval_ingest_input-path"),
            models.Index(fields=["build"], name="idx-eval_ingest_input-build"),
        ]

    def __str__(self) -> str:
        return f"{self.build_id} awaits {self.input_drv_path}"


# --- Build logs: what a build printed, per assignment (docs/logs.md) -------------------------------------


class BuildLog(models.Model):
    """One assignment's log of one build, as its worker streamed it (BuildLog pieces). While the
    assignment is open the text is in BuildLogChunk rows, one per stored piece; once it is closed the
    log-seal pass joins them into `blob` (zstandard) and deletes the chunks. The counters are
    gradient.scheduling.decisions.logs.LogState's."""

    build = models.ForeignKey(DerivationBuild, on_delete=models.CASCADE, related_name="logs")
    assignment = models.ForeignKey(DispatchedJob, on_delete=models.CASCADE, related_name="logs")
    received = models.BigIntegerField(
        default=0, help_text="The worker's position: where its next piece starts."
    )
    length = models.BigIntegerField(default=0, help_text="Characters stored, marker lines included.")
    size_bytes = models.BigIntegerField(default=0, help_text="UTF-8 bytes of the worker's text stored.")
    at_line_start = models.BooleanField(default=True)
    cut = models.BooleanField(default=False, help_text="GRADIENT_BUILD_LOG_MAX_BYTES was reached.")
    blob = models.BinaryField(null=True, blank=True, help_text="The whole text, zstandard, once sealed.")
    sealed_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "build_log"
        constraints = [
            models.UniqueConstraint(
                fields=["assignment", "build"],
                name="build_log-one-per-assignment-build",
                violation_error_message="This assignment already has a log of this build.",
            ),
        ]
        indexes = [
            models.Index(fields=["build", "-created_at"], name="idx-build_log-build"),
            models.Index(
                fields=["created_at"], name="idx-build_log-unsealed", condition=Q(sealed_at__isnull=True)
            ),
        ]

    def __str__(self) -> str:
        return f"log of {self.build_id} on {self.assignment_id}"


class BuildLogChunk(models.Model):
    """A stored piece of an open assignment's log: `data` starts at character `start` of the text."""

    log = models.ForeignKey(BuildLog, on_delete=models.CASCADE, related_name="chunks")
    start = models.BigIntegerField()
    data = models.TextField()

    class Meta:
        db_table = "build_log_chunk"
        constraints = [
            models.UniqueConstraint(
                fields=["log", "start"],
                name="build_log_chunk-unique-start",
                violation_error_message="A piece of this log is stored at this position already.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.log_id}@{self.start}"


class StartEstimate(models.Model):
    """A waiting build's or evaluation's expected start as the ETA pass first saw it in one wait (issue
    33), and, once it is handed out, when it really started: the error of past estimates, shown on the
    overview and as gradient_eta_error_seconds. One per wait (a build queued again is estimated again)."""

    build = models.ForeignKey(
        DerivationBuild, null=True, blank=True, on_delete=models.CASCADE, related_name="start_estimates"
    )
    evaluation = models.ForeignKey(
        Evaluation, null=True, blank=True, on_delete=models.CASCADE, related_name="start_estimates"
    )
    waiting_since = models.DateTimeField(
        help_text="The build's queued_at, or the evaluation's created_at: which wait this estimates."
    )
    estimated_at = models.DateTimeField()
    position = models.PositiveIntegerField()
    expected_start = models.DateTimeField(null=True, blank=True, help_text="Null: no basis (unknown).")
    basis = models.CharField(max_length=16)
    started_at = models.DateTimeField(null=True, blank=True, help_text="Its first hand-out after it.")
    error_secs = models.FloatField(null=True, blank=True, help_text="|started_at - expected_start|.")

    class Meta:
        db_table = "start_estimate"
        constraints = [
            models.UniqueConstraint(
                fields=["build", "waiting_since"],
                name="start_estimate-one-per-wait",
                violation_error_message="This wait of the build is estimated already.",
            ),
            models.UniqueConstraint(
                fields=["evaluation", "waiting_since"],
                name="start_estimate-one-per-eval-wait",
                violation_error_message="This wait of the evaluation is estimated already.",
            ),
            models.CheckConstraint(
                condition=Q(build__isnull=False, evaluation__isnull=True)
                | Q(build__isnull=True, evaluation__isnull=False),
                name="start_estimate-one-job",
                violation_error_message="An estimate is of one build or one evaluation.",
            ),
        ]
        indexes = [
            models.Index(
                fields=["estimated_at"], name="idx-start_estimate-open", condition=Q(started_at__isnull=True)
            ),
            models.Index(fields=["started_at"], name="idx-start_estimate-started"),
        ]

    def __str__(self) -> str:
        return f"estimate of {self.build_id or self.evaluation_id} at {self.estimated_at:%Y-%m-%d %H:%M:%S}"
