"""factory_boy factories for the scheduler's rows."""

from __future__ import annotations

import hashlib
import uuid

import factory
from django.utils import timezone

from gradient.clusters.models import ClusterAttempt, ClusterJob, ClusterMember
from gradient.scheduling.models import (
    DerivationBuild,
    DispatchedJob,
    Evaluation,
    JobKind,
    Project,
    build_key,
    eval_key,
)
from gradient.workers.models import Worker, WorkerSession


class ProjectFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Project
        django_get_or_create = ("name",)

    name = factory.Sequence(lambda n: f"project-{n}")


class WorkerFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Worker

    name = factory.Sequence(lambda n: f"worker-{n}")
    token_hash = factory.LazyAttribute(lambda o: hashlib.sha256(o.name.encode()).hexdigest())
    can_fetch = True
    can_eval = True
    can_build = True
    architectures = factory.LazyFunction(lambda: ["x86_64-linux"])


class EvaluationFactory(factory.django.DjangoModelFactory):
    """An evaluation with its record, as the services create them (pass record=False to skip it)."""

    class Meta:
        model = Evaluation
        skip_postgeneration_save = True

    project = factory.SubFactory(ProjectFactory)
    repository = "sim:chain?n=3"
    commit = factory.Sequence(lambda n: f"{n:040x}")

    @factory.post_generation
    def record(obj, create, extracted, **kwargs):  # type: ignore[no-untyped-def]  # noqa: N805
        if create and extracted is not False:
            from gradient.scheduling import history

            history.evaluation_record_create(
                evaluation=obj, created_by=None, idempotency_key=None, now=timezone.now()
            )


class DerivationBuildFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = DerivationBuild

    drv_path = factory.Sequence(lambda n: f"/nix/store/{n:032d}-pkg-{n}.drv")
    system = "x86_64-linux"


class DispatchedJobFactory(factory.django.DjangoModelFactory):
    """An open assignment of a build by default; pass evaluation=... for an eval job."""

    class Meta:
        model = DispatchedJob

    kind = JobKind.BUILD
    derivation_build = factory.SubFactory(DerivationBuildFactory)
    job_id = factory.LazyAttribute(
        lambda o: eval_key(o.evaluation.id) if o.kind == JobKind.EVAL else build_key(o.derivation_build.id)
    )
    worker = factory.SubFactory(WorkerFactory)
    dispatched_at = factory.LazyFunction(timezone.now)


class ClusterJobFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ClusterJob


class ClusterMemberFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ClusterMember

    cluster_job = factory.SubFactory(ClusterJobFactory)
    derivation_build = factory.SubFactory(DerivationBuildFactory)
    role = "node"
    index = factory.Sequence(lambda n: n)


class ClusterAttemptFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ClusterAttempt

    cluster_job = factory.SubFactory(ClusterJobFactory)
    number = 1
    created_at = factory.LazyFunction(timezone.now)


class WorkerSessionFactory(factory.django.DjangoModelFactory):
    """An open session: the worker is connected."""

    class Meta:
        model = WorkerSession

    worker = factory.SubFactory(WorkerFactory)
    channel_name = factory.Sequence(lambda n: f"test-channel-{n}")
    server_boot = factory.LazyFunction(uuid.uuid4)
    opened_at = factory.LazyFunction(timezone.now)
    last_seen = factory.LazyFunction(timezone.now)


def connected_worker(projects: list[Project] | None = None, **fields: object) -> Worker:
    """A registered, active worker with an open session, authorized for `projects`."""
    worker = WorkerFactory(**fields)
    if projects:
        worker.projects.set(projects)
    WorkerSessionFactory(worker=worker)
    return worker
