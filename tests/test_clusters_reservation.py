"""The aging-reservation step: reserve, commit, release; one clause of Aging Reservations per test."""

from __future__ import annotations

from datetime import datetime

from gradient.clusters.decisions.planner import plan_pass
from gradient.clusters.decisions.reservation import (
    Commit,
    Release,
    ReleaseReason,
    ReservationInputs,
    ReservationPolicy,
    Reserve,
    is_reserved,
    step,
)
from gradient.clusters.decisions.types import Cluster, Member, Pool, Reservation, SlotKind
from tests.support.clusters import NOW, build, cluster, evaluation, later, pool, worker

AFTER = ReservationPolicy().reserve_after_secs
TIMEOUT = ReservationPolicy().reserve_timeout_secs


def aged(
    cid: str = "aged",
    *members: Member,
    same_zone: bool = False,
    retry_at: datetime | None = None,
    prepare_failures: int = 0,
) -> Cluster:
    """A cluster that has waited just past clusterReserveAfterSecs (two builds unless told otherwise)."""
    return cluster(
        cid,
        *(members or (build("a"), build("b"))),
        age=AFTER + 1,
        same_zone=same_zone,
        retry_at=retry_at,
        prepare_failures=prepare_failures,
    )


def reserve(c: Cluster, p: Pool, now: datetime = NOW, seated: frozenset[str] = frozenset()) -> Reservation:
    state, actions = step(None, ReservationInputs((c,), p, candidate=c.cluster_id, seated=seated), now)
    assert state is not None and actions == (Reserve(state),)
    return state


def seats(r: Reservation) -> list[str]:
    return sorted(s.worker_id for s in r.seats)


# A cluster able to start that found no simultaneously idle workers for clusterReserveAfterSecs
# reserves a placement instead.


def test_a_young_cluster_reserves_nothing() -> None:
    young = cluster("young", build("a"), build("b"), age=AFTER - 1)
    busy = pool([worker("w1"), worker("w2")], idle_build=[])

    assert step(None, ReservationInputs((young,), busy, candidate="young"), NOW) == (None, ())


def test_without_the_planners_pick_nothing_is_reserved() -> None:
    busy = pool([worker("w1"), worker("w2")], idle_build=[])

    assert step(None, ReservationInputs((aged(),), busy, candidate=None), NOW) == (None, ())


def test_an_aged_cluster_reserves_a_placement_over_every_connected_eligible_worker() -> None:
    c = aged()
    busy = pool([worker("w1"), worker("w2"), worker("arm", archs=["aarch64-linux"])], idle_build=[])

    r = reserve(c, busy)

    assert seats(r) == ["w1", "w2"]
    assert (r.created_at, r.expires_at) == (NOW, later(TIMEOUT))


def test_idle_workers_are_seated_first() -> None:
    c = aged()
    a = c.members[0]
    # The busy workers would fetch nothing; the idle one a lot. Idle still wins.
    scores = {("busy1", a.job_key): 0, ("busy2", a.job_key): 0, ("idle", a.job_key): 900 << 30}
    p = pool([worker("busy1"), worker("busy2"), worker("idle")], idle_build=["idle"], scores=scores)

    assert "idle" in seats(reserve(c, p))


def test_workers_seated_by_this_pass_count_as_busy() -> None:
    c = aged("aged", build("a"))
    p = pool([worker("just-seated"), worker("busy")], idle_build=["just-seated"])

    r = reserve(c, p, seated=frozenset({"just-seated"}))

    assert r.cluster_id == "aged" and len(r.seats) == 1


def test_an_aged_cluster_without_enough_eligible_workers_reserves_nothing() -> None:
    c = aged("aged", build("a"), build("b"), build("c"))
    p = pool([worker("w1"), worker("w2"), worker("arm", archs=["aarch64-linux"])], idle_build=[])

    assert step(None, ReservationInputs((c,), p, candidate="aged"), NOW) == (None, ())


def test_a_same_zone_reservation_stays_in_one_zone() -> None:
    c = aged("aged", build("a"), build("b"), same_zone=True)
    p = pool([worker("a1", zone="a"), worker("b1", zone="b"), worker("b2", zone="b")], idle_build=[])

    assert seats(reserve(c, p)) == ["b1", "b2"]


def test_a_pinned_member_reserves_its_pinned_worker() -> None:
    c = aged("aged", build("a"), build("b", pin="w3"))
    p = pool([worker("w1"), worker("w2"), worker("w3")], idle_build=[])

    r = reserve(c, p)

    assert next(s.worker_id for s in r.seats if s.role == "b") == "w3"


# Seats: reserved workers keep their running jobs but get no new single job of the reserved kind.


def test_a_reserved_seat_gets_no_new_single_job_of_the_reserved_kind() -> None:
    c = aged("aged", build("a"), evaluation("b"))
    r = reserve(c, pool([worker("w1"), worker("w2")], idle_build=[]))
    build_seat = next(s.worker_id for s in r.seats if s.kind == SlotKind.BUILD)
    eval_seat = next(s.worker_id for s in r.seats if s.kind == SlotKind.EVAL)

    assert is_reserved(r, build_seat, SlotKind.BUILD)
    assert is_reserved(r, eval_seat, "eval")
    assert not is_reserved(r, build_seat, SlotKind.EVAL)
    assert not is_reserved(r, "w9", SlotKind.BUILD)
    assert not is_reserved(None, build_seat, SlotKind.BUILD)


# Commit: the reservation commits like an ordinary placement once every seat is idle.


def test_a_reservation_commits_once_every_seat_is_idle() -> None:
    c = aged()
    ws = [worker("w1"), worker("w2"), worker("w3")]
    r = reserve(c, pool(ws, idle_build=[]))
    # Every seat is idle now, and so is a worker outside the reservation.
    state, actions = step(r, ReservationInputs((c,), pool(ws)), NOW)

    assert state is None
    assert len(actions) == 1 and isinstance(actions[0], Commit)
    assert sorted(actions[0].placement.worker_ids) == seats(r)
    assert actions[0].placement.cluster_id == "aged"


def test_a_reservation_waits_while_a_seat_is_busy() -> None:
    c = aged()
    ws = [worker("w1"), worker("w2")]
    r = reserve(c, pool(ws, idle_build=[]))

    assert step(r, ReservationInputs((c,), pool(ws, idle_build=["w1"])), NOW) == (r, ())


def test_a_reservation_waits_while_its_cluster_backs_off() -> None:
    c = aged()
    ws = [worker("w1"), worker("w2")]
    r = reserve(c, pool(ws, idle_build=[]))
    backing_off = aged(retry_at=later(90), prepare_failures=1)

    assert step(r, ReservationInputs((backing_off,), pool(ws)), NOW) == (r, ())


def test_a_reservation_whose_seats_no_longer_fit_is_released() -> None:
    c = aged()
    r = reserve(c, pool([worker("w1"), worker("w2")], idle_build=[]))
    changed = pool([worker("w1"), worker("w2", archs=["aarch64-linux"])])

    state, actions = step(r, ReservationInputs((c,), changed), NOW)

    assert (state, actions) == (None, (Release("aged", ReleaseReason.SEATS_UNFIT),))


# One at a time: only one cluster can hold a reservation. Other clusters plan over the unreserved
# idle workers.


def test_only_one_cluster_holds_a_reservation_at_a_time() -> None:
    first, second = aged("first"), aged("second")
    ws = [worker(f"w{i}") for i in range(4)]
    r = reserve(first, pool(ws, idle_build=[]))

    state, actions = step(
        r, ReservationInputs((first, second), pool(ws, idle_build=[]), candidate="second"), NOW
    )

    assert (state, actions) == (r, ())


def test_other_clusters_plan_over_the_unreserved_idle_workers() -> None:
    c = aged()
    ws = [worker("w1"), worker("w2"), worker("w3")]
    r = reserve(c, pool(ws, idle_build=[]))
    other = cluster("other", build("x"), age=10)

    result = plan_pass([c, other], pool(ws), later(5), reservation=r)

    free = {"w1", "w2", "w3"} - set(seats(r))
    assert [sorted(p.worker_ids) for p in result.placements] == [sorted(free)]


# Release: after clusterReserveTimeoutSecs, on a seat's worker disconnecting, or on the cluster
# leaving the queue. The next planning pass can reserve again.


def test_a_reservation_is_released_after_the_reserve_timeout() -> None:
    c = aged()
    ws = [worker("w1"), worker("w2")]
    r = reserve(c, pool(ws, idle_build=[]))

    held = step(r, ReservationInputs((c,), pool(ws, idle_build=[])), later(TIMEOUT - 1))
    released = step(r, ReservationInputs((c,), pool(ws, idle_build=[])), later(TIMEOUT))

    assert held == (r, ())
    assert released == (None, (Release("aged", ReleaseReason.TIMEOUT),))


def test_a_reservation_is_released_when_a_seats_worker_disconnects() -> None:
    c = aged()
    r = reserve(c, pool([worker("w1"), worker("w2"), worker("w3")], idle_build=[]))
    gone = seats(r)[0]
    remaining = [worker(w) for w in ("w1", "w2", "w3") if w != gone]

    assert step(r, ReservationInputs((c,), pool(remaining)), later(5)) == (
        None,
        (Release("aged", ReleaseReason.SEAT_DISCONNECTED),),
    )


def test_a_seats_worker_that_drains_releases_the_reservation() -> None:
    c = aged()
    r = reserve(c, pool([worker("w1"), worker("w2")], idle_build=[]))

    state, actions = step(
        r, ReservationInputs((c,), pool([worker("w1"), worker("w2", draining=True)])), later(5)
    )

    assert (state, actions) == (None, (Release("aged", ReleaseReason.SEAT_DISCONNECTED),))


def test_a_reservation_is_released_when_the_cluster_leaves_the_queue() -> None:
    c = aged()
    ws = [worker("w1"), worker("w2")]
    r = reserve(c, pool(ws, idle_build=[]))

    assert step(r, ReservationInputs((), pool(ws)), later(5)) == (
        None,
        (Release("aged", ReleaseReason.LEFT_QUEUE),),
    )


def test_after_a_release_the_next_pass_can_reserve_again() -> None:
    c = aged()
    ws = [worker("w1"), worker("w2")]
    r = reserve(c, pool(ws, idle_build=[]))
    released, _ = step(r, ReservationInputs((c,), pool(ws, idle_build=[])), later(TIMEOUT))

    plan = plan_pass([c], pool(ws, idle_build=[]), later(TIMEOUT), reservation=released)
    again, actions = step(
        released, ReservationInputs((c,), pool(ws, idle_build=[]), candidate=plan.reserve), later(TIMEOUT)
    )

    assert plan.reserve == "aged"
    assert again is not None and actions == (Reserve(again),)
    assert again.expires_at == later(2 * TIMEOUT)
