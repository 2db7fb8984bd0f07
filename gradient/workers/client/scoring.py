"""How a worker scores an offered candidate against its local store: what it would have to fetch."""

from __future__ import annotations

from collections.abc import Iterable, Set

from gradient.core.protocol import CandidateScore, JobCandidate


def paths_to_check(candidates: Iterable[JobCandidate]) -> list[str]:
    """Every store path the scores depend on (required paths and outputs), once each."""
    paths: dict[str, None] = {}
    for candidate in candidates:
        for required in candidate.required_paths:
            paths[required.path] = None
        for output in candidate.output_paths:
            paths[output] = None
    return list(paths)


def score_candidate(candidate: JobCandidate, present: Set[str]) -> CandidateScore:
    """missing_count / missing_nar_size: the required paths not in the local store (a path of unknown
    size, not in the cache, counts with size 0); outputs_present: every output is already local."""
    missing: dict[str, int] = {}
    for required in candidate.required_paths:
        if required.path not in present:
            missing[required.path] = max(missing.get(required.path, 0), required.nar_size or 0)
    return CandidateScore(
        job_id=candidate.job_id,
        missing_count=len(missing),
        missing_nar_size=sum(missing.values()),
        outputs_present=bool(candidate.output_paths) and all(p in present for p in candidate.output_paths),
    )


def score_candidates(candidates: Iterable[JobCandidate], present: Set[str]) -> list[CandidateScore]:
    return [score_candidate(c, present) for c in candidates]
