"""Drive the scheduling services the way a worker session does, for service-level tests."""

from __future__ import annotations

import random
import uuid
from typing import Any

import msgspec
from django.utils import timezone

from gradient.core.protocol import decode_worker_message
from gradient.scheduling.services.assignment import Assignment, request_job
from gradient.scheduling.services.claims import BuildClaim
from gradient.scheduling.services.reports import ReportOutcome, handle_report


def drv(
    name: str,
    *deps: str,
    system: str = "x86_64-linux",
    features: list[str] | None = None,
    attr: str | None = None,
    cached: bool = False,
) -> dict[str, Any]:
    out = f"/nix/store/{name:0>32}-{name}"
    return {
        "drv_path": f"/nix/store/{name:0>32}-{name}.drv",
        "attr": attr,
        "system": system,
        "required_features": features or [],
        "outputs": [{"name": "out", "path": out}],
        "input_drvs": [f"/nix/store/{d:0>32}-{d}.drv" for d in deps],
        "cached_outputs": [{"path": out, "nar_size": 1000}] if cached else [],
    }


def nixpkgs_like(n: int, *, seed: int = 7, cached_every: int = 5, prefix: str = "p") -> list[dict[str, Any]]:
    """n derivations, each with 1-5 inputs among the earlier ones (the first has none), every
    `cached_every`-th one cached; in a shuffled order, so inputs often come in later parts."""
    rng = random.Random(seed)
    names = [f"{prefix}{i}" for i in range(n)]
    out = []
    for i, name in enumerate(names):
        inputs = rng.sample(names[:i], min(i, rng.randint(1, 5))) if i else []
        out.append(drv(name, *inputs, cached=i % cached_every == cached_every - 1, attr=f"pkgs.{name}"))
    rng.shuffle(out)
    return out


def diamond() -> list[dict[str, Any]]:
    return [drv("a"), drv("b", "a"), drv("c", "a"), drv("d", "b", "c", attr="packages.x86_64-linux.d")]


def evaluating(project: Any = None) -> tuple[Any, Any, Assignment]:
    """An evaluation of `project` (a new one by default) on a connected worker of it, evaluating
    derivations: (evaluation, worker, assignment)."""
    from tests.factories import EvaluationFactory, ProjectFactory, connected_worker

    project = project if project is not None else ProjectFactory()
    evaluation = EvaluationFactory(project=project)
    worker = connected_worker([project])
    a = ask(worker.id, "flake")
    assert a is not None and a.job_key == evaluation.job_key
    update(worker.id, a, kind="evaluating_derivations")
    return evaluation, worker, a


def ask(worker_id: uuid.UUID, kind: str = "build") -> Assignment | None:
    return request_job(worker_id=worker_id, protocol_kind=kind, now=timezone.now())


def report(worker_id: uuid.UUID, a: Assignment, type_: str, **fields: Any) -> ReportOutcome:
    message = {"type": type_, "job_id": a.job_key, "assignment_id": str(a.assignment_id), **fields}
    if type_ in ("JobCompleted", "JobFailed"):
        message.setdefault("elapsed_ms", 1)  # required on the wire; no test here is about it
    return handle_report(worker_id=worker_id, message=wire(message), now=timezone.now())


def job_json(a: Assignment) -> dict[str, Any]:
    """The assignment's job as its JSON object (the AssignJob's `job`)."""
    return msgspec.to_builtins(a.job)  # type: ignore[no-any-return]


def build_id_of(a: Assignment) -> str:
    return str(a.job.builds[0].build_id)  # type: ignore[union-attr]


def wire(message: dict[str, Any]) -> Any:
    """A message as the consumer hands it on: decoded strictly from its JSON frame."""
    return decode_worker_message(msgspec.json.encode(message))


def update(worker_id: uuid.UUID, a: Assignment, **update_fields: Any) -> ReportOutcome:
    return report(worker_id, a, "JobUpdate", update=update_fields)


def evaluate(worker_id: uuid.UUID, a: Assignment, derivations: list[dict[str, Any]]) -> None:
    update(worker_id, a, kind="evaluating_flake")
    update(worker_id, a, kind="eval_result", derivations=derivations, warnings=[], errors=[])
    report(worker_id, a, "JobCompleted", elapsed_ms=5)


def build(worker_id: uuid.UUID, a: Assignment) -> None:
    spec = msgspec.to_builtins(a.job)["builds"][0]
    update(worker_id, a, kind="building", build_id=spec["build_id"])
    outputs = [{"name": o["name"], "path": o["path"], "nar_size": 4096} for o in spec["outputs"]]
    update(worker_id, a, kind="build_output", build_id=spec["build_id"], outputs=outputs, substituted=False)
    report(worker_id, a, "JobCompleted", elapsed_ms=5)


def build_claim_for(
    build: Any, worker: Any, session_id: uuid.UUID | None, room: int | None = None, finishing: int = 0
) -> BuildClaim:
    """A claim of `build` for `worker`'s session, as a RequestJob batch makes it (empty payload)."""
    return BuildClaim(
        assignment_id=uuid.uuid4(),
        build_id=build.id,
        worker_id=worker.id,
        job={},
        queued_at=build.queued_at,
        session_id=session_id,
        room=room,
        finishing=finishing,
    )
