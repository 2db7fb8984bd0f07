"""`sim`: a deterministic simulated Nix, so tests, demos and benchmarks run without Nix.

Repository URLs name generated derivation graphs:

    sim:chain?n=3          chain-0 <- chain-1 <- chain-2 (each needs the one before); attr on the top
    sim:diamond            diamond-base <- diamond-left, diamond-right <- diamond-top; attr on the top
    sim:wide?n=40          wide-0 ... wide-39, independent, each its own attr
    sim:/path/graph.json   a graph file (format below)

Query parameters (all optional):

    n=N                    size of chain / wide
    system=S               every derivation's system (default x86_64-linux)
    features=a,b           required system features of every derivation
    duration_ms=N          build time of every derivation (default: the executor's build_ms)
    fail=name,name         these derivations fail to build...
    fail_kind=K            ...with this BuildFailureKind (default permanent)
    cached=name,name       these derivations' outputs are in the cache (cached_outputs)
    salt=X                 changes every store path (a "different" flake)
    eval_ms=N, fetch_ms=N  time the evaluation / fetch takes
    warn=text              a warning in the eval_result
    eval_error=text        an error in the eval_result (the job still completes)
    eval_fail=text         the evaluation fails (permanent)
    fetch_fail=text        the fetch fails (transient)

A graph file is `{"derivations": [{"name", "system"?, "features"?, "outputs"?: ["out", ...],
"inputs"?: [name, ...], "attr"?, "duration_ms"?, "fail"?: kind, "cached"?: bool}], "warnings"?: [...],
"errors"?: [...]}`; without any `attr`, every derivation nothing depends on gets
`packages.<system>.<name>`.

Store paths are stable: `/nix/store/<hash>-<name>.drv`, the hash over the derivation's name, system,
features, outputs, inputs and salt. How a derivation builds (its duration, its failure) is written
into its store name (`chain-1__ms200__fail-permanent`), so any sim worker builds it the same way
without having seen the evaluation. The fetched source's store path carries its URL the same way.
Each sim worker keeps a simulated local store (seeded with `--sim-store`) that grows with fetches and
builds, and that offers are scored against.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from gradient.core.protocol import (
    BuildFailureKind,
    BuildSpec,
    BuiltOutput,
    CachedOutput,
    CachedSource,
    ClusterAddress,
    DiscoveredDerivation,
    FlakeSource,
    OutputPath,
    RepositorySource,
)
from gradient.workers.executors.base import (
    BuildResult,
    DerivationEvaluation,
    Executor,
    ExecutorFailure,
    FlakeEvaluation,
    JobContext,
)

STORE = "/nix/store/"
NIX_BASE32 = "0123456789abcdfghijklmnpqrsvwxyz"
DEFAULT_SYSTEM = "x86_64-linux"
SOURCE_MARK = "-source-"
# Store names allow [A-Za-z0-9+-._?=]; anything else in a URL is written as _XX (hex).
_NAME_SAFE = re.compile(r"[A-Za-z0-9.\-?=+]")
_MARKER = re.compile(r"^(ms(?P<ms>\d+)|fail-(?P<fail>[a-z_]+)|subst)$")


def nix_hash(*parts: str) -> str:
    """32 characters of Nix's base32 alphabet over a SHA-256 of the parts (160 bits, as Nix uses)."""
    digest = hashlib.sha256("\0".join(parts).encode()).digest()[:20]
    number = int.from_bytes(digest, "big")
    return "".join(NIX_BASE32[(number >> (5 * i)) & 31] for i in range(32))


def nar_size_of(path: str) -> int:
    """A stable, plausible NAR size (4 KiB to about 64 MiB) for a simulated store path."""
    seed = int(hashlib.sha256(path.encode()).hexdigest()[:8], 16)
    return 4096 * (1 + seed % 16384)


def escape_name(text: str) -> str:
    return "".join(c if _NAME_SAFE.match(c) else f"_{ord(c):02x}" for c in text if ord(c) < 256)


def unescape_name(name: str) -> str:
    return re.sub(r"_([0-9a-f]{2})", lambda m: chr(int(m.group(1), 16)), name)


def source_store_path(url: str, commit: str) -> str:
    return f"{STORE}{nix_hash('source', url, commit)}{SOURCE_MARK}{escape_name(url)}"


def url_of_source(path: str) -> str | None:
    """The sim: URL a fetched source's store path carries, or None for anything else."""
    if not path.startswith(STORE) or SOURCE_MARK not in path:
        return None
    url = unescape_name(path.split(SOURCE_MARK, 1)[1])
    return url if url.startswith("sim:") else None


# --- Graphs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimDerivation:
    name: str
    system: str = DEFAULT_SYSTEM
    features: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ("out",)
    inputs: tuple[str, ...] = ()
    attr: str | None = None
    duration_ms: int | None = None
    fail: str | None = None
    cached: bool = False

    @property
    def store_name(self) -> str:
        markers = []
        if self.duration_ms is not None:
            markers.append(f"ms{self.duration_ms}")
        if self.fail is not None:
            markers.append(f"fail-{self.fail}")
        return "__".join([self.name, *markers])


@dataclass
class SimGraph:
    """A generated flake: derivations in dependency order (inputs first)."""

    derivations: dict[str, SimDerivation]
    salt: str = ""
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    eval_ms: int = 0
    eval_fail: str | None = None
    _drv_paths: dict[str, str] = field(default_factory=dict, repr=False)

    def drv_path(self, name: str) -> str:
        if name not in self._drv_paths:
            d = self.derivations[name]
            inputs = [self.drv_path(i) for i in d.inputs]
            digest = nix_hash(
                "drv", d.store_name, d.system, ",".join(d.features), ",".join(d.outputs), *inputs, self.salt
            )
            self._drv_paths[name] = f"{STORE}{digest}-{d.store_name}.drv"
        return self._drv_paths[name]

    def output_path(self, name: str, output: str) -> str:
        d = self.derivations[name]
        suffix = "" if output == "out" else f"-{output}"
        return f"{STORE}{nix_hash('out', self.drv_path(name), output)}-{d.store_name}{suffix}"

    def attrs(self) -> dict[str, str]:
        """attr -> derivation name."""
        return {d.attr: d.name for d in self.derivations.values() if d.attr is not None}

    def closure(self, names: Iterable[str]) -> list[str]:
        """The names and everything they need, dependencies first (stable order)."""
        wanted: set[str] = set()
        stack = list(names)
        while stack:
            name = stack.pop()
            if name not in wanted:
                wanted.add(name)
                stack.extend(self.derivations[name].inputs)
        return [n for n in self.derivations if n in wanted]

    def discovered(self, attrs: Sequence[str]) -> list[DiscoveredDerivation]:
        by_attr = self.attrs()
        attr_of = {by_attr[a]: a for a in attrs if a in by_attr}
        result = []
        for name in self.closure(attr_of):
            d = self.derivations[name]
            outputs = [OutputPath(name=o, path=self.output_path(name, o)) for o in d.outputs]
            result.append(
                DiscoveredDerivation(
                    drv_path=self.drv_path(name),
                    attr=attr_of.get(name),
                    system=d.system,
                    required_features=list(d.features),
                    outputs=outputs,
                    input_drvs=[self.drv_path(i) for i in d.inputs],
                    cached_outputs=[CachedOutput(path=o.path, nar_size=nar_size_of(o.path)) for o in outputs]
                    if d.cached
                    else [],
                )
            )
        return result


class SimUrlError(ValueError):
    pass


def _int(params: dict[str, str], key: str, default: int) -> int:
    raw = params.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SimUrlError(f"{key} must be an integer, got {raw!r}") from None
    if value < 0:
        raise SimUrlError(f"{key} must not be negative")
    return value


def _names(raw: str | None) -> tuple[str, ...]:
    return tuple(x for x in (raw or "").split(",") if x)


def sim_params(url: str) -> tuple[str, dict[str, str]]:
    """(shape or file path, query parameters) of a sim: URL."""
    if not url.startswith("sim:"):
        raise SimUrlError(f"not a sim: URL: {url!r}")
    parts = urlsplit(url[len("sim:") :])
    params = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    return parts.path, params


def graph_from_url(url: str) -> SimGraph:
    """The derivation graph a sim: URL names (deterministic)."""
    shape, params = sim_params(url)
    system = params.get("system") or DEFAULT_SYSTEM
    features = _names(params.get("features"))
    duration = _int(params, "duration_ms", -1)
    fail_names = set(_names(params.get("fail")))
    fail_kind = params.get("fail_kind") or BuildFailureKind.PERMANENT.value
    if fail_kind not in {k.value for k in BuildFailureKind}:
        raise SimUrlError(f"unknown fail_kind {fail_kind!r}")
    cached = set(_names(params.get("cached")))

    def make(name: str, inputs: tuple[str, ...] = (), attr: bool = False) -> SimDerivation:
        return SimDerivation(
            name=name,
            system=system,
            features=features,
            inputs=inputs,
            attr=f"packages.{system}.{name}" if attr else None,
            duration_ms=duration if duration >= 0 else None,
            fail=fail_kind if name in fail_names else None,
            cached=name in cached,
        )

    derivations: list[SimDerivation]
    warnings: list[str] = []
    errors: list[str] = []
    if shape == "chain":
        n = max(1, _int(params, "n", 3))
        derivations = [
            make(f"chain-{i}", (f"chain-{i - 1}",) if i else (), attr=i == n - 1) for i in range(n)
        ]
    elif shape == "diamond":
        derivations = [
            make("diamond-base"),
            make("diamond-left", ("diamond-base",)),
            make("diamond-right", ("diamond-base",)),
            make("diamond-top", ("diamond-left", "diamond-right"), attr=True),
        ]
    elif shape == "wide":
        derivations = [make(f"wide-{i}", attr=True) for i in range(max(1, _int(params, "n", 10)))]
    elif shape.endswith(".json"):
        derivations, warnings, errors = _graph_file(Path(shape), system=system, features=features)
    else:
        raise SimUrlError(f"unknown sim graph {shape!r}: use chain, diamond, wide or a .json file")

    unknown = fail_names - {d.name for d in derivations}
    if unknown:
        raise SimUrlError(f"fail= names no derivation: {', '.join(sorted(unknown))}")
    if params.get("warn"):
        warnings.append(params["warn"])
    if params.get("eval_error"):
        errors.append(params["eval_error"])
    return SimGraph(
        derivations={d.name: d for d in derivations},
        salt=params.get("salt", ""),
        warnings=warnings,
        errors=errors,
        eval_ms=_int(params, "eval_ms", 0),
        eval_fail=params.get("eval_fail") or None,
    )


def _graph_file(
    path: Path, *, system: str, features: tuple[str, ...]
) -> tuple[list[SimDerivation], list[str], list[str]]:
    try:
        data = json.loads(path.read_text())
        entries = data["derivations"]
        derivations = [
            SimDerivation(
                name=str(e["name"]),
                system=str(e.get("system") or system),
                features=tuple(e.get("features", features)),
                outputs=tuple(e.get("outputs") or ("out",)),
                inputs=tuple(e.get("inputs", ())),
                attr=e.get("attr"),
                duration_ms=e.get("duration_ms"),
                fail=e.get("fail"),
                cached=bool(e.get("cached", False)),
            )
            for e in entries
        ]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SimUrlError(f"cannot read sim graph {path}: {exc}") from None
    names = {d.name for d in derivations}
    for d in derivations:
        missing = set(d.inputs) - names
        if missing:
            raise SimUrlError(f"{d.name} needs unknown derivation(s) {', '.join(sorted(missing))}")
    ordered = _topological(derivations)
    if not any(d.attr for d in ordered):
        needed = {i for d in ordered for i in d.inputs}
        ordered = [
            d if d.name in needed else replace(d, attr=f"packages.{d.system}.{d.name}") for d in ordered
        ]
    return ordered, list(data.get("warnings", [])), list(data.get("errors", []))


def _topological(derivations: list[SimDerivation]) -> list[SimDerivation]:
    by_name = {d.name: d for d in derivations}
    done: dict[str, SimDerivation] = {}
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in done:
            return
        if name in visiting:
            raise SimUrlError(f"the sim graph has a cycle through {name}")
        visiting.add(name)
        for i in by_name[name].inputs:
            visit(i)
        visiting.discard(name)
        done[name] = by_name[name]

    for d in derivations:
        visit(d.name)
    return list(done.values())


def parse_store_name(drv_path: str) -> tuple[str, int | None, str | None]:
    """(name, duration_ms, failure kind) written into a sim derivation's store name."""
    base = drv_path.rsplit("/", 1)[-1]
    base = base.removesuffix(".drv")
    name = base.split("-", 1)[1] if "-" in base else base
    parts = name.split("__")
    duration: int | None = None
    fail: str | None = None
    for marker in parts[1:]:
        match = _MARKER.match(marker)
        if match and match.group("ms"):
            duration = int(match.group("ms"))
        elif match and match.group("fail"):
            fail = match.group("fail")
    return parts[0], duration, fail


# --- The executor ----------------------------------------------------------------------------------


class SimExecutor(Executor):
    name = "sim"

    def __init__(
        self,
        *,
        store: Iterable[str] = (),
        build_ms: int = 100,
        speed: float = 1.0,
        cluster_signal_timeout: float = 30.0,
        system_features: Sequence[str] = ("benchmark", "big-parallel", "kvm", "nixos-test"),
    ) -> None:
        self.store: set[str] = set(store)
        self.build_ms = build_ms
        self.speed = speed
        self.cluster_signal_timeout = cluster_signal_timeout
        self._features = list(system_features)
        self.built: list[str] = []  # drv paths, in the order they were built
        self._greeted: set[str] = set()  # assignments whose cluster handshake is done

    def default_system_features(self) -> list[str]:
        return list(self._features)

    async def _sleep_ms(self, ms: int) -> None:
        if ms > 0:
            await asyncio.sleep(ms / 1000 / self.speed)

    async def present_paths(self, paths: Sequence[str]) -> set[str]:
        return {p for p in paths if p in self.store}

    async def fetch(self, source: FlakeSource, ctx: JobContext) -> str:
        if isinstance(source, CachedSource):
            self.store.add(source.store_path)
            return source.store_path
        assert isinstance(source, RepositorySource)
        try:
            _, params = sim_params(source.url)
            fetch_ms = _int(params, "fetch_ms", 0)
        except SimUrlError as exc:
            raise ExecutorFailure(
                BuildFailureKind.PERMANENT, f"sim: cannot fetch {source.url}: {exc}"
            ) from None
        await self._sleep_ms(fetch_ms)
        if params.get("fetch_fail"):
            raise ExecutorFailure(BuildFailureKind.TRANSIENT, f"sim: fetch failed: {params['fetch_fail']}")
        path = source_store_path(source.url, source.commit)
        self.store.add(path)
        return path

    def _graph(self, flake: str) -> SimGraph:
        url = flake if flake.startswith("sim:") else url_of_source(flake)
        if url is None:
            raise ExecutorFailure(BuildFailureKind.PERMANENT, f"sim: {flake} is not a sim flake")
        try:
            return graph_from_url(url)
        except SimUrlError as exc:
            raise ExecutorFailure(BuildFailureKind.PERMANENT, f"sim: {exc}") from None

    async def evaluate_flake(self, flake: str, wildcards: list[str], ctx: JobContext) -> FlakeEvaluation:
        graph = self._graph(flake)
        await self._cluster_handshake(ctx)
        await self._sleep_ms(graph.eval_ms // 2)
        if graph.eval_fail:
            raise ExecutorFailure(BuildFailureKind.PERMANENT, f"sim: evaluation failed: {graph.eval_fail}")
        patterns = [w for w in wildcards if w] or ["*"]
        attrs = [a for a in graph.attrs() if any(fnmatchcase(a, p) for p in patterns)]
        return FlakeEvaluation(attrs=attrs)

    async def evaluate_derivations(
        self, flake: str, attrs: list[str], ctx: JobContext
    ) -> DerivationEvaluation:
        graph = self._graph(flake)
        await self._sleep_ms(graph.eval_ms - graph.eval_ms // 2)
        # The server is asked about the top-level derivations before their closures are walked: a known
        # one is named in known_drvs, its closure not walked.
        by_attr = graph.attrs()
        roots = {graph.drv_path(by_attr[a]): a for a in attrs if a in by_attr}
        known = await ctx.known_derivations(sorted(roots))
        return DerivationEvaluation(
            derivations=graph.discovered([a for p, a in roots.items() if p not in known]),
            warnings=list(graph.warnings),
            errors=list(graph.errors),
            known_drvs=sorted(known),
        )

    async def build(self, spec: BuildSpec, ctx: JobContext) -> BuildResult:
        await self._cluster_handshake(ctx)
        name, duration, fail = parse_store_name(spec.drv_path)
        ms = self.build_ms if duration is None else duration
        if spec.timeout_secs and ms > spec.timeout_secs * 1000:
            await self._sleep_ms(spec.timeout_secs * 1000)
            raise ExecutorFailure(BuildFailureKind.TIMEOUT, f"sim: {spec.drv_path} timed out")
        ctx.build_log(
            spec.build_id, f"building '{spec.drv_path}'...\nunpacking sources\nconfiguring {name}\n"
        )
        await self._sleep_ms(ms // 2)
        ctx.build_log(spec.build_id, f"compiling {name} ({ms} ms of simulated work)\n")
        await self._sleep_ms(ms - ms // 2)
        if fail is not None:
            kind = (
                BuildFailureKind(fail)
                if fail in {k.value for k in BuildFailureKind}
                else BuildFailureKind.PERMANENT
            )
            ctx.build_log(spec.build_id, f"error: {name}: the simulated builder failed ({kind.value})\n")
            raise ExecutorFailure(kind, f"sim: builder for '{spec.drv_path}' failed")
        ctx.build_log(
            spec.build_id, f"installing {name} to {spec.outputs[0].path if spec.outputs else '$out'}\n"
        )
        outputs = [BuiltOutput(name=o.name, path=o.path, nar_size=nar_size_of(o.path)) for o in spec.outputs]
        self.store.update(o.path for o in spec.outputs)
        self.store.add(spec.drv_path)
        self.built.append(spec.drv_path)
        return BuildResult(outputs=outputs, substituted=False)

    async def _cluster_handshake(self, ctx: JobContext) -> None:
        """A cluster member greets every other member of its started attempt and waits to hear from
        each of them, as a real distributed test would before it starts."""
        if ctx.cluster is None or len(ctx.roster) < 2 or ctx.assignment_id in self._greeted:
            return
        self._greeted.add(ctx.assignment_id)
        me = ClusterAddress(role=ctx.cluster.role, index=ctx.cluster.index)
        await ctx.send_signal(f"hello from {me.role}[{me.index}]")
        peers = {(p.role, p.index) for p in ctx.roster} - {(me.role, me.index)}
        heard: set[tuple[str, int]] = set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cluster_signal_timeout
        while heard < peers:
            signal = await ctx.receive_signal(wait_secs=max(0.0, deadline - loop.time()))
            if signal is None:
                missing = ", ".join(f"{r}[{i}]" for r, i in sorted(peers - heard))
                raise ExecutorFailure(
                    BuildFailureKind.TRANSIENT, f"sim: no signal from cluster peer(s) {missing}"
                )
            heard.add((signal.from_.role, signal.from_.index))
