"""The sim executor: deterministic graphs from sim: URLs, stable store paths, builds with configured
duration and failure, a simulated store, and the cluster members' signal exchange."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradient.core.protocol import (
    BuildFailureKind,
    BuildProgress,
    BuildSpec,
    CachedSource,
    ClusterAddress,
    ClusterMembership,
    ClusterPeer,
    ClusterSignalDelivery,
    EvalProgress,
    OutputPath,
    RepositorySource,
)
from gradient.workers.executors import ExecutorUnavailable, make_executor
from gradient.workers.executors.base import ExecutorFailure, JobContext
from gradient.workers.executors.sim import (
    NIX_BASE32,
    SimExecutor,
    SimUrlError,
    escape_name,
    graph_from_url,
    nix_hash,
    parse_store_name,
    source_store_path,
    unescape_name,
    url_of_source,
)


class Ctx(JobContext):
    """A job context whose signals go to a shared mailbox (a stand-in for the server's forwarding)."""

    def __init__(
        self,
        assignment_id: str = "a1",
        cluster: ClusterMembership | None = None,
        roster: list[ClusterPeer] | None = None,
        mailboxes: dict[tuple[str, int], asyncio.Queue[ClusterSignalDelivery]] | None = None,
    ) -> None:
        self.job_id = "build:x"
        self.assignment_id = assignment_id
        self.cluster = cluster
        self.roster = roster or []
        self.mailboxes = mailboxes or {}
        self.sent: list[tuple[str, ClusterAddress | None]] = []

    async def progress(self, message: BuildProgress | EvalProgress) -> None:
        pass

    async def send_signal(self, payload: str, to: ClusterAddress | None = None) -> None:
        assert self.cluster is not None
        self.sent.append((payload, to))
        me = ClusterAddress(role=self.cluster.role, index=self.cluster.index)
        for address, box in self.mailboxes.items():
            if address != (me.role, me.index) and (to is None or address == (to.role, to.index)):
                box.put_nowait(ClusterSignalDelivery(attempt=self.cluster.attempt, from_=me, payload=payload))

    async def receive_signal(self, wait_secs: float) -> ClusterSignalDelivery | None:
        assert self.cluster is not None
        try:
            return await asyncio.wait_for(
                self.mailboxes[(self.cluster.role, self.cluster.index)].get(), wait_secs
            )
        except TimeoutError:
            return None


def _spec(drv_path: str, outputs: list[OutputPath], timeout_secs: int = 0) -> BuildSpec:
    return BuildSpec(
        build_id="b", drv_path=drv_path, outputs=outputs, timeout_secs=timeout_secs, max_silent_secs=0
    )


def test_a_chain_is_a_line_of_dependencies_with_the_attr_on_its_top() -> None:
    graph = graph_from_url("sim:chain?n=3")
    derivations = graph.discovered(list(graph.attrs()))

    assert [d.drv_path.split("-", 1)[1] for d in derivations] == ["chain-0.drv", "chain-1.drv", "chain-2.drv"]
    assert [d.attr for d in derivations] == [None, None, "packages.x86_64-linux.chain-2"]
    assert derivations[0].input_drvs == [] and derivations[1].input_drvs == [derivations[0].drv_path]
    assert derivations[2].input_drvs == [derivations[1].drv_path]
    assert all(d.system == "x86_64-linux" and d.required_features == [] for d in derivations)
    assert [o.name for o in derivations[0].outputs] == ["out"]


def test_a_diamond_shares_its_base_and_wide_is_independent_builds() -> None:
    diamond = graph_from_url("sim:diamond")
    [top] = [d for d in diamond.discovered(list(diamond.attrs())) if d.attr]
    assert len(top.input_drvs) == 2
    assert len(diamond.discovered(list(diamond.attrs()))) == 4

    wide = graph_from_url("sim:wide?n=40&system=aarch64-linux&features=kvm,big-parallel")
    derivations = wide.discovered(list(wide.attrs()))
    assert len(derivations) == 40 and all(d.input_drvs == [] and d.attr for d in derivations)
    assert {d.system for d in derivations} == {"aarch64-linux"}
    assert derivations[0].required_features == ["kvm", "big-parallel"]


def test_store_paths_are_stable_and_look_like_nix_store_paths() -> None:
    first = graph_from_url("sim:diamond").discovered(["packages.x86_64-linux.diamond-top"])
    again = graph_from_url("sim:diamond").discovered(["packages.x86_64-linux.diamond-top"])
    salted = graph_from_url("sim:diamond?salt=2").discovered(["packages.x86_64-linux.diamond-top"])

    assert first == again
    assert {d.drv_path for d in first}.isdisjoint({d.drv_path for d in salted})
    for d in first:
        digest = d.drv_path.removeprefix("/nix/store/").split("-", 1)[0]
        assert len(digest) == 32 and set(digest) <= set(NIX_BASE32) and d.drv_path.endswith(".drv")
        assert d.outputs[0].path.startswith("/nix/store/") and not d.outputs[0].path.endswith(".drv")


def test_cached_derivations_report_their_outputs_with_nar_sizes() -> None:
    graph = graph_from_url("sim:chain?n=2&cached=chain-0")
    base, top = graph.discovered(list(graph.attrs()))
    assert [c.path for c in base.cached_outputs] == [base.outputs[0].path]
    assert base.cached_outputs[0].nar_size > 0 and top.cached_outputs == []


def test_a_graph_file_is_read_and_its_top_levels_get_attrs(tmp_path: Path) -> None:
    path = tmp_path / "graph.json"
    path.write_text(
        json.dumps(
            {
                "derivations": [
                    {"name": "app", "inputs": ["lib"], "outputs": ["out", "doc"], "features": ["kvm"]},
                    {"name": "lib", "system": "aarch64-linux"},
                    {"name": "tool"},
                ],
                "warnings": ["careful"],
            }
        )
    )
    graph = graph_from_url(f"sim:{path}")
    derivations = {d.drv_path.split("-", 1)[1]: d for d in graph.discovered(list(graph.attrs()))}

    assert set(graph.attrs()) == {"packages.x86_64-linux.app", "packages.x86_64-linux.tool"}
    assert list(derivations)[0] == "lib.drv"  # dependencies first
    assert derivations["app.drv"].required_features == ["kvm"]
    assert [o.name for o in derivations["app.drv"].outputs] == ["out", "doc"]
    assert derivations["lib.drv"].system == "aarch64-linux"
    assert graph.warnings == ["careful"]


@pytest.mark.parametrize(
    "url",
    [
        "sim:spiral",
        "sim:chain?n=x",
        "sim:chain?fail=nope",
        "sim:chain?fail_kind=odd",
        "git+https://x",
        "sim:/no/such.json",
    ],
)
def test_a_bad_sim_url_is_refused_with_a_reason(url: str) -> None:
    with pytest.raises(SimUrlError):
        graph_from_url(url)


def test_a_graph_file_with_a_cycle_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cycle.json"
    path.write_text(
        json.dumps({"derivations": [{"name": "a", "inputs": ["b"]}, {"name": "b", "inputs": ["a"]}]})
    )
    with pytest.raises(SimUrlError, match="cycle"):
        graph_from_url(f"sim:{path}")


def test_build_behaviour_is_written_into_the_store_name() -> None:
    graph = graph_from_url("sim:chain?n=2&duration_ms=250&fail=chain-1&fail_kind=transient")
    assert parse_store_name(graph.drv_path("chain-0")) == ("chain-0", 250, None)
    assert parse_store_name(graph.drv_path("chain-1")) == ("chain-1", 250, "transient")
    assert parse_store_name("/nix/store/" + "a" * 32 + "-hello-2.12.drv") == ("hello-2.12", None, None)


@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126)))
def test_escaping_a_url_into_a_store_name_round_trips(text: str) -> None:
    name = escape_name(text)
    assert unescape_name(name) == text
    assert all(c.isalnum() or c in "+-._?=" for c in name)


@given(st.lists(st.text(max_size=20), max_size=4))
def test_the_hash_is_32_base32_characters_and_deterministic(parts: list[str]) -> None:
    digest = nix_hash(*parts)
    assert len(digest) == 32 and set(digest) <= set(NIX_BASE32) and digest == nix_hash(*parts)


async def test_fetch_produces_a_source_path_that_names_its_url() -> None:
    executor = SimExecutor()
    path = await executor.fetch(RepositorySource(url="sim:wide?n=4", commit="c1"), Ctx())

    assert path == source_store_path("sim:wide?n=4", "c1") and url_of_source(path) == "sim:wide?n=4"
    assert await executor.present_paths([path, "/nix/store/other"]) == {path}
    evaluation = await executor.evaluate_flake(path, ["packages.*.wide-1*"], Ctx())
    assert evaluation.attrs == ["packages.x86_64-linux.wide-1"]


async def test_fetching_anything_but_a_sim_url_fails_permanently_and_fetch_fail_transiently() -> None:
    executor = SimExecutor()
    with pytest.raises(ExecutorFailure) as permanent:
        await executor.fetch(RepositorySource(url="https://github.com/x/y", commit="c"), Ctx())
    with pytest.raises(ExecutorFailure) as transient:
        await executor.fetch(RepositorySource(url="sim:chain?fetch_fail=network", commit="c"), Ctx())
    assert permanent.value.kind == BuildFailureKind.PERMANENT
    assert transient.value.kind == BuildFailureKind.TRANSIENT
    cached = await executor.fetch(CachedSource(store_path="/nix/store/abc-source"), Ctx())
    assert cached == "/nix/store/abc-source"


async def test_evaluation_reports_warnings_errors_and_can_fail() -> None:
    executor = SimExecutor()
    flake = "sim:chain?n=2&warn=deprecated&eval_error=attr%20broken"
    attrs = (await executor.evaluate_flake(flake, [], Ctx())).attrs
    result = await executor.evaluate_derivations(flake, attrs, Ctx())
    assert (
        len(result.derivations) == 2
        and result.warnings == ["deprecated"]
        and result.errors == ["attr broken"]
    )

    with pytest.raises(ExecutorFailure) as failed:
        await executor.evaluate_flake("sim:chain?eval_fail=syntax", [], Ctx())
    assert failed.value.kind == BuildFailureKind.PERMANENT and "syntax" in failed.value.error


async def test_a_build_adds_its_outputs_to_the_store_and_a_marked_failure_fails() -> None:
    executor = SimExecutor(build_ms=0)
    graph = graph_from_url("sim:chain?n=2&fail=chain-1")
    base, top = graph.discovered(list(graph.attrs()))

    result = await executor.build(_spec(base.drv_path, base.outputs), Ctx())
    with pytest.raises(ExecutorFailure) as failed:
        await executor.build(_spec(top.drv_path, top.outputs), Ctx())

    assert [o.path for o in result.outputs] == [base.outputs[0].path] and result.outputs[0].nar_size > 0
    assert await executor.present_paths([base.outputs[0].path, top.outputs[0].path]) == {base.outputs[0].path}
    assert failed.value.kind == BuildFailureKind.PERMANENT
    assert executor.built == [base.drv_path]


async def test_a_build_longer_than_its_timeout_fails_with_timeout() -> None:
    executor = SimExecutor(speed=1000.0)
    drv = graph_from_url("sim:chain?n=1&duration_ms=5000").drv_path("chain-0")
    with pytest.raises(ExecutorFailure) as failed:
        await executor.build(_spec(drv, [], timeout_secs=1), Ctx())
    assert failed.value.kind == BuildFailureKind.TIMEOUT


async def test_cluster_members_greet_each_other_before_they_build() -> None:
    roster = [ClusterPeer(role="node", index=i, worker_id=f"w{i}") for i in range(3)]
    mailboxes: dict[tuple[str, int], asyncio.Queue[ClusterSignalDelivery]] = {
        ("node", i): asyncio.Queue() for i in range(3)
    }
    executors = [SimExecutor(build_ms=0) for _ in range(3)]
    contexts = [
        Ctx(
            assignment_id=f"a{i}",
            cluster=ClusterMembership(attempt="t", role="node", index=i, hold_secs=40),
            roster=roster,
            mailboxes=mailboxes,
        )
        for i in range(3)
    ]
    drv = graph_from_url("sim:chain?n=1").drv_path("chain-0")

    await asyncio.gather(*(e.build(_spec(drv, []), c) for e, c in zip(executors, contexts, strict=True)))

    assert [c.sent for c in contexts] == [[(f"hello from node[{i}]", None)] for i in range(3)]


async def test_a_cluster_member_whose_peers_stay_silent_fails_transiently() -> None:
    roster = [ClusterPeer(role="node", index=i, worker_id=f"w{i}") for i in range(2)]
    ctx = Ctx(
        cluster=ClusterMembership(attempt="t", role="node", index=0, hold_secs=40),
        roster=roster,
        mailboxes={("node", 0): asyncio.Queue()},
    )
    executor = SimExecutor(build_ms=0, cluster_signal_timeout=0.1)
    with pytest.raises(ExecutorFailure) as failed:
        await executor.build(_spec(graph_from_url("sim:chain?n=1").drv_path("chain-0"), []), ctx)
    assert failed.value.kind == BuildFailureKind.TRANSIENT and "node[1]" in failed.value.error


def test_make_executor_names_the_sim_executor_and_refuses_an_unknown_one() -> None:
    with pytest.raises(ExecutorUnavailable, match="choose one of sim, nix"):
        make_executor("guix")
    assert isinstance(make_executor("sim", sim_store=["/nix/store/x"]), SimExecutor)
