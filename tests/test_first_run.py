"""What a newcomer meets on a fresh clone (issue 16): the README's createsuperuser command works, `/` and
`/api/v1/` lead somewhere, /api/docs/ needs no network, an unknown WebSocket path is a 404, every list
pages, and `make run` installs no dev extras."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import websockets.exceptions
import websockets.sync.client
from django.contrib.auth.models import User
from django.contrib.staticfiles import finders
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from tests.factories import ProjectFactory, WorkerFactory
from tests.support.processes import ROOT, base_env, database_env, http_get, manage, serve

pytestmark = pytest.mark.django_db(transaction=True)
README = (ROOT / "README.md").read_text()


def _staff() -> APIClient:
    user = User.objects.create_user("ops", password="pw-ops-12345", is_staff=True)
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")
    return c


def test_the_readmes_createsuperuser_command_works_on_a_fresh_database(tmp_path: Path) -> None:
    command = re.search(r"(DJANGO_SUPERUSER_USERNAME=.*?createsuperuser --noinput)", README, re.S)
    assert command, "the README shows how to create the first operator"
    words = shlex.split(command.group(1).replace("\\\n", " "))
    env_vars = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    env = base_env(DATABASE_URL=f"sqlite:///{tmp_path / 'fresh.sqlite3'}", REDIS_URL=None, **env_vars)
    manage(["migrate", "--noinput"], env)
    manage(["createsuperuser", "--noinput"], env)
    shell = "from django.contrib.auth.models import User; print(User.objects.get(is_superuser=True).email)"
    assert manage(["shell", "-c", shell], env).strip().splitlines()[-1] == env_vars["DJANGO_SUPERUSER_EMAIL"]


def test_the_root_leads_to_the_console() -> None:
    response = Client().get("/")
    assert response.status_code == 302 and response["Location"] == "/admin/"


def test_the_api_root_is_an_index_and_without_a_token_says_where_to_get_one() -> None:
    anonymous = APIClient().get("/api/v1/")
    assert anonymous.status_code == 401
    assert anonymous.json()["links"]["token"].endswith("/api/v1/auth/token")
    assert anonymous.json()["links"]["docs"].endswith("/api/docs/")
    index = _staff().get("/api/v1/").json()
    assert index["routes"]["evaluations"].endswith("/api/v1/evaluations")


def test_the_api_docs_load_their_assets_from_the_package_not_a_cdn() -> None:
    page = Client().get("/api/docs/").content.decode()
    sources = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert sources and not [s for s in sources if s.startswith(("http:", "https:", "//"))], sources
    assets = [s for s in sources if "drf_spectacular_sidecar" in s]
    assert any(s.endswith("swagger-ui-bundle.js") for s in assets)
    for asset in assets:
        assert finders.find(asset.removeprefix("/static/")), asset


def test_lists_page_when_asked_and_refuse_a_bad_limit() -> None:
    ProjectFactory(name="a"), ProjectFactory(name="b")
    WorkerFactory(name="w1"), WorkerFactory(name="w2")
    c = _staff()
    assert isinstance(c.get("/api/v1/projects").json(), list)  # rest.md's answer stays an array
    page = c.get("/api/v1/projects?limit=1").json()
    assert page["count"] == 2 and [p["name"] for p in page["results"]] == ["a"] and page["next"]
    page = c.get("/api/v1/workers?limit=1&offset=1").json()
    assert page["count"] == 2 and [w["name"] for w in page["results"]] == ["w2"]
    assert c.get("/api/v1/workers?limit=-1").status_code == 400
    assert set(c.get("/api/v1/evaluations").json()) == {"count", "next", "previous", "results"}


@pytest.mark.e2e
def test_a_real_serve_answers_an_unknown_websocket_path_with_404_and_serves_the_docs_assets(
    tmp_path: Path,
) -> None:
    with serve(database_env(redis=False), tmp_path, extra_args=["--no-passes"]) as server:
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            websockets.sync.client.connect(f"ws://127.0.0.1:{server.port}/nope", open_timeout=10)
        assert refused.value.response.status_code == 404
        page = http_get(f"{server.base_url}/api/docs/")[1].decode()
        bundle = re.search(r'src="([^"]*swagger-ui-bundle\.js)"', page)
        assert bundle and http_get(f"{server.base_url}{bundle.group(1)}")[0] == 200
        assert "Traceback" not in server.log()


def test_make_run_installs_the_service_without_the_dev_extras(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    dry = subprocess.run(
        ["make", "-n", "run", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "pip install -q -e ." in dry and "[dev]" not in dry
    dry = subprocess.run(
        ["make", "-n", "check", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "'.[dev]'" in dry
    assert "make demo PORT=" in README
