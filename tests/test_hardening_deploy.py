"""The deploy checklist (issue 17, finding 12): without DJANGO_SECRET_KEY, `serve` outside the embedded
mode refuses any address but loopback instead of signing with the public development key; a TLS
deployment's settings (secure cookies, HSTS, the HTTPS redirect) are environment variables, and with
them `check --deploy` has none of W004, W008, W009, W012, W016."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import ROOT, base_env, database_env, free_port

pytestmark = pytest.mark.django_db

WARNINGS = ("security.W004", "security.W008", "security.W009", "security.W012", "security.W016")


def _check_deploy(env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.stdout + result.stderr


def test_a_tls_deployment_passes_check_deploy_without_those_warnings() -> None:
    env = base_env(
        DJANGO_SECRET_KEY="x7!Vq2#pL9@wZ4$hN8^kR3&mT6*yB1(eD5)gF0-jS" * 2,
        GRADIENT_SECURE_COOKIES="1",
        GRADIENT_HSTS_SECONDS="31536000",
        GRADIENT_SSL_REDIRECT="1",
    )
    out = _check_deploy(env)
    assert not [w for w in WARNINGS if w in out], out


def test_without_those_settings_check_deploy_still_says_so() -> None:
    out = _check_deploy(base_env(DJANGO_SECRET_KEY=None))
    assert all(w in out for w in WARNINGS), out


def _serve(env: dict[str, str], host: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    log = open(tmp_path / f"serve-{host}.log", "wb")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--host", host, "--port", str(free_port()), "--no-passes"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


# DEBUG is no exception (issue 36, finding 5): with DJANGO_DEBUG=1 serve listened anywhere, silently.
@pytest.mark.parametrize("debug", [None, "1"])
def test_serve_without_a_secret_key_refuses_to_listen_beyond_loopback(
    tmp_path: Path, debug: str | None
) -> None:
    env = database_env(redis=False, DJANGO_SECRET_KEY=None, DJANGO_DEBUG=debug)
    process = _serve(env, "0.0.0.0", tmp_path)  # noqa: S104 (that is the point)
    try:
        assert process.wait(60) != 0
    finally:
        if process.poll() is None:
            process.kill()
    log = (tmp_path / "serve-0.0.0.0.log").read_text()
    assert "DJANGO_SECRET_KEY is not set" in log and "Traceback" not in log


def test_serve_with_a_secret_key_listens_anywhere(tmp_path: Path) -> None:
    from gradient.deploy import refuse_insecure_start

    with pytest.MonkeyPatch.context() as mp:
        from django.conf import settings

        mp.setattr(settings, "USING_DEVELOPMENT_SECRET_KEY", False)
        assert refuse_insecure_start(host="0.0.0.0") is None  # noqa: S104
        mp.setattr(settings, "USING_DEVELOPMENT_SECRET_KEY", True)
        mp.setattr(settings, "EMBEDDED", False)
        mp.setattr(settings, "DEBUG", False)
        assert "loopback only" in str(refuse_insecure_start(host="127.0.0.1"))
        assert "loopback only" in str(refuse_insecure_start(host="::1"))


# The embedded mode (a fresh checkout's SQLite, `make run HOST=0.0.0.0`) may listen anywhere with the
# development key, but not without a word, DEBUG or not (issue 36, finding 5): on loopback it says nothing.
@pytest.mark.parametrize("debug", [False, True])
def test_the_embedded_mode_beyond_loopback_with_the_development_key_says_so_loudly(debug: bool) -> None:
    from django.conf import settings

    from gradient.deploy import refuse_insecure_start

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settings, "USING_DEVELOPMENT_SECRET_KEY", True)
        mp.setattr(settings, "EMBEDDED", True)
        mp.setattr(settings, "DEBUG", debug)
        warning = str(refuse_insecure_start(host="0.0.0.0"))  # noqa: S104
        assert "WARNING" in warning and "0.0.0.0" in warning and "public" in warning, warning
        assert "DJANGO_SECRET_KEY" in warning
        assert refuse_insecure_start(host="127.0.0.1") is None
        assert refuse_insecure_start(host="localhost") is None
