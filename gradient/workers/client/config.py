"""The reference worker's settings: command-line flags, each with a GRADIENT_WORKER_* variable.

A flag wins over its variable; a list setting takes commas or spaces (`--arch x86_64-linux,i686-linux`)
and may be repeated. An empty list override is allowed (`GRADIENT_WORKER_SYSTEM_FEATURES=`): an
override must list every system and feature the worker should accept.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gradient.core.protocol import MAX_FRAME_BYTES, JobKindName
from gradient.workers.client.parts import PART_BUDGET_BYTES
from gradient.workers.executors import EXECUTORS


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class WorkerConfig:
    server: str
    worker_id: str
    token: str
    executor: str = "nix"
    architectures: list[str] | None = None  # None: the executor's detected defaults
    system_features: list[str] | None = None
    max_concurrent_builds: int = 1
    max_concurrent_evals: int = 1
    fetch: bool = True
    eval: bool = True
    build: bool = True
    zone: str | None = None
    endpoint: str | None = None
    cpu_core_score: int | None = None  # None: a startup micro-benchmark
    heartbeat_secs: float = 10.0
    idle_request_secs: float = 10.0
    stop_grace_secs: float = 5.0
    reconnect_max_secs: float = 30.0
    sim_store: list[str] | None = None
    sim_build_ms: int = 100
    log_level: str = "INFO"
    eval_part_bytes: int = PART_BUDGET_BYTES  # an eval_result larger than this goes in parts
    known_query: bool = True  # ask the server which derivations it knows before walking their closures

    @property
    def job_kinds(self) -> list[JobKindName]:
        """The RequestJob kinds this worker asks for."""
        kinds: list[JobKindName] = []
        if (self.eval or self.fetch) and self.max_concurrent_evals > 0:
            kinds.append("flake")
        if self.build and self.max_concurrent_builds > 0:
            kinds.append("build")
        return kinds


def _split(values: Sequence[str]) -> list[str]:
    return [item for value in values for item in value.replace(",", " ").split()]


# flag dest -> environment variable
ENVIRONMENT = {
    "server": "GRADIENT_WORKER_SERVER",
    "worker_id": "GRADIENT_WORKER_ID",
    "token": "GRADIENT_WORKER_TOKEN",
    "token_file": "GRADIENT_WORKER_TOKEN_FILE",
    "executor": "GRADIENT_WORKER_EXECUTOR",
    "arch": "GRADIENT_WORKER_SYSTEM_ARCHITECTURES",
    "features": "GRADIENT_WORKER_SYSTEM_FEATURES",
    "slots": "GRADIENT_WORKER_BUILD_MAX_CONCURRENT",
    "eval_slots": "GRADIENT_WORKER_EVAL_MAX_CONCURRENT",
    "capabilities": "GRADIENT_WORKER_CAPABILITIES",
    "eval_only": "GRADIENT_WORKER_EVAL_ONLY",
    "zone": "GRADIENT_WORKER_ZONE",
    "endpoint": "GRADIENT_WORKER_ENDPOINT",
    "cpu_core_score": "GRADIENT_WORKER_SYSTEM_CPU_CORE_SCORE",
    "heartbeat_secs": "GRADIENT_WORKER_HEARTBEAT_SECS",
    "idle_request_secs": "GRADIENT_WORKER_IDLE_REQUEST_SECS",
    "stop_grace_secs": "GRADIENT_WORKER_STOP_GRACE_SECS",
    "sim_store": "GRADIENT_WORKER_SIM_STORE",
    "sim_build_ms": "GRADIENT_WORKER_SIM_BUILD_MS",
    "log_level": "GRADIENT_WORKER_LOG_LEVEL",
    "eval_part_bytes": "GRADIENT_WORKER_EVAL_PART_BYTES",
    "no_known_query": "GRADIENT_WORKER_NO_KNOWN_QUERY",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gradient.workers.client",
        description="Gradient's reference worker: connects to a server's /proto and runs its jobs.",
        epilog="Every flag can also be set with the GRADIENT_WORKER_* variable named in its help.",
    )

    def env(dest: str) -> str:
        return f"[{ENVIRONMENT[dest]}]"

    p.add_argument("--server", help=f"the server's WebSocket, e.g. ws://127.0.0.1:8000/proto {env('server')}")
    p.add_argument(
        "--worker-id", dest="worker_id", help=f"the worker's id from registration {env('worker_id')}"
    )
    p.add_argument("--token", help=f"the worker's token {env('token')}")
    p.add_argument(
        "--token-file", dest="token_file", help=f"read the token from this file {env('token_file')}"
    )
    p.add_argument("--executor", choices=EXECUTORS, help=f"sim or nix (default nix) {env('executor')}")
    p.add_argument("--arch", action="append", help=f"Nix systems to build (default: this host) {env('arch')}")
    p.add_argument(
        "--features", action="append", help=f"system features (default: the executor's) {env('features')}"
    )
    p.add_argument("--slots", type=int, help=f"concurrent builds (default 1) {env('slots')}")
    p.add_argument(
        "--eval-slots",
        dest="eval_slots",
        type=int,
        help=f"concurrent evaluations (default 1) {env('eval_slots')}",
    )
    p.add_argument("--capabilities", help=f"of fetch,eval,build (default all three) {env('capabilities')}")
    p.add_argument(
        "--eval-only",
        dest="eval_only",
        action="store_const",
        const="1",
        help=f"an evaluation-only worker: eval, no fetch, no build {env('eval_only')}",
    )
    p.add_argument("--zone", help=f"locality label for cluster placement {env('zone')}")
    p.add_argument("--endpoint", help=f"this worker's address in a cluster roster {env('endpoint')}")
    p.add_argument(
        "--cpu-core-score",
        dest="cpu_core_score",
        type=int,
        help=f"skip the startup benchmark {env('cpu_core_score')}",
    )
    p.add_argument(
        "--heartbeat-secs",
        dest="heartbeat_secs",
        type=float,
        help=f"metrics heartbeat (default 10) {env('heartbeat_secs')}",
    )
    p.add_argument(
        "--idle-request-secs",
        dest="idle_request_secs",
        type=float,
        help=f"repeat RequestJob while idle (default 10) {env('idle_request_secs')}",
    )
    p.add_argument(
        "--eval-part-bytes",
        dest="eval_part_bytes",
        type=int,
        help=f"the largest eval_result frame; a larger result goes in parts (default {PART_BUDGET_BYTES}, "
        f"at most 1 MiB) {env('eval_part_bytes')}",
    )
    p.add_argument(
        "--no-known-query",
        dest="no_known_query",
        action="store_const",
        const="1",
        help="send every derivation of a result instead of asking the server which it knows "
        f"(QueryKnownDerivations) and naming those in known_drvs {env('no_known_query')}",
    )
    p.add_argument(
        "--stop-grace-secs",
        dest="stop_grace_secs",
        type=float,
        help=f"wait for canceled jobs' reports on SIGTERM (default 5) {env('stop_grace_secs')}",
    )
    p.add_argument(
        "--sim-store", dest="sim_store", help=f"sim: a file of store paths already present {env('sim_store')}"
    )
    p.add_argument(
        "--sim-build-ms",
        dest="sim_build_ms",
        type=int,
        help=f"sim: default build time (default 100) {env('sim_build_ms')}",
    )
    p.add_argument("--log-level", dest="log_level", help=f"default INFO {env('log_level')}")
    return p


def forget_secrets(environ: MutableMapping[str, str]) -> None:
    """Once the configuration is read, the token leaves the process environment: no child (a nix
    process, git, a builder) inherits it, whatever environment it is given; and this process's own
    (os.environ) no longer shows it in /proc (blank_initial_variable)."""
    name = ENVIRONMENT["token"]
    if environ is os.environ:
        blank_initial_variable(name)
    environ.pop(name, None)


def blank_initial_variable(name: str) -> None:
    """Overwrite the value of `name` with NULs where the process's environment started. Unsetting a
    variable only drops it from the C library's list: Linux keeps showing the environment a process
    started with in /proc/<pid>/environ, which every process of the same user reads (a builder that runs
    without Nix's sandbox runs as the worker's user, and its log is the submitter's to read: issue 36,
    finding 1). Call before unsetting it. Elsewhere than Linux, or without the C library, nothing."""
    if sys.platform != "linux":
        return
    try:
        environ = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.CDLL(None), "environ")
    except (OSError, ValueError):
        return
    prefix = name.encode() + b"="
    i = 0
    while (address := environ[i]) is not None:
        entry = ctypes.string_at(address)
        if entry.startswith(prefix):
            ctypes.memset(address + len(prefix), 0, len(entry) - len(prefix))
        i += 1


def _bool(raw: str) -> bool:
    return raw.strip().lower() in {"1", "true", "yes", "on"}


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> WorkerConfig:
    """Flags over GRADIENT_WORKER_* variables over defaults; ConfigError names what is missing or bad."""
    environ = os.environ if environ is None else environ
    args = vars(build_parser().parse_args(argv))

    def get(dest: str) -> str | None:
        value = args.get(dest)
        if value is not None:
            return ",".join(value) if isinstance(value, list) else str(value)
        return environ.get(ENVIRONMENT[dest])

    def number(dest: str, kind: type[int] | type[float], default: float) -> float:
        raw = get(dest)
        if raw is None or raw.strip() == "":
            return default
        try:
            value = kind(raw)
        except ValueError:
            raise ConfigError(f"{dest.replace('_', '-')} must be a number, got {raw!r}") from None
        if value < 0:
            raise ConfigError(f"{dest.replace('_', '-')} must not be negative")
        return value

    server, worker_id = get("server"), get("worker_id")
    token = get("token")
    token_file = get("token_file")
    if not token and token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the token file: {exc}") from None
    missing = [n for n, v in (("--server", server), ("--worker-id", worker_id), ("--token", token)) if not v]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)} (or their GRADIENT_WORKER_* variables)")
    assert server and worker_id and token

    executor = get("executor") or "nix"
    if executor not in EXECUTORS:
        raise ConfigError(f"unknown executor {executor!r}")
    arch, features = get("arch"), get("features")

    capabilities = {"fetch", "eval", "build"}
    raw_caps = get("capabilities")
    if raw_caps is not None:
        capabilities = set(_split([raw_caps]))
        unknown = capabilities - {"fetch", "eval", "build"}
        if unknown:
            raise ConfigError(f"unknown capabilities: {', '.join(sorted(unknown))}")
    eval_only = get("eval_only")
    if eval_only is not None and _bool(eval_only):
        capabilities = {"eval"}

    sim_store = None
    sim_store_file = get("sim_store")
    if sim_store_file:
        try:
            text = Path(sim_store_file).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the sim store file: {exc}") from None
        sim_store = _split([text])

    return WorkerConfig(
        server=server,
        worker_id=worker_id,
        token=token,
        executor=executor,
        architectures=_split([arch]) if arch is not None else None,
        system_features=_split([features]) if features is not None else None,
        max_concurrent_builds=int(number("slots", int, 1)),
        max_concurrent_evals=int(number("eval_slots", int, 1)),
        fetch="fetch" in capabilities,
        eval="eval" in capabilities,
        build="build" in capabilities,
        zone=get("zone") or None,
        endpoint=get("endpoint") or None,
        cpu_core_score=int(number("cpu_core_score", int, -1)) if get("cpu_core_score") else None,
        heartbeat_secs=max(0.1, number("heartbeat_secs", float, 10.0)),
        idle_request_secs=max(0.1, number("idle_request_secs", float, 10.0)),
        stop_grace_secs=number("stop_grace_secs", float, 5.0),
        sim_store=sim_store,
        sim_build_ms=int(number("sim_build_ms", int, 100)),
        log_level=(get("log_level") or "INFO").upper(),
        eval_part_bytes=min(
            MAX_FRAME_BYTES, max(4096, int(number("eval_part_bytes", int, PART_BUDGET_BYTES)))
        ),
        known_query=not _bool(get("no_known_query") or ""),
    )
