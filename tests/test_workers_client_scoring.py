"""The reference worker's scoring of offered candidates against its local store."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gradient.core.protocol import BuildRequirement, JobCandidate, RequiredPath
from gradient.workers.client.scoring import paths_to_check, score_candidate, score_candidates

PATHS = [f"/nix/store/{i:032d}-p{i}" for i in range(8)]

required_paths = st.lists(
    st.builds(RequiredPath, path=st.sampled_from(PATHS), nar_size=st.none() | st.integers(0, 10**9)),
    max_size=8,
)
candidates = st.builds(
    JobCandidate,
    job_id=st.sampled_from(["build:a", "build:b", "eval:c"]),
    kind=st.sampled_from(["flake", "build"]),
    required_paths=required_paths,
    drv_paths=st.just([]),
    output_paths=st.lists(st.sampled_from(PATHS), max_size=3),
    requirement=st.none(),
)
stores = st.sets(st.sampled_from(PATHS))


def _candidate(required: list[tuple[str, int | None]], outputs: list[str]) -> JobCandidate:
    return JobCandidate(
        job_id="build:x",
        kind="build",
        required_paths=[RequiredPath(path=p, nar_size=s) for p, s in required],
        drv_paths=["/nix/store/x.drv"],
        output_paths=outputs,
        requirement=BuildRequirement(architecture="x86_64-linux", required_features=[]),
    )


def test_missing_paths_are_counted_with_their_nar_sizes() -> None:
    candidate = _candidate([(PATHS[0], 100), (PATHS[1], 50), (PATHS[2], None)], [PATHS[3]])
    score = score_candidate(candidate, {PATHS[1]})
    assert (score.job_id, score.missing_count, score.missing_nar_size, score.outputs_present) == (
        "build:x",
        2,
        100,
        False,
    )


def test_outputs_present_only_when_every_output_is_local() -> None:
    candidate = _candidate([], [PATHS[3], PATHS[4]])
    assert score_candidate(candidate, {PATHS[3], PATHS[4]}).outputs_present
    assert not score_candidate(candidate, {PATHS[3]}).outputs_present
    assert not score_candidate(_candidate([], []), set(PATHS)).outputs_present


@given(candidates, stores)
def test_a_score_never_counts_a_local_or_repeated_path(candidate: JobCandidate, store: set[str]) -> None:
    score = score_candidate(candidate, store)
    missing = {r.path for r in candidate.required_paths} - store
    assert score.missing_count == len(missing)
    assert (
        0
        <= score.missing_nar_size
        <= sum(r.nar_size or 0 for r in candidate.required_paths if r.path in missing)
    )
    assert score_candidate(candidate, store | {r.path for r in candidate.required_paths}).missing_count == 0


@given(candidates, stores, stores)
def test_a_bigger_store_never_makes_a_candidate_worse(
    candidate: JobCandidate, a: set[str], b: set[str]
) -> None:
    small, big = score_candidate(candidate, a), score_candidate(candidate, a | b)
    assert big.missing_count <= small.missing_count
    assert big.missing_nar_size <= small.missing_nar_size
    assert big.outputs_present or not small.outputs_present


@given(st.lists(candidates, max_size=5), stores)
def test_every_candidate_gets_one_score_and_every_path_is_checked_once(
    offered: list[JobCandidate], store: set[str]
) -> None:
    scores = score_candidates(offered, store)
    assert [s.job_id for s in scores] == [c.job_id for c in offered]
    checked = paths_to_check(offered)
    assert len(checked) == len(set(checked))
    assert set(checked) == {r.path for c in offered for r in c.required_paths} | {
        p for c in offered for p in c.output_paths
    }
