"""The matcher: seats for one cluster, one test per clause of the Placement section, plus properties."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from gradient.clusters.decisions.matcher import (
    MatchPolicy,
    PoolIndex,
    can_seat,
    idle_available,
    match_cluster,
)
from gradient.clusters.decisions.types import (
    BUILTIN_SYSTEM,
    Cluster,
    Member,
    Placement,
    Pool,
    SeatShortage,
    SlotKind,
    SlotSnapshot,
    WaitingCode,
    WaitingReason,
    WorkerSnapshot,
)
from tests.support.clusters import NOW, X86, ago, build, cluster, evaluation, idle, pool, worker


def placed(result: Placement | WaitingReason) -> dict[str, str]:
    assert isinstance(result, Placement), result
    return {f"{s.role}[{s.index}]": s.worker_id for s in result.seats}


def waiting(result: Placement | WaitingReason) -> WaitingReason:
    assert isinstance(result, WaitingReason), result
    return result


# A worker is a seat for a member when holding an idle slot of the member's kind ...


def test_a_worker_with_an_idle_slot_of_the_members_kind_is_a_seat() -> None:
    c = cluster("c", build("a"), evaluation("b"))
    p = pool([worker("w1"), worker("w2")], idle_build=["w1"], idle_eval=["w2"])

    assert placed(match_cluster(c, p, NOW)) == {"a[0]": "w1", "b[0]": "w2"}


def test_an_idle_slot_of_the_other_kind_is_no_seat() -> None:
    c = cluster("c", build("a"), build("b"))
    p = pool([worker("w1"), worker("w2")], idle_build=["w1"], idle_eval=["w2"])

    reason = waiting(match_cluster(c, p, NOW))

    assert reason.code == WaitingCode.TOO_FEW_WORKERS
    assert (reason.seatable_workers, reason.needed) == (1, 2)


def test_an_idle_slot_older_than_25_seconds_is_ignored() -> None:
    c = cluster("c", build("a"))
    ws = [worker("w1"), worker("w2")]
    p = pool(ws, idle_build=[], slots=[idle("w1", age=26.0), idle("w2", age=25.0)])

    assert placed(match_cluster(c, p, NOW)) == {"a[0]": "w2"}


def test_two_idle_kinds_on_one_worker_still_seat_one_member() -> None:
    c = cluster("c", build("a"), evaluation("b"))
    p = pool([worker("w1")], idle_build=["w1"], idle_eval=["w1"])

    assert waiting(match_cluster(c, p, NOW)).code == WaitingCode.TOO_FEW_WORKERS


# ... and matching the pin of the member.


def test_a_pinned_member_sits_only_on_its_pinned_worker() -> None:
    c = cluster("c", build("a"), build("b", pin="w1"))
    p = pool([worker("w1"), worker("w2")])

    assert placed(match_cluster(c, p, NOW)) == {"a[0]": "w2", "b[0]": "w1"}


def test_a_pinned_member_whose_worker_is_not_idle_has_no_seat() -> None:
    c = cluster("c", build("a"), build("b", pin="w3"))
    p = pool([worker("w1"), worker("w2"), worker("w3")], idle_build=["w1", "w2"])

    reason = waiting(match_cluster(c, p, NOW))

    assert reason.code == WaitingCode.NO_SEAT
    assert [(m.address.role, m.reason, m.pin) for m in reason.members] == [
        ("b", SeatShortage.PIN_NOT_IDLE, "w3")
    ]


# The worker must also be able to take the job (capabilities, project access).


def test_a_build_member_needs_a_worker_whose_architectures_contain_its_system() -> None:
    c = cluster("c", build("a", system="aarch64-linux"))
    p = pool([worker("x86"), worker("arm", archs=["aarch64-linux"])])

    assert placed(match_cluster(c, p, NOW)) == {"a[0]": "arm"}


def test_a_builtin_build_skips_the_system_check() -> None:
    c = cluster("c", build("a", system=BUILTIN_SYSTEM))
    p = pool([worker("w1", archs=["riscv64-linux"])])

    assert placed(match_cluster(c, p, NOW)) == {"a[0]": "w1"}


def test_a_build_member_needs_every_required_feature() -> None:
    c = cluster("c", build("a", features=["kvm", "big-parallel"]))
    p = pool(
        [worker("kvm-only", features=["kvm"]), worker("both", features=["kvm", "big-parallel", "nixos-test"])]
    )

    assert placed(match_cluster(c, p, NOW)) == {"a[0]": "both"}


def test_a_build_member_needs_a_build_capable_worker() -> None:
    c = cluster("c", build("a"))
    p = pool([worker("w1", build=False)])

    assert waiting(match_cluster(c, p, NOW)).members[0].reason == SeatShortage.NO_CAPABLE_WORKER


def test_an_eval_member_needs_an_eval_capable_worker() -> None:
    c = cluster("c", evaluation("a"))
    p = pool(
        [worker("builder", eval=False), worker("evaluator")],
        idle_build=[],
        idle_eval=["builder", "evaluator"],
    )

    assert placed(match_cluster(c, p, NOW)) == {"a[0]": "evaluator"}


def test_an_eval_member_that_fetches_needs_a_fetch_capable_worker_since_it_is_never_split() -> None:
    c = cluster("c", evaluation("a", needs_fetch=True))
    p = pool(
        [worker("no-fetch", fetch=False), worker("fetcher")], idle_build=[], idle_eval=["no-fetch", "fetcher"]
    )

    assert placed(match_cluster(c, p, NOW)) == {"a[0]": "fetcher"}


def test_a_worker_without_project_access_is_no_seat() -> None:
    c = cluster("c", build("a", projects=["alpha"]))
    p = pool([worker("other", projects=["beta"]), worker("mine", projects=["beta", "alpha"])])

    assert placed(match_cluster(c, p, NOW)) == {"a[0]": "mine"}


def test_a_draining_worker_is_no_seat() -> None:
    c = cluster("c", build("a"))
    p = pool([worker("w1", draining=True), worker("w2")])

    assert placed(match_cluster(c, p, NOW)) == {"a[0]": "w2"}


# Members sit on their own workers, one each (bipartite matching) ...


def test_members_sit_on_distinct_workers_one_each() -> None:
    c = cluster("c", build("a"), build("b"), build("c"))
    p = pool([worker("w1"), worker("w2"), worker("w3")])

    seats = placed(match_cluster(c, p, NOW))

    assert sorted(seats.values()) == ["w1", "w2", "w3"]


def test_a_member_with_one_possible_worker_displaces_a_member_with_two() -> None:
    c = cluster("c", build("a"), build("b", system="aarch64-linux"))
    p = pool([worker("both", archs=[X86, "aarch64-linux"]), worker("x86")])

    assert placed(match_cluster(c, p, NOW)) == {"a[0]": "x86", "b[0]": "both"}


# ... at the lowest summed missing NAR size (min-cost matching).


def test_the_matching_minimises_the_summed_missing_nar_size() -> None:
    a, b = build("a"), build("b")
    # Seating each member greedily on its own cheapest worker would cost 0 + 100; the optimum is 10 + 0.
    scores = {("w1", a.job_key): 0, ("w2", a.job_key): 10, ("w1", b.job_key): 0, ("w2", b.job_key): 100}
    c = cluster("c", a, b)

    result = match_cluster(c, pool([worker("w1"), worker("w2")], scores=scores), NOW)

    assert placed(result) == {"a[0]": "w2", "b[0]": "w1"}
    assert isinstance(result, Placement) and result.cost == 10


def test_an_unknown_missing_size_counts_as_a_large_but_finite_cost() -> None:
    a = build("a")
    big = 500 << 30
    c = cluster("c", a)

    scored = match_cluster(
        c, pool([worker("scored"), worker("unscored")], scores={("scored", a.job_key): big}), NOW
    )
    only_unscored = match_cluster(c, pool([worker("unscored")]), NOW)

    assert placed(scored) == {"a[0]": "scored"}
    assert isinstance(only_unscored, Placement)
    assert only_unscored.cost == MatchPolicy().unknown_cost > big


# All members sit in one zone under same_zone. Workers without a zone form one zone of their own.


def test_same_zone_keeps_every_member_in_one_zone() -> None:
    c = cluster("c", build("a"), build("b"), same_zone=True)
    p = pool([worker("a1", zone="a"), worker("b1", zone="b"), worker("b2", zone="b")])

    result = match_cluster(c, p, NOW)

    assert sorted(placed(result).values()) == ["b1", "b2"]
    assert isinstance(result, Placement) and result.zone == "b"


def test_workers_without_a_zone_form_one_zone_of_their_own() -> None:
    c = cluster("c", build("a"), build("b"), same_zone=True)
    p = pool([worker("n1"), worker("n2", zone=""), worker("a1", zone="a")])

    result = match_cluster(c, p, NOW)

    assert sorted(placed(result).values()) == ["n1", "n2"]
    assert isinstance(result, Placement) and result.zone is None


def test_a_cluster_free_to_span_zones_uses_workers_in_any_zone() -> None:
    c = cluster("c", build("a"), build("b"))
    p = pool([worker("a1", zone="a"), worker("b1", zone="b")])

    assert sorted(placed(match_cluster(c, p, NOW)).values()) == ["a1", "b1"]


def test_a_pinned_member_draws_a_same_zone_cluster_into_its_zone() -> None:
    c = cluster("c", build("a"), build("b", pin="b2"), same_zone=True)
    p = pool([worker("a1", zone="a"), worker("a2", zone="a"), worker("b1", zone="b"), worker("b2", zone="b")])

    assert placed(match_cluster(c, p, NOW)) == {"a[0]": "b1", "b[0]": "b2"}


# The winning zone is the one with the lowest summed missing NAR size among zones seating every member.


def test_the_zone_with_the_lowest_summed_missing_nar_size_wins() -> None:
    a, b = build("a"), build("b")
    sizes = {"a1": 900, "a2": 900, "b1": 10, "b2": 10, "c1": 0}
    scores = {(w, m.job_key): size for w, size in sizes.items() for m in (a, b)}
    c = cluster("c", a, b, same_zone=True)
    # Zone c is cheapest per seat but cannot seat both members.
    p = pool([worker(w, zone=w[0]) for w in sizes], scores=scores)

    result = match_cluster(c, p, NOW)

    assert isinstance(result, Placement)
    assert (result.zone, result.cost) == ("b", 20)


def test_equal_zones_are_chosen_by_name_named_zones_before_the_unzoned_one() -> None:
    c = cluster("c", build("a"), same_zone=True)
    ws = [worker("n1"), worker("z1", zone="zeta"), worker("a1", zone="alpha")]

    result = match_cluster(c, pool(ws), NOW)
    reversed_input = match_cluster(c, pool(reversed(ws)), NOW)

    assert isinstance(result, Placement) and result.zone == "alpha"
    assert result == reversed_input


# Workers that recently rejected a prepare or let a hold expire are down-ranked, not excluded.


def test_a_recently_penalised_worker_is_down_ranked() -> None:
    a = build("a")
    scores = {("penalised", a.job_key): 0, ("clean", a.job_key): 50 << 30}
    p = pool([worker("penalised"), worker("clean")], scores=scores, penalties={"penalised": ago(60)})

    assert placed(match_cluster(cluster("c", a), p, NOW)) == {"a[0]": "clean"}


def test_a_recently_penalised_worker_still_seats_a_member_when_nothing_else_can() -> None:
    p = pool([worker("penalised")], penalties={"penalised": ago(60)})

    assert placed(match_cluster(cluster("c", build("a")), p, NOW)) == {"a[0]": "penalised"}


def test_a_penalty_older_than_the_window_is_forgotten() -> None:
    a = build("a")
    window = MatchPolicy().penalty_window_secs
    scores = {("once-penalised", a.job_key): 0, ("clean", a.job_key): 50 << 30}
    p = pool(
        [worker("once-penalised"), worker("clean")],
        scores=scores,
        penalties={"once-penalised": ago(window + 1)},
    )

    assert placed(match_cluster(cluster("c", a), p, NOW)) == {"a[0]": "once-penalised"}


# A cluster without a full placement must keep waiting, and says why.


def test_a_member_with_no_idle_slot_of_its_kind_is_explained() -> None:
    c = cluster("c", build("a"), evaluation("b"))
    p = pool([worker("w1"), worker("w2")])

    reason = waiting(match_cluster(c, p, NOW))

    assert reason.code == WaitingCode.NO_SEAT
    assert [(m.address.role, m.reason) for m in reason.members] == [("b", SeatShortage.NO_IDLE_SLOT)]


def test_a_member_with_no_capable_idle_worker_is_explained() -> None:
    c = cluster("c", build("a", system="aarch64-linux"))

    reason = waiting(match_cluster(c, pool([worker("w1")]), NOW))

    assert [(m.address.role, m.reason) for m in reason.members] == [("a", SeatShortage.NO_CAPABLE_WORKER)]


def test_a_member_without_project_access_is_explained() -> None:
    c = cluster("c", build("a", projects=["secret"]))

    reason = waiting(match_cluster(c, pool([worker("w1", projects=["public"])]), NOW))

    assert [(m.address.role, m.reason) for m in reason.members] == [("a", SeatShortage.NO_PROJECT_ACCESS)]


def test_too_few_distinct_workers_is_explained() -> None:
    c = cluster("c", build("a"), build("b"), build("c"))

    reason = waiting(match_cluster(c, pool([worker("w1"), worker("w2")]), NOW))

    assert reason.as_json() == {"code": "too_few_workers", "seatable_workers": 2, "needed": 3}


def test_under_same_zone_the_explanation_says_which_zone_is_short_of_what() -> None:
    c = cluster("c", build("a"), build("b", system="aarch64-linux"), build("c"), same_zone=True)
    p = pool(
        [
            worker("a1", zone="a"),
            worker("a2", zone="a"),
            worker("b1", zone="b", archs=["aarch64-linux"]),
            worker("b2", zone="b"),
        ]
    )

    reason = waiting(match_cluster(c, p, NOW))

    assert reason.as_json() == {
        "code": "no_zone_fits",
        "zones": [
            {
                "zone": "a",
                "unseated": [{"role": "b", "index": 0, "reason": "no_capable_worker"}],
                "seatable_workers": 2,
                "members": 3,
            },
            {"zone": "b", "unseated": [], "seatable_workers": 2, "members": 3},
        ],
        "seatable_workers": 4,
        "needed": 3,
    }


def test_a_cluster_without_members_is_never_placed() -> None:
    assert waiting(match_cluster(cluster("c"), pool([worker("w1")]), NOW)).code == WaitingCode.NO_MEMBERS


# Properties over random small pools.

ZONES = st.sampled_from([None, "a", "b"])
ARCHS = st.sampled_from([X86, "aarch64-linux"])


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Cluster, Pool]:
    n_workers = draw(st.integers(1, 6))
    workers = [
        WorkerSnapshot(
            worker_id=f"w{i}",
            name=f"w{i}",
            zone=draw(ZONES),
            can_fetch=draw(st.booleans()),
            can_eval=draw(st.booleans()),
            can_build=draw(st.booleans()),
            architectures=frozenset(draw(st.sets(ARCHS, min_size=1))),
            system_features=frozenset(draw(st.sets(st.sampled_from(["kvm", "big"])))),
            projects=draw(st.one_of(st.none(), st.sets(st.sampled_from(["p", "q"])).map(frozenset))),
            draining=draw(st.integers(0, 9)) == 0,
        )
        for i in range(n_workers)
    ]
    slots = [
        SlotSnapshot(w.worker_id, kind, ago(draw(st.sampled_from([0.0, 10.0, 24.0, 30.0]))))
        for w in workers
        for kind in SlotKind
        if draw(st.booleans())
    ]
    members = []
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(list(SlotKind)))
        members.append(
            Member(
                role="r",
                index=i,
                job_key=f"{kind.value}:{i}",
                kind=kind,
                pin=draw(st.one_of(st.none(), st.sampled_from([w.name for w in workers]))),
                system=draw(st.sampled_from([X86, "aarch64-linux", BUILTIN_SYSTEM])),
                required_features=frozenset(draw(st.sets(st.sampled_from(["kvm", "big"]), max_size=1))),
                needs_fetch=draw(st.booleans()),
                projects=frozenset({draw(st.sampled_from(["p", "q"]))}),
            )
        )
    scores = {
        m.job_key: {w.worker_id: draw(st.integers(0, 1000)) for w in workers if draw(st.booleans())}
        for m in members
    }
    penalties = {w.worker_id: ago(60) for w in workers if draw(st.integers(0, 3)) == 0}
    c = Cluster("c", tuple(members), ago(60), same_zone=draw(st.booleans()))
    return c, Pool(
        workers={w.worker_id: w for w in workers}, idle_slots=tuple(slots), scores=scores, penalties=penalties
    )


def brute_force(c: Cluster, p: Pool) -> int | None:
    """The cheapest full placement by trying every assignment, or None: the reference for the matcher."""
    index = PoolIndex(p, NOW)
    idle = idle_available(index)
    members = sorted(c.members, key=lambda m: (m.role, m.index))
    best: int | None = None
    for chosen in itertools.permutations(index.ids, len(members)):
        workers = [p.workers[w] for w in chosen]
        if c.same_zone and len({w.zone_key for w in workers}) > 1:
            continue
        ok = all(
            idle[m.kind] >> index.position[w.worker_id] & 1 and can_seat(m, w)
            for m, w in zip(members, workers, strict=True)
        )
        if ok:
            cost = sum(
                index.seat_cost(m, index.position[w.worker_id]) for m, w in zip(members, workers, strict=True)
            )
            best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_a_placement_never_seats_two_members_on_one_worker(scenario: tuple[Cluster, Pool]) -> None:
    c, p = scenario
    result = match_cluster(c, p, NOW)
    if isinstance(result, Placement):
        workers = [s.worker_id for s in result.seats]
        assert len(workers) == len(set(workers)) == len(c.members)


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_every_seat_satisfies_its_members_pin_kind_and_capabilities(scenario: tuple[Cluster, Pool]) -> None:
    c, p = scenario
    result = match_cluster(c, p, NOW)
    if isinstance(result, Placement):
        by_address = {m.address: m for m in c.members}
        fresh = {(s.worker_id, s.kind) for s in p.idle_slots if (NOW - s.recorded_at).total_seconds() <= 25}
        for seat in result.seats:
            member, w = by_address[seat.address], p.workers[seat.worker_id]
            assert seat.kind == member.kind and (seat.worker_id, member.kind) in fresh
            assert member.pin in (None, w.name)
            assert can_seat(member, w)


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_same_zone_placements_are_single_zone(scenario: tuple[Cluster, Pool]) -> None:
    c, p = scenario
    result = match_cluster(c, p, NOW)
    if isinstance(result, Placement) and c.same_zone:
        zones = {p.workers[s.worker_id].zone_key for s in result.seats}
        assert zones == {result.zone}


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_the_matcher_finds_the_cheapest_placement_whenever_one_exists(scenario: tuple[Cluster, Pool]) -> None:
    c, p = scenario
    expected = brute_force(c, p)
    result = match_cluster(c, p, NOW)

    if expected is None:
        assert isinstance(result, WaitingReason)
    else:
        assert isinstance(result, Placement) and result.cost == expected
