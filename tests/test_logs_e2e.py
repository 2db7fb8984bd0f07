"""Build logs end to end: real `serve` processes and reference workers on loopback.

Through two `serve` processes on one PostgreSQL, a sim worker connected to one streams a build's log
that is read, live, through the other, and complete (and sealed) afterwards. With the real Nix, a
succeeding build's log holds its builder's output, readable while the builder still runs, and a
failing derivation's log holds what its builder printed on stdout and stderr.
"""

from __future__ import annotations

import urllib.error
import urllib.request
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from gradient.scheduling.models import BuildLog, BuildStatus, DerivationBuild, Evaluation, EvaluationStatus
from gradient.scheduling.services.logs import build_log_seal_pass
from tests.support.nix import nix_config, requires_nix, write_flake
from tests.support.processes import (
    ServeProcess,
    base_env,
    database_env,
    http_json,
    reference_worker,
    serve,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

FAST = ["--heartbeat-secs", "1", "--idle-request-secs", "0.5", "--cpu-core-score", "800"]


def _operator(server: ServeProcess, project: str) -> str:
    User.objects.create_user("operator", password="operator-pw", is_staff=True)
    _, body = http_json(
        "POST", f"{server.base_url}/api/v1/auth/token", {"username": "operator", "password": "operator-pw"}
    )
    token = str(body["token"])
    status, answer = http_json("POST", f"{server.base_url}/api/v1/projects", {"name": project}, token)
    assert status == 201, answer
    return token


def _post(server: ServeProcess, path: str, body: dict[str, Any], token: str) -> dict[str, Any]:
    status, answer = http_json("POST", f"{server.base_url}{path}", body, token)
    assert status == 201, answer
    return dict(answer)


def _log(server: ServeProcess, build_id: str, token: str, query: str = "") -> tuple[int, str, Any]:
    request = urllib.request.Request(f"{server.base_url}/api/v1/builds/{build_id}/log{query}")  # noqa: S310
    request.add_header("Authorization", f"Token {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 (loopback only)
            return response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), exc.headers


def _build_named(name: str) -> DerivationBuild | None:
    return DerivationBuild.objects.filter(drv_path__contains=name).first()


def test_a_log_written_through_one_serve_is_read_live_through_the_other(tmp_path: Path) -> None:
    env = database_env()
    with ExitStack() as stack:
        a = stack.enter_context(serve(env, tmp_path, extra_args=["--no-passes"]))
        b = stack.enter_context(serve(env, tmp_path, extra_args=["--no-passes"]))
        token = _operator(a, "logs")
        registered = _post(a, "/api/v1/workers", {"name": "sim-1", "projects": ["logs"]}, token)
        worker = stack.enter_context(
            reference_worker(
                a.ws_url,
                str(registered["id"]),
                str(registered["token"]),
                tmp_path,
                name="sim-1",
                extra_args=[*FAST, "--sim-build-ms", "100"],
            )
        )
        evaluation = _post(
            a,
            "/api/v1/evaluations",
            {"project": "logs", "repository": "sim:chain?n=1&duration_ms=6000", "commit": "c1"},
            token,
        )
        build = wait_until(
            lambda: DerivationBuild.objects.filter(status=BuildStatus.BUILDING).first(),
            timeout=60,
            what="the build to start",
        )

        def live() -> tuple[int, str, Any] | None:
            found = _log(b, str(build.id), token)
            return found if found[0] == 200 and "compiling" not in found[1] else None

        try:
            status, text, headers = wait_until(live, timeout=20, what="the live log through the other serve")
        except AssertionError:
            print(worker.log()[-4000:], a.log()[-4000:], sep="\n")
            raise
        assert text.startswith(f"building '{build.drv_path}'...\n")
        assert headers["X-Log-Complete"] == "false"
        assert DerivationBuild.objects.get(id=build.id).status == BuildStatus.BUILDING

        wait_until(
            lambda: Evaluation.objects.get(id=evaluation["id"]).status == EvaluationStatus.COMPLETED,
            timeout=60,
            what="the evaluation to complete",
        )
        status, whole, headers = _log(b, str(build.id), token)
        assert status == 200 and headers["X-Log-Complete"] == "true"
        assert whole.startswith(text) and "compiling" in whole and "installing" in whole
        assert build_log_seal_pass(now=timezone.now()) == 1  # the pass, as Celery beat would run it
        assert BuildLog.objects.get(build=build).sealed_at is not None
        assert _log(a, str(build.id), token)[1] == whole
        assert _log(b, str(build.id), token, f"?offset={len(text)}")[1] == whole[len(text) :]
        status, detail = http_json("GET", f"{b.base_url}/api/v1/builds/{build.id}", token=token)
        assert detail["log_url"] == f"/api/v1/builds/{build.id}/log"


LOUD_FLAKE = """
{
  outputs = { self }:
    let
      system = "x86_64-linux";
      step = name: script: builtins.derivation {
        inherit name system;
        salt = "%(salt)s";
        builder = "/bin/sh";
        args = [ "-c" script ];
      };
    in
    {
      packages.${system}.%(name)s = step "%(name)s" ''%(script)s'';
    };
}
"""


LOUD = """
          echo "configuring loud on stdout"
          echo "warning: loud talks on stderr" >&2
          /bin/sleep 4
          echo "loud is done"
          echo loud > $out
"""
BROKEN = """
          echo "checking the answer"
          echo "error: the answer is not 42" >&2
          exit 1
"""


@requires_nix
def test_with_the_real_nix_a_builds_log_holds_what_its_builder_printed(tmp_path: Path) -> None:
    env = database_env()
    salt = uuid.uuid4().hex  # fresh derivations: nothing of an earlier run is valid in the store already
    flakes = {
        name: write_flake(tmp_path / name, LOUD_FLAKE % {"salt": salt, "name": name, "script": script})
        for name, script in (("loud", LOUD), ("broken", BROKEN))
    }
    with ExitStack() as stack:
        server = stack.enter_context(serve(env, tmp_path, extra_args=["--no-passes"]))
        token = _operator(server, "flakes")
        registered = _post(server, "/api/v1/workers", {"name": "nix-1", "projects": ["flakes"]}, token)
        worker = stack.enter_context(
            reference_worker(
                server.ws_url,
                str(registered["id"]),
                str(registered["token"]),
                tmp_path,
                name="nix-1",
                executor="nix",
                extra_args=[*FAST, "--slots", "2"],
                env=base_env(NIX_CONFIG=nix_config()),
            )
        )
        evaluations = {
            name: _post(
                server, "/api/v1/evaluations", {"project": "flakes", "repository": str(d), "commit": r}, token
            )["id"]
            for name, (d, r) in flakes.items()
        }
        loud = wait_until(lambda: _build_named("-loud.drv"), timeout=90, what="the loud build")

        def live() -> tuple[int, str, Any] | None:
            found = _log(server, str(loud.id), token)
            return found if found[0] == 200 and "configuring loud" in found[1] else None

        try:
            _, text, headers = wait_until(live, timeout=60, what="the loud builder's first lines")
        except AssertionError:
            print(worker.log()[-6000:], server.log()[-4000:], sep="\n")
            raise
        if "loud is done" not in text:  # the builder still sleeps: the log is live
            assert headers["X-Log-Complete"] == "false"

        wait_until(
            lambda: (
                Evaluation.objects.get(id=evaluations["loud"]).status == EvaluationStatus.COMPLETED
                and Evaluation.objects.get(id=evaluations["broken"]).status == EvaluationStatus.FAILED
            ),
            timeout=120,
            what="loud to complete and broken to fail",
        )
        status, whole, headers = _log(server, str(loud.id), token)
        assert status == 200 and headers["X-Log-Complete"] == "true"
        assert whole == "configuring loud on stdout\nwarning: loud talks on stderr\nloud is done\n"

        broken = _build_named("-broken.drv")
        assert broken is not None and broken.status == BuildStatus.FAILED_PERMANENT
        status, failed_log, _ = _log(server, str(broken.id), token)
        assert status == 200
        assert "checking the answer\n" in failed_log and "error: the answer is not 42\n" in failed_log
        _, detail = http_json("GET", f"{server.base_url}/api/v1/builds/{broken.id}", token=token)
        assert "the answer is not 42" in detail["last_error"] and detail["log_url"]
