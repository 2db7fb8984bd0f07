"""The Job and JobCandidate payloads of the worker protocol, built from rows (protocol.md, Shapes), as
the protocol's own types: they are encoded once, on the way out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from gradient.core.protocol import (
    BuildJob,
    BuildRequirement,
    BuildSpec,
    CachedSource,
    FlakeJob,
    FlakeSource,
    FlakeStep,
    JobCandidate,
    OutputPath,
    RepositorySource,
    RequiredPath,
)
from gradient.core.vocab import FlakeSourceKind
from gradient.scheduling.models import DerivationBuild, Evaluation

FETCH_FLAKE: Final[FlakeStep] = "FetchFlake"
EVALUATE_FLAKE: Final[FlakeStep] = "EvaluateFlake"
EVALUATE_DERIVATIONS: Final[FlakeStep] = "EvaluateDerivations"
FULL_EVAL_STEPS: Final[tuple[FlakeStep, ...]] = (FETCH_FLAKE, EVALUATE_FLAKE, EVALUATE_DERIVATIONS)
FETCH_ONLY_STEPS: Final[tuple[FlakeStep, ...]] = (FETCH_FLAKE,)
FOLLOWUP_STEPS: Final[tuple[FlakeStep, ...]] = (EVALUATE_FLAKE, EVALUATE_DERIVATIONS)
EVAL_TIMEOUT_SECS: Final = 3600


def eval_steps(evaluation: Evaluation, *, split: bool) -> tuple[FlakeStep, ...]:
    """The steps of the evaluation's next job: the cached follow-up after a fetch-only job; a fetch-only
    job when this pass splits (an idle eval-only worker is present and the evaluation is no cluster
    member); otherwise all three in one job."""
    if evaluation.followup_pending:
        return FOLLOWUP_STEPS
    return FETCH_ONLY_STEPS if split else FULL_EVAL_STEPS


def flake_source(evaluation: Evaluation) -> FlakeSource:
    if evaluation.followup_pending and evaluation.flake_source:
        return CachedSource(store_path=evaluation.flake_source)
    if evaluation.source_kind == FlakeSourceKind.CACHED:
        return CachedSource(store_path=evaluation.repository)
    return RepositorySource(url=evaluation.repository, commit=evaluation.commit)


def eval_job(evaluation: Evaluation, steps: Sequence[FlakeStep]) -> FlakeJob:
    return FlakeJob(
        steps=list(steps),
        source=flake_source(evaluation),
        wildcards=list(evaluation.wildcards or []),
        timeout_secs=EVAL_TIMEOUT_SECS,
    )


def requirement(build: DerivationBuild) -> BuildRequirement:
    return BuildRequirement(architecture=build.system, required_features=list(build.required_features or []))


def build_job(build: DerivationBuild) -> BuildJob:
    return BuildJob(
        builds=[
            BuildSpec(
                build_id=str(build.id),
                drv_path=build.drv_path,
                outputs=[OutputPath(name=o["name"], path=o["path"]) for o in build.outputs or []],
                timeout_secs=build.timeout_secs,
                max_silent_secs=build.max_silent_secs,
            )
        ],
        requirement=requirement(build),
    )


def required_paths(paths: Sequence[str], nar_sizes: Mapping[str, int]) -> list[RequiredPath]:
    return [RequiredPath(path=p, nar_size=nar_sizes.get(p)) for p in paths]


def eval_candidate(evaluation: Evaluation, nar_sizes: Mapping[str, int]) -> JobCandidate:
    paths = [evaluation.flake_source] if evaluation.followup_pending and evaluation.flake_source else []
    return JobCandidate(
        job_id=evaluation.job_key,
        kind="flake",
        required_paths=required_paths(paths, nar_sizes),
        drv_paths=[],
        output_paths=[],
        requirement=None,
    )


def build_candidate(
    build: DerivationBuild, input_paths: Sequence[str], nar_sizes: Mapping[str, int]
) -> JobCandidate:
    return JobCandidate(
        job_id=build.job_key,
        kind="build",
        required_paths=required_paths(input_paths, nar_sizes),
        drv_paths=[build.drv_path],
        output_paths=[o["path"] for o in build.outputs or []],
        requirement=requirement(build),
    )
