"""End to end with the real Nix: a real `serve`, reference workers with `--executor nix` on this
machine's local store, and the example flakes (examples/flakes, /bin/sh builders) as fresh git
repositories.

Two x86_64 workers bring the diamond to Completed (real outputs in /nix/store, each derivation built
once, after its inputs) while the failing flake's evaluation fails with its builder's words kept,
readable over REST; a worker whose architectures are overridden to aarch64-linux (its Nix told
`extra-platforms = aarch64-linux`) and an x86_64 one split the multi-system flake's builds by system;
an evaluation cancelled over REST while Nix builds stops the builder (AbortJob kills Nix's group).
"""

from __future__ import annotations

import os
import re
import uuid
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User

from gradient.examples import example_repository
from gradient.scheduling.models import (
    BuildAttempt,
    BuildAttemptOutcome,
    BuildStatus,
    CachedPath,
    DerivationBuild,
    DerivationBuildDependency,
    DispatchedJob,
    Evaluation,
    EvaluationBuild,
    EvaluationStatus,
)
from tests.support.nix import nix_config, requires_nix, write_flake
from tests.support.processes import (
    ServeProcess,
    WorkerProcess,
    base_env,
    database_env,
    http_json,
    reference_worker,
    serve,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), requires_nix]

FAST = ["--heartbeat-secs", "1", "--idle-request-secs", "0.5", "--cpu-core-score", "800"]
# The worker's own log line for each derivation Nix starts building (gradient.worker.nix).
BUILDING = re.compile(r"^(\S+ \S+) INFO gradient\.worker\.nix: nix: building (/nix/store/\S+\.drv)$", re.M)


@pytest.fixture
def service_env() -> dict[str, str]:
    return database_env()


def _post(server: ServeProcess, path: str, body: dict[str, Any], token: str) -> dict[str, Any]:
    status, answer = http_json("POST", f"{server.base_url}{path}", body, token)
    assert status == 201, answer
    return dict(answer)


def _get(server: ServeProcess, path: str, token: str) -> dict[str, Any]:
    status, answer = http_json("GET", f"{server.base_url}{path}", token=token)
    assert status == 200, answer
    return dict(answer)


def _operator(server: ServeProcess) -> str:
    User.objects.create_user("operator", password="operator-pw", is_staff=True)
    _, body = http_json(
        "POST", f"{server.base_url}/api/v1/auth/token", {"username": "operator", "password": "operator-pw"}
    )
    token = str(body["token"])
    _post(server, "/api/v1/projects", {"name": "flakes"}, token)
    return token


def _nix_worker(
    stack: ExitStack, server: ServeProcess, token: str, tmp_path: Path, name: str, *extra: str, nix: str = ""
) -> WorkerProcess:
    registered = _post(server, "/api/v1/workers", {"name": name, "projects": ["flakes"]}, token)
    return stack.enter_context(
        reference_worker(
            server.ws_url,
            str(registered["id"]),
            str(registered["token"]),
            tmp_path,
            name=name,
            executor="nix",
            extra_args=[*FAST, *extra],
            env=base_env(NIX_CONFIG=nix_config(*([nix] if nix else []))),
        )
    )


def _wait_for(
    server: ServeProcess, workers: list[WorkerProcess], ids: dict[str, str], wanted: dict[str, str]
) -> None:
    def done() -> bool:
        rows = Evaluation.objects.filter(id__in=ids.values()).values_list("id", "status")
        statuses = {str(evaluation_id): status for evaluation_id, status in rows}
        return all(statuses[ids[name]] == status for name, status in wanted.items())

    try:
        wait_until(done, timeout=120, what=f"evaluations to reach {wanted}")
    except AssertionError:
        print(*(f"--- {w.name}\n{w.log()[-5000:]}" for w in workers), server.log()[-6000:], sep="\n")
        print(list(Evaluation.objects.values("repository", "status", "errors")))
        raise


def _build_starts(workers: list[WorkerProcess]) -> list[tuple[datetime, str, str]]:
    """(time, worker, drv) for every derivation any worker's Nix started building."""
    return [
        (datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f"), w.name, drv)
        for w in workers
        for stamp, drv in BUILDING.findall(w.log())
    ]


def test_two_nix_workers_build_a_diamond_in_dependency_order_and_a_failing_build_fails_its_evaluation(
    tmp_path: Path, service_env: dict[str, str]
) -> None:
    diamond, diamond_rev = example_repository("diamond", tmp_path)
    failing, failing_rev = example_repository("failing", tmp_path)
    with ExitStack() as stack:
        server = stack.enter_context(serve(service_env, tmp_path, extra_args=["--no-passes"]))
        token = _operator(server)
        workers = [_nix_worker(stack, server, token, tmp_path, f"nix-{i}") for i in range(2)]
        ids = {
            name: str(
                _post(
                    server,
                    "/api/v1/evaluations",
                    {"project": "flakes", "repository": str(directory), "commit": rev},
                    token,
                )["id"]
            )
            for name, directory, rev in (("diamond", diamond, diamond_rev), ("failing", failing, failing_rev))
        }
        _wait_for(
            server, workers, ids, {"diamond": EvaluationStatus.COMPLETED, "failing": EvaluationStatus.FAILED}
        )

        # The failing evaluation says which build failed, and the build keeps the builder's words.
        failed = _get(server, f"/api/v1/evaluations/{ids['failing']}", token)
        assert failed["status"] == "Failed"
        builds = {b["drv_path"].split("-", 1)[1].removesuffix(".drv"): b for b in failed["builds"]}
        assert {n: b["status"] for n, b in builds.items()} == {
            "fine": BuildStatus.COMPLETED,
            "broken": BuildStatus.FAILED_PERMANENT,
            "after-broken": BuildStatus.DEPENDENCY_FAILED,
        }
        assert f"{builds['broken']['drv_path']}: FailedPermanent" in failed["errors"]
        broken = _get(server, f"/api/v1/builds/{builds['broken']['id']}", token)
        assert broken["failure_kind"] == "permanent"
        assert "builder for" in broken["last_error"] and "failed with exit code 1" in broken["last_error"]
        assert "> error: the answer is not 42" in broken["last_error"]

    # The diamond: every build Completed with real outputs in the store, their NAR sizes cached.
    evaluation = Evaluation.objects.get(id=ids["diamond"])
    assert re.fullmatch(r"/nix/store/[a-z0-9]{32}-source", evaluation.flake_source)
    diamond_builds = {
        b.drv_path: b for b in DerivationBuild.objects.filter(evaluation_links__evaluation=evaluation)
    }
    assert len(diamond_builds) == 4
    assert {b.status for b in diamond_builds.values()} == {BuildStatus.COMPLETED}
    outputs = {o["path"] for b in diamond_builds.values() for o in b.outputs}
    assert all(Path(p).is_file() for p in outputs)
    assert dict(CachedPath.objects.filter(path__in=outputs).values_list("path", "nar_size")).keys() == outputs
    assert all(
        size > 0 for size in CachedPath.objects.filter(path__in=outputs).values_list("nar_size", flat=True)
    )
    top = next(b for b in diamond_builds.values() if b.drv_path.endswith("-diamond-top.drv"))
    assert Path(top.outputs[0]["path"]).read_text().split() == [
        "diamond-top",
        "diamond-left",
        "diamond-base",
        "diamond-right",
        "diamond-base",
    ]

    # Each derivation was built once, by the worker it was handed to, after its inputs were built.
    starts = _build_starts(workers)
    built = [drv for _, _, drv in starts]
    assert sorted(built) == sorted(
        b.drv_path for b in DerivationBuild.objects.exclude(status=BuildStatus.DEPENDENCY_FAILED)
    )
    assert not any("Nix also built" in w.log() for w in workers)
    started = {drv: (when, name) for when, name, drv in starts}
    attempts = BuildAttempt.objects.select_related("build", "worker")
    for attempt in attempts:
        assert started[attempt.build.drv_path][1] == attempt.worker.name
    finished = {a.build.drv_path: a.finished_at for a in attempts}
    edges = DerivationBuildDependency.objects.select_related("build", "dependency")
    assert edges.count() == 6  # diamond 4, failing 2
    for edge in edges:
        if edge.build.status == BuildStatus.DEPENDENCY_FAILED:
            continue
        dependent = BuildAttempt.objects.get(build=edge.build)
        assert dependent.started_at >= finished[edge.dependency.drv_path], edge
        # And Nix itself started the dependent's builder after the dependency's.
        assert started[edge.build.drv_path][0] > started[edge.dependency.drv_path][0], edge


def test_an_aarch64_worker_and_an_x86_64_worker_split_the_builds_by_system(
    tmp_path: Path, service_env: dict[str, str]
) -> None:
    flake, rev = example_repository("multi-system", tmp_path)
    with ExitStack() as stack:
        server = stack.enter_context(serve(service_env, tmp_path, extra_args=["--no-passes"]))
        token = _operator(server)
        # Nix builds only its own system and extra platforms: the aarch64 worker's Nix is told it may
        # build aarch64-linux (the builders are /bin/sh of this x86_64 host).
        arm = _nix_worker(
            stack,
            server,
            token,
            tmp_path,
            "arm",
            "--arch",
            "aarch64-linux",
            nix="extra-platforms = aarch64-linux",
        )
        x86 = _nix_worker(stack, server, token, tmp_path, "x86")
        evaluation_id = str(
            _post(
                server,
                "/api/v1/evaluations",
                {"project": "flakes", "repository": str(flake), "commit": rev, "wildcards": ["packages.*.*"]},
                token,
            )["id"]
        )
        _wait_for(server, [arm, x86], {"multi": evaluation_id}, {"multi": EvaluationStatus.COMPLETED})
        workers = {
            w["name"]: w for w in http_json("GET", f"{server.base_url}/api/v1/workers", token=token)[1]
        }

    # The x86 worker's architectures are its Nix's own (system and extra platforms), not aarch64.
    assert workers["arm"]["architectures"] == ["aarch64-linux"]
    assert "x86_64-linux" in workers["x86"]["architectures"]
    assert "aarch64-linux" not in workers["x86"]["architectures"]
    builds = DerivationBuild.objects.filter(evaluation_links__evaluation_id=evaluation_id)
    assert sorted(builds.values_list("system", flat=True)) == ["aarch64-linux"] * 2 + ["x86_64-linux"] * 2
    by_system: dict[str, set[str]] = {}
    for system, worker in DispatchedJob.objects.filter(derivation_build__in=builds).values_list(
        "derivation_build__system", "worker__name"
    ):
        by_system.setdefault(system, set()).add(worker)
    assert by_system == {"aarch64-linux": {"arm"}, "x86_64-linux": {"x86"}}
    for build in builds:
        assert build.status == BuildStatus.COMPLETED
        text = Path(build.outputs[0]["path"]).read_text()
        assert text.startswith(("tool for " if "-tool-" in build.drv_path else "app for ") + build.system)
    # Nix really built each on the worker it was handed to.
    starts = {drv: name for _, name, drv in _build_starts([arm, x86])}
    assert starts == {b.drv_path: ("arm" if b.system == "aarch64-linux" else "x86") for b in builds}


def _processes_with(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(int(pid))
    return found


def test_cancelling_an_evaluation_stops_the_nix_build_it_runs(
    tmp_path: Path, service_env: dict[str, str]
) -> None:
    seconds = f"60.{uuid.uuid4().int % 10**6:06d}"  # a unique sleep: the builder, found in /proc
    flake, rev = write_flake(
        tmp_path / "slow",
        """{
          outputs = { self }: {
            packages.x86_64-linux.slow = builtins.derivation {
              name = "slow"; system = "x86_64-linux"; builder = "/bin/sh";
              args = [ "-c" "echo sleeping; /bin/sleep @SECONDS@; echo > $out" ];
            };
          };
        }""".replace("@SECONDS@", seconds),
    )
    with ExitStack() as stack:
        server = stack.enter_context(serve(service_env, tmp_path, extra_args=["--no-passes"]))
        token = _operator(server)
        worker = _nix_worker(stack, server, token, tmp_path, "nix-0")
        evaluation_id = str(
            _post(
                server,
                "/api/v1/evaluations",
                {"project": "flakes", "repository": str(flake), "commit": rev},
                token,
            )["id"]
        )
        wait_until(
            lambda: _processes_with(f"sleep {seconds}"),
            timeout=60,
            what="the builder to start\n" + worker.log()[-3000:],
        )
        status, _ = http_json(
            "POST", f"{server.base_url}/api/v1/evaluations/{evaluation_id}/cancel", token=token
        )
        assert status == 202
        wait_until(
            lambda: not _processes_with(f"sleep {seconds}"), timeout=30, what="the builder to be stopped"
        )
        wait_until(
            lambda: BuildAttempt.objects.filter(
                outcome=BuildAttemptOutcome.ABORTED, finished_at__isnull=False
            ).exists(),
            timeout=30,
            what="the attempt to end Aborted\n" + worker.log()[-3000:],
        )
        assert Evaluation.objects.get(id=evaluation_id).status == EvaluationStatus.ABORTED
        (build,) = DerivationBuild.objects.all()
        assert build.status == BuildStatus.ABORTED
        assert not any(Path(o["path"]).exists() for o in build.outputs)
        assert "JobFailed build:" in worker.log()


# A generated flake of BASE + TOP derivations, each its own package: the base ones stand alone, each top
# one needs a base one and an earlier top one. The base is built beforehand with one `nix build`, so
# the evaluation reports their outputs valid (cached_outputs; being packages themselves, they are still
# part of the result, where the executor would leave out the inputs of a valid derivation), and the top
# goes through Gradient.
LARGE_FLAKE = """{
  outputs = { self }: let
    system = "x86_64-linux";
    mk = name: deps: builtins.derivation {
      inherit name system; builder = "/bin/sh"; salt = "@SALT@";
      args = [ "-c" "echo ${name} ${toString deps} > $out" ];
    };
    n = @BASE@;
    base = builtins.genList (i: mk "base-${toString i}" [ ]) n;
    top = builtins.genList (j: mk "top-${toString j}" ([ (builtins.elemAt base (n - 1 - j)) ]
      ++ (if j == 0 then [ ] else [ (builtins.elemAt top (j / 2)) ]))) @TOP@;
  in {
    packages.${system} = builtins.listToAttrs (
      builtins.genList (i: { name = "base-${toString i}"; value = builtins.elemAt base i; }) n
      ++ builtins.genList (j: { name = "top-${toString j}"; value = builtins.elemAt top j; }) @TOP@);
    legacyPackages.${system}.base = builtins.derivation {
      name = "base-all"; inherit system; builder = "/bin/sh"; salt = "@SALT@";
      deps = base; passAsFile = [ "deps" ]; args = [ "-c" "read -r x < $depsPath; echo $x > $out" ];
    };
  };
}"""


def test_a_generated_flake_of_three_thousand_derivations_is_sent_in_parts_and_built_to_completion(
    tmp_path: Path, service_env: dict[str, str]
) -> None:
    """And (issue 30) a re-evaluation of a commit that adds one derivation sends only what changed: the
    worker asks which top-level derivations the server knows and names those in known_drvs."""
    import subprocess

    from gradient.scheduling.models import EvalIngest

    base, top = 2990, 20
    salt = uuid.uuid4().hex
    flake, rev = write_flake(
        tmp_path / "large",
        LARGE_FLAKE.replace("@SALT@", salt).replace("@BASE@", str(base)).replace("@TOP@", str(top)),
    )
    subprocess.run(
        ["nix", "build", "--no-link", "--max-jobs", "4", f"{flake}#legacyPackages.x86_64-linux.base"],
        env={**os.environ, "NIX_CONFIG": nix_config()},
        check=True,
        capture_output=True,
        timeout=600,
    )
    with ExitStack() as stack:
        server = stack.enter_context(serve(service_env, tmp_path, extra_args=["--no-passes"]))
        token = _operator(server)
        worker = _nix_worker(
            stack, server, token, tmp_path, "nix-0", "--slots", "4", "--eval-part-bytes", "262144"
        )

        def evaluate(commit: str) -> str:
            body = {"project": "flakes", "repository": str(flake), "commit": commit}
            return str(_post(server, "/api/v1/evaluations", body, token)["id"])

        evaluation_id = evaluate(rev)
        _wait_for(server, [worker], {"large": evaluation_id}, {"large": EvaluationStatus.COMPLETED})
        # One more top-level derivation (top-20: it needs base-2969 and top-10, which need more).
        _, changed = write_flake(
            flake,
            LARGE_FLAKE.replace("@SALT@", salt).replace("@BASE@", str(base)).replace("@TOP@", str(top + 1)),
        )
        again = evaluate(changed)
        _wait_for(server, [worker], {"again": again}, {"again": EvaluationStatus.COMPLETED})
    reevaluated = EvalIngest.objects.get(evaluation_id=again)
    # Sent: top-20 and the closure the worker walked for it (top-10, -5, -2, -1, -0 and their base
    # inputs), not the 3 010 known ones.
    assert 0 < reevaluated.derivations <= 12
    assert EvaluationBuild.objects.filter(evaluation_id=again).count() == base + top + 1
    assert DerivationBuild.objects.count() == base + top + 1
    assert DerivationBuild.objects.get(drv_path__contains="-top-20.drv").status == BuildStatus.COMPLETED
    ingest = EvalIngest.objects.get(evaluation_id=evaluation_id)
    assert ingest.parts > 1 and ingest.derivations == base + top and ingest.decided_at is not None
    # top-j needs its base one and top-(j/2).
    assert DerivationBuildDependency.objects.count() == (top + 1) + top
    statuses = dict(DerivationBuild.objects.values_list("drv_path", "status"))
    assert {s for p, s in statuses.items() if "-base-" in p} == {BuildStatus.SUBSTITUTED}
    assert {s for p, s in statuses.items() if "-top-" in p} == {BuildStatus.COMPLETED}
    built = [b for b in DerivationBuild.objects.filter(status=BuildStatus.COMPLETED)]
    assert len(built) == top + 1 and all(Path(o["path"]).exists() for b in built for o in b.outputs)
