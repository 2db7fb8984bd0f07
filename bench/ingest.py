"""Large evaluations: an eval_result of N derivations ingested in parts through the real report path.

    .venv/bin/python bench/ingest.py [--derivations 1000 10000 150000] [--profile]

For each N: a generated nixpkgs-shaped graph (1-5 inputs per derivation, many of them on a small core
the way stdenv and its bootstrap are everyone's inputs; 20 % cached; 1-2 outputs; store paths of the
real length, in a shuffled order as Nix lists them). One evaluation is claimed by a registered worker;
the reference worker's own splitter (gradient.workers.client.parts) cuts the result into parts that fit
a frame, and each part goes through what a frame from a socket goes through after the consumer:
strict decoding (core.protocol) and the job loop's JobUpdate (jobloop.job_update: the fence, the part
stored in its own transaction; the graph decided at the final part). Then a second evaluation of the
same commit sends the same result again (the reuse: nothing new).

Printed per N: the ingest time from the first part to the graph decided (the server's: the worker's
split and encoding are done before, and printed apart), the statements sent, the peak
memory growth of this process during the ingest (RSS sampled every 10 ms, over its value before the
first part, with the generated graph already in memory), the transactions and the longest one (from its
first statement to the end of its commit: a part's report, or a slice of the decision), the parts, and
the reuse time; and the CPU time of this process (the server's Python: steadier than the wall clock on a
busy machine, and blind to PostgreSQL's own work). The last line:

    ingest: <N> derivations in <s> s = <r> of the copy limit (<c> s); reuse <s> s = <r> of the copy
    limit; known <s> s; first build queued after <s> s; peak +<MB> MB, longest transaction <s> s

--shape independent: N derivations without inputs in parts of --part-size (the outside check's shape of
issue 30, where the queueing was quadratic on a fresh table), on tables analyzed while empty. With
--socket, the same through a real `serve` and one worker's WebSocket, on a database created for the run
(BENCH_DATABASE_URL's name + "_fresh", dropped first; its tables never analyzed), timed from the final
part sent and on the server's clock. --first-part K sends a first part of K derivations before the
parts of --part-size, and --analyzed-empty analyzes the fresh database's empty tables before the serve
starts (a new installation after autovacuum's first look, whose first result is small: the plans a
connection keeps, such as a trigger's, are made then).

--profile writes a cProfile of the first ingest of the largest N to var/bench/ingest.prof and prints
its top functions.

Needs PostgreSQL (BENCH_DATABASE_URL, default postgres://postgres@127.0.0.1:5432/gradient_bench).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import describe_machine, log_dir, reset_tables, service_env, setup_django  # noqa: E402

NIX_BASE32 = "0123456789abcdfghijklmnpqrsvwxyz"
PNAMES = [
    "python3",
    "perl",
    "gcc",
    "glibc",
    "openssl",
    "zlib",
    "curl",
    "rust",
    "go",
    "node",
    "libxml2",
    "qt5",
]


def generate(n: int, seed: int = 19) -> list[Any]:
    """n DiscoveredDerivations shaped like a nixpkgs evaluation, in a shuffled order."""
    from gradient.core.protocol import CachedOutput, DiscoveredDerivation, OutputPath

    rng = random.Random(seed)
    core = max(1, n // 100)

    def store(i: int, suffix: str) -> str:
        digest = "".join(rng.choice(NIX_BASE32) for _ in range(32))
        return f"/nix/store/{digest}-{PNAMES[i % len(PNAMES)]}-{i // len(PNAMES)}.{i % 10}{suffix}"

    paths = [store(i, ".drv") for i in range(n)]
    out: list[Any] = []
    for i in range(n):
        inputs: set[str] = set()
        for _ in range(rng.randint(1, 5) if i else 0):
            j = rng.randrange(min(i, core)) if rng.random() < 0.5 else rng.randrange(i)
            inputs.add(paths[j])
        names = ["out"] if rng.random() < 0.7 else ["out", "dev"]
        outputs = [OutputPath(name=name, path=store(i, "" if name == "out" else "-dev")) for name in names]
        cached = rng.random() < 0.2
        out.append(
            DiscoveredDerivation(
                drv_path=paths[i],
                system="x86_64-linux",
                required_features=["big-parallel"] if rng.random() < 0.05 else [],
                outputs=outputs,
                input_drvs=sorted(inputs),
                cached_outputs=[
                    CachedOutput(path=o.path, nar_size=rng.randint(10**4, 10**8)) for o in outputs
                ]
                if cached
                else [],
                attr=f"legacyPackages.x86_64-linux.pkg{i}" if rng.random() < 0.3 else None,
            )
        )
    rng.shuffle(out)
    return out


class RssSampler:
    """The peak RSS of this process while running, sampled every 10 ms."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.now()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.start) / 2**20


class Statements:
    """Counts the statements sent, times them by their first words, and times every transaction from
    its first statement to the end of its commit (a statement outside a transaction block is one)."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.count = 0
        self.seconds: dict[str, float] = {}
        self.longest_transaction = 0.0
        self.transactions = 0
        self.commit_seconds = 0.0
        self._began: float | None = None

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        self.count += 1
        t0 = time.perf_counter()
        if self.connection.in_atomic_block and self._began is None:
            self._began = t0
        try:
            return execute(sql, params, many, context)
        finally:
            t1 = time.perf_counter()
            key = " ".join(sql.split())[:90]
            self.seconds[key] = self.seconds.get(key, 0.0) + t1 - t0
            if not self.connection.in_atomic_block:
                self._ended(t0, t1)

    def _ended(self, began: float, ended: float) -> None:
        self.transactions += 1
        self.longest_transaction = max(self.longest_transaction, ended - began)

    def __enter__(self) -> Statements:
        commit, rollback = self.connection._commit, self.connection._rollback

        def ended(original: Any) -> Any:
            def call() -> Any:
                t0 = time.perf_counter()
                try:
                    return original()
                finally:
                    self.commit_seconds += time.perf_counter() - t0
                    if self._began is not None:
                        self._ended(self._began, time.perf_counter())
                        self._began = None

            return call

        self._saved = (commit, rollback)
        self.connection._commit, self.connection._rollback = ended(commit), ended(rollback)
        self._wrapper = self.connection.execute_wrapper(self)
        self._wrapper.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._wrapper.__exit__(*exc)
        self.connection._commit, self.connection._rollback = self._saved

    def top(self, n: int = 8) -> list[str]:
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:n]
        return [f"    {secs:7.2f} s  {sql}" for sql, secs in ranked]


def independent(n: int, seed: int = 23) -> list[Any]:
    """n derivations with no inputs and nothing cached: every one is a leaf, queued at the final part
    (the outside check's shape that made the queueing quadratic on a fresh table, issue 30)."""
    from gradient.core.protocol import DiscoveredDerivation, OutputPath

    rng = random.Random(seed)

    def store(i: int, suffix: str) -> str:
        digest = "".join(rng.choice(NIX_BASE32) for _ in range(32))
        return f"/nix/store/{digest}-leaf-{i}{suffix}"

    return [
        DiscoveredDerivation(
            drv_path=store(i, ".drv"),
            system="x86_64-linux",
            required_features=[],
            outputs=[OutputPath(name="out", path=store(i, ""))],
            input_drvs=[],
            cached_outputs=[],
            attr=f"checks.x86_64-linux.leaf{i}",
        )
        for i in range(n)
    ]


def claim(project: Any, worker: Any, session: Any, commit: str) -> Any:
    from django.utils import timezone
    from msgspec.json import encode as encode_json

    from gradient.core.protocol import decode_worker_message
    from gradient.scheduling.models import Evaluation
    from gradient.scheduling.services.assignment import request_job
    from gradient.scheduling.services.reports import handle_report

    evaluation = Evaluation.objects.create(project=project, repository="sim:bench", commit=commit)
    handed = request_job(worker_id=worker.id, protocol_kind="flake", now=timezone.now())
    assert handed is not None and handed.job_key == evaluation.job_key, "the claim went elsewhere"
    message = {
        "type": "JobUpdate",
        "job_id": handed.job_key,
        "assignment_id": str(handed.assignment_id),
        "update": {"kind": "evaluating_derivations"},
    }
    handle_report(
        worker_id=worker.id, message=decode_worker_message(encode_json(message)), now=timezone.now()
    )
    return handed, evaluation.id


def by_count(derivations: list[Any], size: int, first: int = 0) -> list[Any]:
    """The result in parts of `size` derivations each (the outside check's way), the last one final; with
    `first`, a first part of that many before them."""
    from gradient.core.protocol import EvalResult

    head, derivations = ([derivations[:first]], derivations[first:]) if first else ([], derivations)
    chunks = head + [derivations[i : i + size] for i in range(0, len(derivations), size)] or [[]]
    return [
        EvalResult(derivations=c, warnings=[], errors=[], is_final=i == len(chunks) - 1)
        for i, c in enumerate(chunks)
    ]


def send_result(
    session: Any, handed: Any, derivations: list[Any], part_size: int | None = None
) -> dict[str, Any]:
    """The reference worker's parts (or parts of `part_size` derivations), each encoded as its frame,
    decoded strictly and handed to the job loop, one after the other (as one socket's frames are).
    Returns the figures."""
    from gradient.workers.client.parts import eval_result_parts

    # The worker's side first (its split and its frames), so what is timed and measured is the server's.
    t0 = time.perf_counter()
    parts_sent = (
        by_count(derivations, part_size)
        if part_size
        else eval_result_parts(
            derivations=derivations,
            warnings=[],
            errors=[],
            job_id=handed.job_key,
            assignment_id=str(handed.assignment_id),
        )
    )
    return send_parts(session, handed, parts_sent, split_since=t0)


def send_parts(
    session: Any, handed: Any, parts_sent: list[Any], split_since: float | None = None
) -> dict[str, Any]:
    """Each part encoded as its frame (before the clock starts), then decoded strictly and handed to the
    job loop, one after the other. Returns the figures."""
    from django.db import connection

    from gradient.core.protocol import JobUpdate, decode_worker_message, encode
    from gradient.workers.proto import jobloop

    t0 = time.perf_counter() if split_since is None else split_since
    frames = [
        encode(JobUpdate(job_id=handed.job_key, assignment_id=str(handed.assignment_id), update=part))
        for part in parts_sent
    ]
    worker_side = time.perf_counter() - t0
    frame_bytes = max(len(f) for f in frames)
    parts = len(frames)
    first_queued: float | None = None
    with RssSampler() as rss, Statements(connection) as counter:
        started = time.perf_counter()
        cpu_started = time.process_time()
        final_arrived = started
        while frames:
            if len(frames) == 1:
                final_arrived = time.perf_counter()
            message = decode_worker_message(frames.pop(0))
            jobloop.job_update(session=session, message=message)
            del message
            if first_queued is None and any_queued():
                first_queued = time.perf_counter() - started
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
    return {
        "seconds": elapsed,
        "cpu": cpu,
        "after_final": started + elapsed - final_arrived,
        "first_queued": first_queued,
        "statements": counter.count,
        "peak_mb": rss.growth_mb,
        "longest": counter.longest_transaction,
        "transactions": counter.transactions,
        "parts": parts,
        "worker_side": worker_side,
        "frame_kb": frame_bytes / 1024,
        "top": counter.top(),
        "commits": counter.commit_seconds,
        "in_statements": sum(counter.seconds.values()),
    }


def any_queued() -> bool:
    """Whether some build is queued (the partial index of the Queued builds)."""
    from gradient.scheduling.models import DerivationBuild

    return DerivationBuild.objects.filter(status="Queued").exists()


def known_parts(paths: list[str]) -> list[Any]:
    """A re-evaluation that names every derivation of the previous result in `known_drvs`, in parts
    that fit a frame."""
    from gradient.core.protocol import EvalResult

    size = 8000  # paths of about 90 bytes: 720 KB a part
    chunks = [paths[i : i + size] for i in range(0, len(paths), size)] or [[]]
    return [
        EvalResult(derivations=[], warnings=[], errors=[], is_final=i == len(chunks) - 1, known_drvs=c)
        for i, c in enumerate(chunks)
    ]


def copy_limit(derivations: list[Any]) -> float:
    """The raw COPY of the same rows into the three tables, in one transaction, committed: one build
    per derivation (the leaves queued, the digest of its inputs that the ingest keeps), its edges, the
    evaluation's links; foreign keys deferred (as Django declares them). What no ingest can beat on this
    machine; measured in the same run."""
    import uuid

    import msgspec
    from django.db import connection, transaction

    from gradient.scheduling.decisions.derivations import inputs_digest
    from gradient.scheduling.models import Evaluation, Project

    encode = msgspec.json.encode
    evaluation = Evaluation.objects.create(
        project=Project.objects.get(name="ingest"), repository="sim:bench", commit="copy-limit"
    )
    cached = {d.drv_path for d in derivations if d.cached_outputs}
    ids = {d.drv_path: uuid.uuid4() for d in derivations}
    started = time.perf_counter()
    with transaction.atomic(), connection.cursor() as cur:
        raw = cur.cursor
        with raw.copy(
            "COPY derivation_build (id, drv_path, system, required_features, outputs, inputs_digest, status, "
            "prioritized, "
            "attempts, max_attempts, timeout_secs, max_silent_secs, last_error, created_at, updated_at) "
            "FROM STDIN"
        ) as copy:
            for d in derivations:
                leaf = d.drv_path not in cached and all(i in cached for i in d.input_drvs)
                copy.write_row(
                    (
                        ids[d.drv_path],
                        d.drv_path,
                        d.system,
                        encode(sorted(d.required_features)).decode(),
                        encode([{"name": o.name, "path": o.path} for o in d.outputs]).decode(),
                        inputs_digest(d.drv_path, d.input_drvs),
                        "Queued" if leaf else ("Substituted" if d.drv_path in cached else "Created"),
                        False,
                        0,
                        3,
                        3600,
                        600,
                        "",
                        "now",
                        "now",
                    )
                )
        with raw.copy("COPY derivation_build_dependency (build_id, dependency_id) FROM STDIN") as copy:
            for d in derivations:
                for i in set(d.input_drvs):
                    copy.write_row((ids[d.drv_path], ids[i]))
        with raw.copy(
            "COPY evaluation_build (evaluation_id, build_id, attr, named, blocks_evaluation) FROM STDIN"
        ) as copy:
            for d in derivations:
                copy.write_row((evaluation.id, ids[d.drv_path], d.attr, d.attr is not None, True))
    return time.perf_counter() - started


def check(evaluation_id: Any, derivations: list[Any]) -> str:
    """That the result arrived whole: every edge, exactly the leaves queued."""
    from gradient.scheduling.models import DerivationBuild, DerivationBuildDependency, EvaluationBuild

    edges = sum(len(set(d.input_drvs)) for d in derivations)
    cached = {d.drv_path for d in derivations if d.cached_outputs}
    leaves = sum(
        1 for d in derivations if d.drv_path not in cached and all(i in cached for i in d.input_drvs)
    )
    got_edges = DerivationBuildDependency.objects.count()
    got_links = EvaluationBuild.objects.filter(evaluation_id=evaluation_id).count()
    queued = DerivationBuild.objects.filter(status="Queued").count()
    substituted = DerivationBuild.objects.filter(status="Substituted").count()
    ok = (
        got_edges == edges
        and got_links == len(derivations)
        and queued == leaves
        and substituted == len(cached)
    )
    return (
        f"{'whole' if ok else 'NOT WHOLE'}: {got_links} links, {got_edges}/{edges} edges, "
        f"{queued}/{leaves} leaves queued, {substituted}/{len(cached)} substituted"
    )


def run(n: int, profile: bool, verbose: bool) -> str:
    from django.db import connection

    t0 = time.perf_counter()
    derivations = generate(n)
    print(f"N = {n}: generated in {time.perf_counter() - t0:.1f} s; {describe_machine()}", flush=True)
    start(n)
    limit = copy_limit(derivations)
    print(f"  the copy limit: {limit:.2f} s (the same rows by COPY, one transaction)", flush=True)
    project, worker, session = start(n)

    handed, evaluation_id = claim(project, worker, session, "first")
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    first = send_result(session, handed, derivations)
    if profiler is not None:
        profiler.disable()
    print(
        f"  ingest {first['seconds']:.2f} s in {first['parts']} parts "
        f"(largest frame {first['frame_kb']:.0f} KiB; the worker split and encoded them in "
        f"{first['worker_side']:.1f} s before), "
        f"{first['statements']} statements, peak +{first['peak_mb']:.0f} MB, "
        f"{first['transactions']} transactions, the longest {first['longest']:.2f} s; "
        f"{first['in_statements']:.1f} s in statements, {first['commits']:.1f} s in commits; "
        f"this process's CPU {first['cpu']:.2f} s",
        flush=True,
    )
    print("\n".join(first["top"]) if verbose else "", end="\n" if verbose else "")
    print(f"  {check(evaluation_id, derivations)}", flush=True)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")  # what autovacuum does soon after a load this size
    again, _ = claim(project, worker, session, "again")
    reuse = send_result(session, again, derivations)
    print(
        f"  reuse {reuse['seconds']:.2f} s in {reuse['parts']} parts, {reuse['statements']} statements, "
        f"peak +{reuse['peak_mb']:.0f} MB, {reuse['transactions']} transactions, "
        f"the longest {reuse['longest']:.2f} s; "
        f"{reuse['in_statements']:.1f} s in statements, {reuse['commits']:.1f} s in commits; "
        f"this process's CPU {reuse['cpu']:.2f} s",
        flush=True,
    )
    print("\n".join(reuse["top"]) if verbose else "", end="\n" if verbose else "")
    named, _ = claim(project, worker, session, "known")
    known = send_parts(session, named, known_parts([d.drv_path for d in derivations]))
    print(
        f"  known {known['seconds']:.2f} s in {known['parts']} parts (every derivation named in known_drvs), "
        f"{known['statements']} statements, the longest transaction {known['longest']:.2f} s; "
        f"{known['in_statements']:.1f} s in statements, {known['commits']:.1f} s in commits; "
        f"this process's CPU {known['cpu']:.2f} s",
        flush=True,
    )
    print("\n".join(known["top"]) if verbose else "", end="\n" if verbose else "")
    if profiler is not None:
        import pstats

        path = log_dir() / "ingest.prof"
        profiler.dump_stats(str(path))
        print(f"  profile of the first ingest: {path}")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    peak = max(first["peak_mb"], reuse["peak_mb"], known["peak_mb"])
    longest = max(first["longest"], reuse["longest"], known["longest"])
    queued = first["first_queued"]
    return (
        f"ingest: {n} derivations in {first['seconds']:.1f} s = {first['seconds'] / limit:.2f} of the copy "
        f"limit ({limit:.1f} s); reuse {reuse['seconds']:.1f} s = {reuse['seconds'] / limit:.2f} of the copy "
        f"limit; known {known['seconds']:.2f} s; first build queued after "
        f"{'never' if queued is None else f'{queued:.2f}'} s; peak +{peak:.0f} MB, "
        f"longest transaction {longest:.2f} s"
    )


def start(n: int) -> tuple[Any, Any, Any]:
    """Empty tables, one project, an evaluating worker and its session: (project, worker, session)."""
    from django.db import connection
    from django.utils import timezone

    from gradient.runtime.passes import server_boot_start
    from gradient.scheduling.services.projects import project_create
    from gradient.workers.models import Worker, WorkerSession
    from gradient.workers.services import SessionRef

    reset_tables()
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE eval_ingest, eval_ingest_input CASCADE")
    now = timezone.now()
    project = project_create(name="ingest")
    worker = Worker.objects.create(
        name="evaluator", token_hash="-", can_fetch=True, can_eval=True, can_build=False, cpu_core_score=1000
    )
    worker.projects.set([project])
    boot = server_boot_start(now=now)
    row = WorkerSession.objects.create(
        worker=worker, channel_name="bench.ingest", server_boot=boot.id, opened_at=now, last_seen=now
    )
    return project, worker, SessionRef(session_id=row.id, worker_id=worker.id)


def run_independent(n: int, part_size: int) -> str:
    """The outside check's shape: n leaves in parts of `part_size`, on tables whose statistics were taken
    while they were empty (a fresh database after autovacuum's first look): the plans of the ingest and
    of the decision are made on statistics that say a few rows where there are n."""
    from django.db import connection

    from gradient.scheduling.models import DerivationBuild

    project, worker, session = start(n)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    derivations = independent(n)
    print(f"N = {n} independent, parts of {part_size}; {describe_machine()}", flush=True)
    handed, evaluation_id = claim(project, worker, session, "independent")
    got = send_result(session, handed, derivations, part_size=part_size)
    queued = DerivationBuild.objects.filter(status="Queued").count()
    print(
        f"  {got['parts']} parts in {got['seconds']:.2f} s, the final part {got['after_final']:.2f} s, "
        f"{queued}/{n} queued, the longest transaction {got['longest']:.2f} s",
        flush=True,
    )
    print("\n".join(got["top"]))
    return (
        f"independent: {n} derivations in parts of {part_size} in {got['seconds']:.1f} s; "
        f"{'all' if queued == n else queued} queued {got['after_final']:.2f} s after the final part arrived"
    )


def fresh_database(url: str) -> str:
    """`url`'s database name + "_fresh", dropped if it exists: created and migrated anew by setup_django,
    its tables never analyzed (autovacuum may look at them at any moment, as on a new installation)."""
    from urllib.parse import urlparse

    import psycopg

    parsed = urlparse(url)
    name = parsed.path.lstrip("/") + "_fresh"
    admin = parsed._replace(path="/postgres").geturl()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return parsed._replace(path=f"/{name}").geturl()


def run_socket(n: int, part_size: int, database_url: str, first_part: int = 0, analyzed: bool = False) -> str:
    """The outside check itself: a real `serve` on a database created for this run (never analyzed), one
    evaluating worker over a real WebSocket sending n leaves in parts of `part_size` back to back, then
    JobCompleted. Timed from this process, by polling the database: every build Queued, and the
    evaluation past evaluating, each after the final part was sent."""
    import asyncio

    from django.db import close_old_connections
    from django.db.models import Count, Max, Q
    from django.utils import timezone

    from gradient.scheduling.models import DerivationBuild, EvalIngest, Evaluation
    from gradient.scheduling.services.evaluations import evaluation_create
    from gradient.scheduling.services.projects import project_create
    from gradient.workers.services import worker_register
    from tests.support.processes import serve

    reset_tables()
    if analyzed:  # autovacuum's first look at a new installation: statistics of empty tables
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
    project = project_create(name="ingest-socket")
    worker, token = worker_register(name="evaluator", projects=[project])
    derivations = independent(n)
    print(f"N = {n} independent over a WebSocket, parts of {part_size}; {describe_machine()}", flush=True)
    env = service_env(database_url, None)
    figures: dict[str, float] = {}

    submitted: list[Any] = []

    def submit() -> None:
        close_old_connections()
        evaluation, _ = evaluation_create(
            project=project, repository="sim:bench", commit="socket", now=timezone.now()
        )
        submitted.append(evaluation.id)

    def counts() -> tuple[int, str]:
        close_old_connections()
        queued = DerivationBuild.objects.aggregate(q=Count("id", filter=Q(status="Queued")))["q"]
        return int(queued), str(Evaluation.objects.values_list("status", flat=True).get(id=submitted[0]))

    async def evaluate(url: str) -> None:
        import msgspec
        from websockets.asyncio.client import connect

        async with connect(url, max_size=8 * 2**20, ping_interval=None) as ws:
            await ws.send(
                msgspec.json.encode(
                    {
                        "type": "InitConnection",
                        "worker_id": str(worker.id),
                        "token": token,
                        "capabilities": {"fetch": True, "eval": True, "build": False},
                        "protocol": 1,
                    }
                ).decode()
            )
            ack = msgspec.json.decode(await ws.recv())
            assert ack["type"] == "InitAck", ack
            # Submitted now, as the REST call does (its record, the queue's change feed).
            await asyncio.to_thread(submit)
            await ws.send('{"type": "RequestJob", "kind": "flake"}')
            while (assign := msgspec.json.decode(await ws.recv()))["type"] != "AssignJob":
                pass
            job = {"job_id": assign["job_id"], "assignment_id": assign["assignment_id"]}
            await ws.send(
                msgspec.json.encode({"type": "AssignJobResponse", **job, "accepted": True}).decode()
            )
            update = {"kind": "evaluating_derivations"}
            await ws.send(msgspec.json.encode({"type": "JobUpdate", **job, "update": update}).decode())
            frames = [
                msgspec.json.encode({"type": "JobUpdate", **job, "update": {"kind": "eval_result", **part}})
                for part in (msgspec.to_builtins(p) for p in by_count(derivations, part_size, first_part))
            ]
            figures["parts"] = len(frames)
            figures["first"] = time.monotonic()
            for frame in frames:
                await ws.send(frame.decode())
            figures["final"] = time.monotonic()
            await ws.send(msgspec.json.encode({"type": "JobCompleted", **job, "elapsed_ms": 1}).decode())
            while True:  # the session stays open until all is decided
                queued, status = await asyncio.to_thread(counts)
                if queued == n and "queued" not in figures:
                    figures["queued"] = time.monotonic()
                if status not in ("Queued", "Fetching", "EvaluatingFlake", "EvaluatingDerivation"):
                    figures.setdefault("evaluated", time.monotonic())
                    figures["status"] = 0 if status in ("Building", "Waiting") else 1
                    if "queued" in figures or figures["status"]:
                        break
                if time.monotonic() - figures["final"] > 600:
                    break
                await asyncio.sleep(0.02)

    with serve(
        env, log_dir(), extra_args=["--log-level", os.environ.get("GRADIENT_LOG_LEVEL", "warning").lower()]
    ) as server:
        asyncio.run(evaluate(server.ws_url))
    queued, status = counts()
    # On the server's clock too: the first part stored (the ingest started), the final one (decided), and
    # the last build queued.
    ingest = EvalIngest.objects.get(evaluation_id=submitted[0])
    last_queued = DerivationBuild.objects.aggregate(t=Max("queued_at"))["t"]
    stored = (ingest.decided_at - ingest.started_at).total_seconds()
    last = (last_queued - ingest.decided_at).total_seconds()
    server_side = (
        f"on the server's clock: the parts stored in {stored:.2f} s, "
        f"the last build queued {last:.2f} s after the final part"
    )
    final = figures["final"]
    after = {k: figures[k] - final for k in ("queued", "evaluated") if k in figures}
    print(
        f"  {int(figures['parts'])} parts sent in {final - figures['first']:.2f} s; "
        f"{queued}/{n} queued {after.get('queued', float('nan')):.2f} s after the final part was sent, "
        f"the evaluation {status} after {after.get('evaluated', float('nan')):.2f} s; {server_side}",
        flush=True,
    )
    sent = figures["final"] - figures["first"]
    return (
        f"independent over a WebSocket, fresh database: {n} derivations in parts of {part_size}"
        f"{f' after a first part of {first_part}' if first_part else ''}"
        f"{' (analyzed empty)' if analyzed else ''}, "
        f"{'all' if queued == n else queued} queued {after.get('queued', float('nan')):.2f} s after the "
        f"final part was sent ({sent:.1f} s to send them), evaluation {status}; {server_side}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--derivations", type=int, nargs="+", default=[1000, 10000, 150000])
    parser.add_argument("--profile", action="store_true", help="cProfile the largest N's first ingest")
    parser.add_argument("--statements", action="store_true", help="the statements that took longest")
    parser.add_argument(
        "--shape",
        choices=["nixpkgs", "independent"],
        default="nixpkgs",
        help="independent: N leaves sent in parts of --part-size on tables analyzed empty",
    )
    parser.add_argument("--part-size", type=int, default=500, help="derivations a part (--shape independent)")
    parser.add_argument(
        "--first-part",
        type=int,
        default=0,
        help="--socket: a first part of this many derivations before the parts of --part-size (a new "
        "installation's first result is small: the plans a connection keeps are made on it)",
    )
    parser.add_argument(
        "--analyzed-empty",
        action="store_true",
        help="--socket: the fresh database's tables analyzed while empty before the serve starts",
    )
    parser.add_argument(
        "--socket",
        action="store_true",
        help="--shape independent through a real serve and WebSocket, on a database created for the run",
    )
    args = parser.parse_args()
    if args.socket:
        from common import DEFAULT_DATABASE_URL

        url = setup_django(fresh_database(os.environ.get("BENCH_DATABASE_URL") or DEFAULT_DATABASE_URL))
        print(
            "\n".join(
                run_socket(n, args.part_size, url, args.first_part, args.analyzed_empty)
                for n in args.derivations
            )
        )
        return
    setup_django()
    import logging

    logging.getLogger("gradient").setLevel(logging.WARNING)
    if args.shape == "independent":
        lines = [run_independent(n, args.part_size) for n in args.derivations]
    else:
        lines = [
            run(n, args.profile and n == max(args.derivations), args.statements) for n in args.derivations
        ]
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
