"""The nix executor: its pure pieces (flake references, wildcards, Nix's JSON and log stream, failure
kinds) as table and property tests, and the executor itself against the real Nix of this machine
(fetch, evaluate, build, fail, time out, abort, score), skipped when Nix is missing."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradient.core.protocol import (
    BuildFailureKind,
    BuildProgress,
    BuildSpec,
    CachedOutput,
    CachedSource,
    ClusterAddress,
    ClusterSignalDelivery,
    EvalProgress,
    JobCandidate,
    OutputPath,
    RepositorySource,
    RequiredPath,
)
from gradient.examples import example_repository
from gradient.workers.client.scoring import paths_to_check, score_candidates
from gradient.workers.executors import make_executor
from gradient.workers.executors.base import ExecutorFailure, ExecutorUnavailable, JobContext
from gradient.workers.executors.nix import NixExecutor
from gradient.workers.executors.nix_parse import (
    NIX_ENVIRONMENT_NAMES,
    NixBuildLog,
    NixInputError,
    classify_build_failure,
    default_wildcards,
    dependency_order,
    discovered_derivations,
    flake_ref,
    format_attr_path,
    glob_to_regex,
    nar_sizes_from_path_info,
    required_features_of,
    settings_from_show_config,
    split_attr_path,
    wildcard_patterns,
    with_executor_config,
)
from tests.support.nix import nix_environ, requires_nix, write_flake

REV = "0123456789abcdef0123456789abcdef01234567"


# --- flake references ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "commit", "expected"),
    [
        ("git+file:///srv/repo", REV, f"git+file:///srv/repo?rev={REV}&allRefs=1"),
        ("git+file:///srv/repo", "", "git+file:///srv/repo"),
        ("git+file:///srv/repo", "HEAD", "git+file:///srv/repo"),
        ("git+file:///srv/repo", "release-1", "git+file:///srv/repo?ref=release-1"),
        ("git+file:///srv/repo?dir=sub", REV, f"git+file:///srv/repo?dir=sub&rev={REV}&allRefs=1"),
        (f"git+file:///srv/repo?rev={REV}", "f" * 40, f"git+file:///srv/repo?rev={REV}"),
        ("github:owner/repo", REV, f"github:owner/repo?rev={REV}"),
        ("path:/srv/flake", REV, "path:/srv/flake"),
        ("/nix/store/x-source", "", "/nix/store/x-source"),
    ],
)
def test_a_repository_url_at_a_commit_becomes_a_flake_reference(url: str, commit: str, expected: str) -> None:
    assert flake_ref(url, commit) == expected


def test_a_sim_or_empty_url_is_refused_with_a_reason() -> None:
    with pytest.raises(NixInputError, match="--executor sim"):
        flake_ref("sim:chain", REV)
    with pytest.raises(NixInputError, match="empty"):
        flake_ref("  ", REV)


def test_a_local_directory_is_a_git_flake_when_it_is_a_work_tree(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    assert NixExecutor.repository_ref(str(plain), REV) == f"path:{plain}"
    (plain / ".git").mkdir()
    assert NixExecutor.repository_ref(str(plain), REV) == f"git+file://{plain}?rev={REV}&allRefs=1"
    with pytest.raises(NixInputError, match="not a directory"):
        NixExecutor.repository_ref(str(tmp_path / "missing"), REV)


def test_the_executor_adds_only_the_experimental_features_to_the_operators_config() -> None:
    assert with_executor_config(None) == "extra-experimental-features = nix-command flakes\n"
    assert with_executor_config("sandbox = false\n") == (
        "sandbox = false\nextra-experimental-features = nix-command flakes\n"
    )


# --- attributes and wildcards -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "segments"),
    [
        ("packages.x86_64-linux.hello", ["packages", "x86_64-linux", "hello"]),
        ('packages.x86_64-linux."a.b"', ["packages", "x86_64-linux", "a.b"]),
        ('checks."x\\"y".z', ["checks", 'x"y', "z"]),
        ("packages.*.*", ["packages", "*", "*"]),
    ],
)
def test_attribute_paths_split_on_dots_outside_quotes(text: str, segments: list[str]) -> None:
    assert split_attr_path(text) == segments


@pytest.mark.parametrize("bad", ["", "a..b", ".a", "a.", 'a."b'])
def test_a_malformed_attribute_path_is_refused(bad: str) -> None:
    with pytest.raises(NixInputError):
        split_attr_path(bad)


@given(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=5))
def test_formatting_an_attribute_path_round_trips(segments: list[str]) -> None:
    assert split_attr_path(format_attr_path(segments)) == segments


@pytest.mark.parametrize(
    ("glob", "matches", "misses"),
    [
        ("*", ["hello", "x86_64-linux", ""], []),
        ("hello-*", ["hello-world", "hello-"], ["hello", "say-hello-x"]),
        ("x86_64-?inux", ["x86_64-linux"], ["x86_64-darwin"]),
        ("a.b+c", ["a.b+c"], ["axb+c", "a.bbc"]),
    ],
)
def test_a_glob_matches_whole_attribute_names(glob: str, matches: list[str], misses: list[str]) -> None:
    regex = re.compile(glob_to_regex(glob))  # ERE of this subset reads the same in Python
    assert all(regex.fullmatch(name) for name in matches)
    assert not any(regex.fullmatch(name) for name in misses)


def test_no_wildcards_select_the_packages_and_checks_of_the_workers_system() -> None:
    assert default_wildcards("x86_64-linux") == ["packages.x86_64-linux.*", "checks.x86_64-linux.*"]
    assert wildcard_patterns(["", " "], "aarch64-linux") == [
        ["packages", "aarch64-linux", ".*"],
        ["checks", "aarch64-linux", ".*"],
    ]
    assert wildcard_patterns(["packages.*.default"], "x86_64-linux") == [["packages", ".*", "default"]]


# --- what Nix says ----------------------------------------------------------------------------------------


def test_settings_come_from_show_config_values() -> None:
    settings = settings_from_show_config(
        {
            "system": {"value": "x86_64-linux"},
            "extra-platforms": {"value": ["i686-linux", "aarch64-linux"]},
            "system-features": {"value": ["kvm", "big-parallel"]},
        }
    )
    assert settings.platforms == ["x86_64-linux", "i686-linux", "aarch64-linux"]
    assert settings.system_features == ("kvm", "big-parallel")
    assert settings_from_show_config({"system": "aarch64-linux", "extra-platforms": ""}).platforms == [
        "aarch64-linux"
    ]
    with pytest.raises(ValueError, match="no system"):
        settings_from_show_config({})


def _drv(name: str, inputs: list[str], *, system: str = "x86_64-linux", **env: str) -> dict[str, object]:
    return {
        "outputs": {"out": {"path": f"/nix/store/{name}-out"}, "dev": {"path": f"/nix/store/{name}-dev"}},
        "inputDrvs": {i: ["out"] for i in inputs},
        "system": system,
        "env": env,
    }


def test_show_derivation_becomes_discovered_derivations_dependencies_first() -> None:
    show = {
        "/nix/store/t.drv": _drv("t", ["/nix/store/l.drv", "/nix/store/r.drv"], requiredSystemFeatures="kvm"),
        "/nix/store/r.drv": _drv("r", ["/nix/store/b.drv"]),
        "/nix/store/l.drv": _drv(
            "l", ["/nix/store/b.drv"], __json=json.dumps({"requiredSystemFeatures": ["x"]})
        ),
        "/nix/store/b.drv": _drv("b", [], system="aarch64-linux"),
    }
    found = discovered_derivations(
        show, {"/nix/store/t.drv": "packages.x86_64-linux.top"}, {"/nix/store/b-out": 1234}
    )
    order = [d.drv_path for d in found]
    assert order.index("/nix/store/b.drv") < order.index("/nix/store/l.drv") < order.index("/nix/store/t.drv")
    assert order.index("/nix/store/r.drv") < order.index("/nix/store/t.drv")
    top = found[-1]
    assert top.attr == "packages.x86_64-linux.top" and top.required_features == ["kvm"]
    assert top.input_drvs == ["/nix/store/l.drv", "/nix/store/r.drv"]
    assert [o.name for o in top.outputs] == ["out", "dev"]
    base = found[0]
    assert base.system == "aarch64-linux" and base.attr is None
    assert base.cached_outputs == [CachedOutput(path="/nix/store/b-out", nar_size=1234)]
    assert required_features_of(show["/nix/store/l.drv"]) == ["x"]


@given(st.dictionaries(st.integers(0, 12), st.sets(st.integers(0, 12), max_size=4), max_size=12))
def test_dependency_order_puts_every_input_first(edges: dict[int, set[int]]) -> None:
    # Keep it acyclic: a derivation only needs smaller numbers.
    show = {
        f"/nix/store/{n}.drv": {"inputDrvs": {f"/nix/store/{i}.drv": ["out"] for i in deps if i < n}}
        for n, deps in edges.items()
    }
    order = dependency_order(show)
    assert sorted(order) == sorted(show)
    position = {p: i for i, p in enumerate(order)}
    for path, drv in show.items():
        for dep in drv["inputDrvs"]:
            if dep in position:
                assert position[dep] < position[path]


def test_path_info_keeps_valid_paths_and_their_nar_sizes() -> None:
    answer = [
        {"path": "/nix/store/a", "narSize": 120, "valid": True},
        {"path": "/nix/store/b", "valid": False},
        {"path": "/nix/store/c", "narSize": 7},
    ]
    assert nar_sizes_from_path_info(answer) == {"/nix/store/a": 120, "/nix/store/c": 7}
    assert nar_sizes_from_path_info({"/nix/store/d": {"path": "/nix/store/d", "narSize": 1}}) == {
        "/nix/store/d": 1
    }


# --- the build log and failures ------------------------------------------------------------------------

DRV = "/nix/store/vqa1jpnz9ykr8fiym4dy3xr561bbl9i6-broken.drv"


def _events(*events: dict[str, object]) -> list[str]:
    return ["@nix " + json.dumps(e) for e in events]


def _failed_build_log() -> NixBuildLog:
    build_log = NixBuildLog()
    for line in _events(
        {"action": "start", "id": 7, "type": 105, "fields": [DRV, "", 1, 1], "text": f"building '{DRV}'"},
        {"action": "result", "id": 7, "type": 101, "fields": ["checking the answer"]},
        {"action": "result", "id": 7, "type": 101, "fields": ["error: the answer is not 42"]},
        {"action": "start", "id": 8, "type": 101, "fields": ["https://cache/x.nar"]},
        {"action": "result", "id": 8, "type": 105, "fields": [512, 2048, 0, 0]},
        {
            "action": "msg",
            "level": 0,
            "msg": f"\x1b[31;1merror:\x1b[0m builder for '\x1b[35;1m{DRV}\x1b[0m' failed with exit code 1",
        },
    ):
        build_log.feed(line)
    return build_log


def test_the_build_log_follows_builds_lines_downloads_and_errors() -> None:
    build_log = NixBuildLog()
    kinds = []
    for line in [
        *_events(
            {"action": "start", "id": 7, "type": 105, "fields": [DRV, "", 1, 1], "text": "building"},
            {"action": "result", "id": 7, "type": 101, "fields": ["hello"]},
            {"action": "start", "id": 8, "type": 101, "fields": ["https://cache/x.nar"]},
            {"action": "result", "id": 8, "type": 105, "fields": [512, 2048, 0, 0]},
        ),
        "not json at all",
        "@nix {broken",
    ]:
        kinds.extend((e.kind, e.text, e.drv_path, e.bytes_done, e.bytes_total) for e in build_log.feed(line))
    assert kinds == [
        ("building", "building", DRV, 0, None),
        ("log", "hello", DRV, 0, None),
        ("download", "", None, 512, 2048),
        ("message", "not json at all", None, 0, None),
    ]
    assert build_log.built == [DRV] and build_log.tail(DRV) == ["hello"]


@pytest.mark.parametrize(
    ("returncode", "kind"),
    [
        (100, BuildFailureKind.PERMANENT),  # the builder exited non-zero
        (102, BuildFailureKind.PERMANENT),  # hash mismatch
        (101, BuildFailureKind.TIMEOUT),  # --timeout or --max-silent-time
        (103, BuildFailureKind.TIMEOUT),
        (-15, BuildFailureKind.CANCELED),  # killed by a signal
        (1, BuildFailureKind.TRANSIENT),  # anything else
    ],
)
def test_a_failed_realisation_maps_to_a_failure_kind_and_keeps_the_builders_words(
    returncode: int, kind: BuildFailureKind
) -> None:
    failure = classify_build_failure(returncode, _failed_build_log(), DRV)
    assert failure.kind == kind
    assert failure.error.startswith(f"builder for '{DRV}' failed with exit code 1")
    assert "> checking the answer\n> error: the answer is not 42" in failure.error
    assert "\x1b" not in failure.error


def test_an_interrupted_nix_is_canceled() -> None:
    build_log = NixBuildLog()
    build_log.feed(
        "@nix " + json.dumps({"action": "msg", "level": 0, "msg": "error: interrupted by the user"})
    )
    assert classify_build_failure(1, build_log, DRV).kind == BuildFailureKind.CANCELED


# --- the executor on the real Nix ------------------------------------------------------------------------


class Ctx(JobContext):
    def __init__(self, assignment_id: str = "a1") -> None:
        self.job_id = "eval:x"
        self.assignment_id = assignment_id
        self.cluster = None
        self.roster = []
        self.reports: list[BuildProgress | EvalProgress] = []

    async def progress(self, message: BuildProgress | EvalProgress) -> None:
        self.reports.append(message)

    async def send_signal(self, payload: str, to: ClusterAddress | None = None) -> None:
        raise AssertionError("not a cluster member")

    async def receive_signal(self, wait_secs: float) -> ClusterSignalDelivery | None:
        return None


@pytest.fixture
def nix() -> NixExecutor:
    return NixExecutor.detect(nix_environ("extra-platforms = aarch64-linux"), kill_grace_secs=2.0)


def _spec(drv_path: str, outputs: list[OutputPath], timeout: int = 60, silent: int = 60) -> BuildSpec:
    return BuildSpec(
        build_id=str(uuid.uuid4()),
        drv_path=drv_path,
        outputs=outputs,
        timeout_secs=timeout,
        max_silent_secs=silent,
    )


async def _evaluate(nix: NixExecutor, directory: Path, commit: str, wildcards: list[str], ctx: Ctx):  # type: ignore[no-untyped-def]
    source = await nix.fetch(RepositorySource(url=str(directory), commit=commit), ctx)
    attrs = (await nix.evaluate_flake(source, wildcards, ctx)).attrs
    return source, attrs, await nix.evaluate_derivations(source, attrs, ctx)


@requires_nix
def test_capabilities_come_from_nix_show_config() -> None:
    executor = NixExecutor.detect(nix_environ("extra-platforms = aarch64-linux", "system-features = kvm"))
    assert executor.default_architectures()[0] == executor.settings.system
    assert "aarch64-linux" in executor.default_architectures()
    assert executor.default_system_features() == ["kvm"]
    assert executor.settings.version.startswith("nix (Nix) ")


def test_without_nix_the_executor_is_unavailable_and_says_how_to_get_it() -> None:
    with pytest.raises(ExecutorUnavailable, match="apt-get install nix-bin"):
        NixExecutor.detect({"PATH": "/nonexistent"})


@requires_nix
def test_make_executor_builds_the_nix_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIX_CONFIG", nix_environ()["NIX_CONFIG"])
    assert isinstance(make_executor("nix"), NixExecutor)


@requires_nix
async def test_a_chain_is_fetched_evaluated_and_built_in_the_real_store(
    nix: NixExecutor, tmp_path: Path
) -> None:
    directory, commit = example_repository("chain", tmp_path)
    ctx = Ctx()
    source, attrs, evaluation = await _evaluate(nix, directory, commit, [], ctx)

    assert re.fullmatch(r"/nix/store/[a-z0-9]{32}-source", source) and (Path(source) / "flake.nix").exists()
    assert attrs == ["packages.x86_64-linux.chain-c", "packages.x86_64-linux.default"]
    assert evaluation.errors == []
    names = [d.drv_path.split("-", 1)[1] for d in evaluation.derivations]
    assert names == ["chain-a.drv", "chain-b.drv", "chain-c.drv"]
    a, b, c = evaluation.derivations
    assert (a.input_drvs, b.input_drvs, c.input_drvs) == ([], [a.drv_path], [b.drv_path])
    assert c.attr == "packages.x86_64-linux.chain-c" and a.attr is None  # `default` is the same drv
    assert all(d.system == "x86_64-linux" and d.cached_outputs == [] for d in evaluation.derivations)
    assert {r.phase for r in ctx.reports} == {"fetching", "evaluating"}

    scored = [o.path for d in evaluation.derivations for o in d.outputs]
    assert await nix.present_paths([*scored, a.drv_path]) == {a.drv_path}
    for d in evaluation.derivations:
        result = await nix.build(_spec(d.drv_path, d.outputs), ctx)
        assert not result.substituted
        assert [(o.name, o.path) for o in result.outputs] == [(o.name, o.path) for o in d.outputs]
        assert all(o.nar_size > 0 for o in result.outputs)
    assert _read(c.outputs[0].path).split() == ["chain-c", "chain-b", "chain-a"]
    assert await nix.present_paths(scored) == set(scored)

    # The worker scores offers against this store: what a candidate lacks, and its NAR size.
    absent = f"/nix/store/{'1' * 32}-gradient-absent"
    offered = JobCandidate(
        job_id="build:top",
        kind="build",
        required_paths=[
            RequiredPath(path=b.outputs[0].path, nar_size=128),
            RequiredPath(path=absent, nar_size=300),
        ],
        drv_paths=[c.drv_path],
        output_paths=[c.outputs[0].path],
    )
    (score,) = score_candidates([offered], await nix.present_paths(paths_to_check([offered])))
    assert (score.missing_count, score.missing_nar_size, score.outputs_present) == (1, 300, True)

    # Evaluated again, the outputs are cached; built again, nothing runs.
    _, _, again = await _evaluate(nix, directory, commit, ["packages.*.chain-c"], ctx)
    assert [d.cached_outputs[0].path for d in again.derivations] == scored
    assert (await nix.build(_spec(c.drv_path, c.outputs), ctx)).substituted


@requires_nix
async def test_a_failing_builder_is_a_permanent_failure_with_its_own_words(
    nix: NixExecutor, tmp_path: Path
) -> None:
    directory, commit = example_repository("failing", tmp_path)
    ctx = Ctx()
    _, attrs, evaluation = await _evaluate(nix, directory, commit, [], ctx)
    by_name = {d.drv_path.split("-", 1)[1].removesuffix(".drv"): d for d in evaluation.derivations}
    assert set(by_name) == {"fine", "broken", "after-broken"}
    assert by_name["after-broken"].input_drvs == [by_name["broken"].drv_path]

    await nix.build(_spec(by_name["fine"].drv_path, by_name["fine"].outputs), ctx)
    with pytest.raises(ExecutorFailure) as failed:
        await nix.build(_spec(by_name["broken"].drv_path, by_name["broken"].outputs), ctx)
    assert failed.value.kind == BuildFailureKind.PERMANENT
    assert "failed with exit code 1" in failed.value.error
    assert "> error: the answer is not 42" in failed.value.error


@requires_nix
async def test_an_attribute_that_fails_to_evaluate_is_an_error_naming_it(
    nix: NixExecutor, tmp_path: Path
) -> None:
    directory, commit = write_flake(
        tmp_path / "broken-eval",
        """{
          outputs = { self }: {
            packages.x86_64-linux.good = builtins.derivation {
              name = "good-@SALT@"; system = "x86_64-linux"; builder = "/bin/sh";
              args = [ "-c" "echo > $out" ];
            };
            packages.x86_64-linux.bad = throw "bad is broken on purpose";
          };
        }""".replace("@SALT@", uuid.uuid4().hex[:8]),
    )
    ctx = Ctx()
    _, attrs, evaluation = await _evaluate(nix, directory, commit, [], ctx)
    assert attrs == ["packages.x86_64-linux.bad", "packages.x86_64-linux.good"]
    assert [d.attr for d in evaluation.derivations] == ["packages.x86_64-linux.good"]
    assert len(evaluation.errors) == 1
    assert evaluation.errors[0].startswith("packages.x86_64-linux.bad: ")
    assert "bad is broken on purpose" in evaluation.errors[0]


@requires_nix
async def test_a_repository_that_is_missing_or_at_an_unknown_commit_fails_the_fetch_for_good(
    nix: NixExecutor, tmp_path: Path
) -> None:
    directory, _ = example_repository("check", tmp_path)
    with pytest.raises(ExecutorFailure) as failed:
        await nix.fetch(RepositorySource(url=str(directory), commit="f" * 40), Ctx())
    assert failed.value.kind == BuildFailureKind.PERMANENT and "fetching git+file://" in failed.value.error
    with pytest.raises(ExecutorFailure) as missing:
        await nix.fetch(RepositorySource(url=str(tmp_path / "nowhere"), commit=""), Ctx())
    assert missing.value.kind == BuildFailureKind.PERMANENT and "not a directory" in missing.value.error


@requires_nix
async def test_paths_missing_from_the_store_are_unavailable_inputs(nix: NixExecutor) -> None:
    absent = f"/nix/store/{'0' * 32}-gradient-absent"
    with pytest.raises(ExecutorFailure) as source:
        await nix.fetch(CachedSource(store_path=absent), Ctx())
    assert source.value.kind == BuildFailureKind.SUBSTITUTE_UNAVAILABLE and source.value.missing_paths == [
        absent
    ]
    with pytest.raises(ExecutorFailure) as drv:
        await nix.build(_spec(absent + ".drv", []), Ctx())
    assert drv.value.kind == BuildFailureKind.INPUTS_UNAVAILABLE and drv.value.missing_paths == [
        absent + ".drv"
    ]


def _slow_flake(tmp_path: Path, marker: str, script: str) -> tuple[Path, str]:
    return write_flake(
        tmp_path / "slow",
        """{
          outputs = { self }: {
            packages.x86_64-linux.slow = builtins.derivation {
              name = "slow"; system = "x86_64-linux"; builder = "/bin/sh"; marker = "@MARKER@";
              args = [ "-c" "@SCRIPT@" ];
            };
          };
        }""".replace("@MARKER@", marker).replace("@SCRIPT@", script),
    )


def _read(path: str) -> str:
    return Path(path).read_text()


def _processes_with(text: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                found.append(int(pid))
    return found


@requires_nix
async def test_timeout_and_silence_limits_end_a_build_as_timeout(nix: NixExecutor, tmp_path: Path) -> None:
    seconds = f"30.{uuid.uuid4().int % 10**6:06d}"
    directory, commit = _slow_flake(tmp_path, seconds, f"echo started; /bin/sleep {seconds}; echo > $out")
    ctx = Ctx()
    _, _, evaluation = await _evaluate(nix, directory, commit, [], ctx)
    (slow,) = evaluation.derivations
    with pytest.raises(ExecutorFailure) as timed_out:
        await nix.build(_spec(slow.drv_path, slow.outputs, timeout=1), ctx)
    assert (
        timed_out.value.kind == BuildFailureKind.TIMEOUT
        and "timed out after 1 seconds" in timed_out.value.error
    )
    assert "> started" in timed_out.value.error
    with pytest.raises(ExecutorFailure) as silent:
        await nix.build(_spec(slow.drv_path, slow.outputs, silent=1), ctx)
    assert silent.value.kind == BuildFailureKind.TIMEOUT and "of silence" in silent.value.error
    await asyncio.sleep(0.5)
    assert _processes_with(f"sleep {seconds}") == []


@requires_nix
async def test_a_cancelled_build_stops_nix_and_its_builder(nix: NixExecutor, tmp_path: Path) -> None:
    seconds = f"31.{uuid.uuid4().int % 10**6:06d}"
    directory, commit = _slow_flake(tmp_path, seconds, f"/bin/sleep {seconds}; echo > $out")
    ctx = Ctx("abort-me")
    _, _, evaluation = await _evaluate(nix, directory, commit, [], ctx)
    (slow,) = evaluation.derivations
    task = asyncio.create_task(nix.build(_spec(slow.drv_path, slow.outputs), ctx))
    for _ in range(200):
        if _processes_with(f"sleep {seconds}"):
            break
        await asyncio.sleep(0.05)
    assert _processes_with(f"sleep {seconds}"), "the builder never started"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await nix.abort(ctx)
    await asyncio.sleep(0.3)
    assert _processes_with(f"sleep {seconds}") == []
    assert "abort-me" not in nix._running
    assert await nix.present_paths([o.path for o in slow.outputs]) == set()


# --- No secret of the worker reaches an evaluated flake (issue 36, finding 1) -------------------------

LEAKING_FLAKE = """{
  outputs = { self }: {
    packages.x86_64-linux.leak = builtins.derivation {
      name = "leak-${builtins.getEnv "GRADIENT_WORKER_TOKEN"}"; system = "x86_64-linux";
      builder = "/bin/sh"; args = [ "-c" "echo > $out" ];
    };
    packages.x86_64-linux.other = builtins.derivation {
      name = "other-${builtins.getEnv "OPERATOR_SECRET"}"; system = "x86_64-linux";
      builder = "/bin/sh"; args = [ "-c" "echo > $out" ];
    };
    packages.x86_64-linux.file = builtins.derivation {
      name = "file-${builtins.readFile @SECRET_FILE@}"; system = "x86_64-linux";
      builder = "/bin/sh"; args = [ "-c" "echo > $out" ];
    };
  };
}"""


@requires_nix
async def test_a_flake_reads_neither_the_workers_token_nor_its_environment_nor_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token, secret, in_file = (f"{name}{uuid.uuid4().hex[:12]}" for name in ("tok", "sec", "fil"))
    monkeypatch.setenv("GRADIENT_WORKER_TOKEN", token)
    monkeypatch.setenv("OPERATOR_SECRET", secret)
    secret_file = tmp_path / "secret"
    secret_file.write_text(in_file)
    nix = NixExecutor.detect(nix_environ())
    directory, commit = write_flake(
        tmp_path / "leak", LEAKING_FLAKE.replace("@SECRET_FILE@", str(secret_file))
    )

    _, attrs, evaluation = await _evaluate(nix, directory, commit, [], Ctx())

    assert attrs == [f"packages.x86_64-linux.{n}" for n in ("file", "leak", "other")]
    names = sorted(d.drv_path.split("-", 1)[1] for d in evaluation.derivations)
    assert names == ["leak-.drv", "other-.drv"]  # builtins.getEnv is "" in a pure evaluation
    (error,) = evaluation.errors
    assert error.startswith("packages.x86_64-linux.file: ") and "pure eval" in error
    said = repr(evaluation) + "".join(_read(d.drv_path) for d in evaluation.derivations)
    assert token not in said and secret not in said and in_file not in said
    # Nor does any nix child get them: its environment is allow-listed.
    assert not [k for k in nix.env if k.startswith("GRADIENT_") or k == "OPERATOR_SECRET"]
    assert nix.env["PATH"] == os.environ["PATH"] and "nix-command flakes" in nix.env["NIX_CONFIG"]


# The same without Nix: a stand-in `nix` and `nix-store` that write down how each was started (its
# arguments and its whole environment) and answer as Nix would. Every child of a fetch, an evaluation and
# a build gets the allow-listed environment, and none evaluates impure (issue 36, finding 1: every nix
# child had the worker's whole environment, GRADIENT_WORKER_TOKEN included, and `nix eval --impure`).
STAND_IN_NIX = r"""#!@PYTHON@
import json, os, sys
from pathlib import Path

here = Path(__file__).resolve().parent
with open(here / "calls.jsonl", "a") as calls:
    calls.write(json.dumps({"argv": [Path(sys.argv[0]).name, *sys.argv[1:]], "env": dict(os.environ)}) + "\n")
args = sys.argv[1:]
SRC = "/nix/store/" + "s" * 32 + "-source"
DRV = "/nix/store/" + "d" * 32 + "-leak.drv"
OUT = "/nix/store/" + "q" * 32 + "-leak"
if Path(sys.argv[0]).name == "nix-store":
    if "--realise" in args:
        print(OUT)
elif args[:1] == ["--version"]:
    print("nix (Nix) 2.18.1")
elif args[:1] == ["show-config"]:
    print(json.dumps({"system": {"value": "x86_64-linux"}}))
elif args[:2] == ["flake", "metadata"]:
    print(json.dumps({"path": SRC, "url": "path:" + SRC + "?narHash=sha256-x", "revision": "r"}))
elif args[:1] == ["path-info"]:
    print(json.dumps([{"path": p, "narSize": 1} for p in args if p.startswith("/nix/store/")]))
elif args[:1] == ["eval"]:
    request = json.loads(args[args.index("--argstr") + 2])
    if request["mode"] == "attrs":
        print(json.dumps([["packages", "x86_64-linux", "leak"]]))
    else:
        print(json.dumps([{"attr": a, "drv": DRV} for a in request["attrs"]]))
elif args[:1] == ["show-derivation"]:
    shown = {"outputs": {"out": {"path": OUT}}, "inputDrvs": {}, "system": "x86_64-linux", "env": {}}
    print(json.dumps({DRV: shown}))
else:
    sys.exit("unexpected: " + " ".join(args))
"""


def _stand_in_nix(directory: Path) -> tuple[Path, Path]:
    """A directory holding the stand-in `nix` and `nix-store`, and the file its calls are written to."""
    directory.mkdir()
    script = directory / "nix"
    script.write_text(STAND_IN_NIX.replace("@PYTHON@", sys.executable))
    script.chmod(0o755)
    (directory / "nix-store").symlink_to(script)
    return directory, directory / "calls.jsonl"


async def test_no_nix_child_gets_the_workers_token_or_environment_and_none_evaluates_impure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token, secret = (f"{name}{uuid.uuid4().hex[:12]}" for name in ("tok", "sec"))
    monkeypatch.setenv("GRADIENT_WORKER_TOKEN", token)
    monkeypatch.setenv("OPERATOR_SECRET", secret)
    bin_dir, calls = _stand_in_nix(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    directory, commit = write_flake(tmp_path / "leak", LEAKING_FLAKE)
    nix = NixExecutor.detect()  # the worker's own environment, as `make_executor` gives it
    ctx = Ctx()

    _, attrs, evaluation = await _evaluate(nix, directory, commit, [], ctx)
    (derivation,) = evaluation.derivations
    await nix.build(_spec(derivation.drv_path, derivation.outputs), ctx)

    children = [json.loads(line) for line in calls.read_text().splitlines()]
    ran = {" ".join(c["argv"][:2]) for c in children}
    assert {"nix show-config", "nix flake", "nix eval", "nix show-derivation", "nix-store --realise"} <= ran
    for child in children:
        assert "--impure" not in child["argv"], child["argv"]
        assert token not in json.dumps(child) and secret not in json.dumps(child), child["argv"]
        # Only the allow-listed names and Nix's own (LC_CTYPE: Python's locale coercion in the stand-in).
        assert {k for k in child["env"] if not k.startswith("NIX_")} <= NIX_ENVIRONMENT_NAMES | {"LC_CTYPE"}
        assert "nix-command flakes" in child["env"]["NIX_CONFIG"]
