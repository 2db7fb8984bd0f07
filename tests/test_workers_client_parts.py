"""The reference worker's eval_result in parts: each frame fits, the last is final, nothing is lost."""

from __future__ import annotations

import random

import msgspec
import pytest

from gradient.core.protocol import (
    MAX_FRAME_BYTES,
    CachedOutput,
    DiscoveredDerivation,
    JobUpdate,
    OutputPath,
    decode_worker_message,
    encode,
)
from gradient.workers.client.parts import (
    DerivationTooLarge,
    dependencies_first,
    eval_result_parts,
)


def _derivations(n: int, seed: int = 1) -> list[DiscoveredDerivation]:
    rng = random.Random(seed)
    paths = [f"/nix/store/{i:032d}-pkg-{i}.drv" for i in range(n)]
    out = []
    for i, path in enumerate(paths):
        inputs = rng.sample(paths[:i], min(i, rng.randint(1, 5))) if i else []
        out.append(
            DiscoveredDerivation(
                drv_path=path,
                system="x86_64-linux",
                required_features=[],
                outputs=[OutputPath(name="out", path=f"/nix/store/{i:032d}-pkg-{i}")],
                input_drvs=inputs,
                cached_outputs=[CachedOutput(path=f"/nix/store/{i:032d}-pkg-{i}", nar_size=10)]
                if i % 5 == 0
                else [],
                attr=f"packages.x86_64-linux.pkg-{i}" if i % 7 == 0 else None,
            )
        )
    rng.shuffle(out)
    return out


def test_a_result_that_fits_one_frame_is_one_part_without_is_final() -> None:
    parts = eval_result_parts(derivations=_derivations(100), warnings=["w"], errors=[])
    assert len(parts) == 1 and parts[0].is_final is None and len(parts[0].derivations) == 100


def test_a_large_result_goes_in_parts_that_each_fit_a_frame_the_last_one_final() -> None:
    derivations = _derivations(5000)
    parts = eval_result_parts(
        derivations=derivations,
        warnings=["a warning"] * 3,
        errors=["an error"],
        job_id="eval:" + "0" * 36,
        assignment_id="1" * 36,
    )
    assert len(parts) > 2
    assert [p.is_final for p in parts] == [False] * (len(parts) - 1) + [True]
    for part in parts:
        frame = encode(JobUpdate(job_id="eval:" + "0" * 36, assignment_id="1" * 36, update=part))
        assert len(frame.encode()) <= 768 * 1024 < MAX_FRAME_BYTES
        decode_worker_message(frame)  # the server's own strict decoding takes it
    sent = [d for p in parts for d in p.derivations]
    assert sorted(msgspec.json.encode(d) for d in sent) == sorted(msgspec.json.encode(d) for d in derivations)
    assert [w for p in parts for w in p.warnings] == ["a warning"] * 3
    assert [e for p in parts for e in p.errors] == ["an error"]


def test_parts_are_cut_by_encoded_size_not_by_count() -> None:
    small = _derivations(2000)
    big = [
        msgspec.structs.replace(d, required_features=["kvm-" + "x" * 400]) for d in _derivations(2000, seed=2)
    ]
    assert len(eval_result_parts(derivations=big, warnings=[], errors=[])) > len(
        eval_result_parts(derivations=small, warnings=[], errors=[])
    )


def test_dependencies_come_before_their_dependents() -> None:
    ordered = dependencies_first(_derivations(3000))
    position = {d.drv_path: i for i, d in enumerate(ordered)}
    assert len(ordered) == 3000
    assert all(position[i] < position[d.drv_path] for d in ordered for i in d.input_drvs)


def test_a_derivation_named_twice_is_sent_once_and_a_cycle_does_not_hang() -> None:
    a = DiscoveredDerivation(
        drv_path="/nix/store/a.drv",
        system="x",
        required_features=[],
        outputs=[],
        input_drvs=["/nix/store/b.drv"],
        cached_outputs=[],
    )
    b = msgspec.structs.replace(a, drv_path="/nix/store/b.drv", input_drvs=["/nix/store/a.drv"])
    ordered = dependencies_first([a, b, a])
    assert sorted(d.drv_path for d in ordered) == ["/nix/store/a.drv", "/nix/store/b.drv"]


def test_a_derivation_too_large_for_a_frame_is_refused_before_anything_is_sent() -> None:
    huge = msgspec.structs.replace(_derivations(1)[0], required_features=["x" * (MAX_FRAME_BYTES + 1)])
    with pytest.raises(DerivationTooLarge):
        eval_result_parts(derivations=[huge], warnings=[], errors=[])


def test_a_warning_longer_than_a_part_is_cut() -> None:
    parts = eval_result_parts(derivations=[], warnings=["w" * (2 * MAX_FRAME_BYTES)], errors=[])
    assert len(parts) == 1 and len(parts[0].warnings[0]) < 20_000


def test_known_derivations_too_many_for_a_frame_go_first_in_parts_that_each_fit() -> None:
    known = [f"/nix/store/{i:032d}-known-{i}.drv" for i in range(30_000)]
    derivations = _derivations(2000)
    budget = 256 * 1024
    parts = eval_result_parts(
        derivations=derivations,
        warnings=[],
        errors=[],
        known_drvs=known,
        job_id="j",
        assignment_id="a",
        budget=budget,
    )
    assert len(parts) > 2 and parts[-1].is_final is True
    assert all(len(encode(JobUpdate(job_id="j", assignment_id="a", update=p))) <= budget for p in parts)
    assert [k for p in parts for k in p.known_drvs or []] == known
    first_with_derivations = next(i for i, p in enumerate(parts) if p.derivations)
    assert all(not p.known_drvs for p in parts[first_with_derivations + 1 :])
    assert sum(len(p.derivations) for p in parts) == 2000
