"""`nix`: the real executor. It runs Nix's own commands against the local store, without a daemon.

- FetchFlake: `nix flake metadata --json` on the repository at its commit copies the source into the
  store; its store path is the fetch_result.
- EvaluateFlake: one pure `nix eval --json` of the locked flake (`nix flake metadata` locks it) lists
  the attributes the wildcards select (default `packages.<system>.*` and `checks.<system>.*`) whose
  values are derivations. Pure: the flake reads neither the worker's environment nor its files.
- EvaluateDerivations: one `nix eval` gives each attribute's derivation path (an attribute that fails
  is evaluated alone, for its error text, and reported in `errors`); `nix show-derivation -r` walks the
  closure of input derivations; `nix path-info --json` tells which outputs are already valid, with
  their NAR sizes.
- Build: `nix-store --realise` with `--log-format internal-json`, `--timeout` and `--max-silent-time`
  from the BuildSpec. Builder lines go to the worker's log; the outputs' NAR sizes come from
  `nix path-info`. Failures map to BuildFailureKind in nix_parse.classify_build_failure.
- Scoring: `nix path-info --json` says which offered paths the local store holds.
- Capabilities: `nix show-config --json` (`system`, `extra-platforms`, `system-features`).

Every Nix process starts in its own session (process group). Cancelling a job (AbortJob, the worker
stopping, a timeout) sends SIGTERM to the group, so Nix stops its builder and releases its locks,
and SIGKILL after `kill_grace_secs`. Nix reads the operator's configuration (`/etc/nix/nix.conf`,
NIX_CONFIG); the executor adds only `extra-experimental-features = nix-command flakes`. A nix process
gets an allow-listed environment (nix_parse.nix_environment_of): PATH, HOME, NIX_* and the like, never
the worker's GRADIENT_* variables.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradient.core.protocol import (
    BuildFailureKind,
    BuildProgress,
    BuildSpec,
    BuiltOutput,
    CachedSource,
    EvalProgress,
    FlakeSource,
    OutputPath,
    RepositorySource,
)
from gradient.workers.executors.base import (
    BuildResult,
    DerivationEvaluation,
    Executor,
    ExecutorFailure,
    ExecutorUnavailable,
    FlakeEvaluation,
    JobContext,
)
from gradient.workers.executors.nix_parse import (
    NixBuildLog,
    NixInputError,
    NixSettings,
    builds_elsewhere,
    classify_build_failure,
    discovered_derivations,
    eval_argv,
    flake_ref,
    format_attr_path,
    is_store_path,
    local_flake_ref,
    locked_flake_ref,
    nar_sizes_from_path_info,
    nix_environment_of,
    outputs_of,
    settings_from_show_config,
    split_attr_path,
    store_flake_ref,
    strip_ansi,
    wildcard_patterns,
)

log = logging.getLogger("gradient.worker.nix")

PATHS_PER_CALL = 500  # store paths per nix command line
STREAM_LIMIT = 4 * 1024 * 1024  # longest line read from a nix process
PROGRESS_EVERY_SECS = 1.0
MAX_STDERR_CHARS = 6000
STDERR_LINES_KEPT = 200


@dataclass(frozen=True)
class NixRun:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def error_text(self) -> str:
        text = strip_ansi(self.stderr).strip() or f"{self.argv[0]} exited with {self.returncode}"
        return text if len(text) <= MAX_STDERR_CHARS else "…" + text[-MAX_STDERR_CHARS:]

    def warnings(self) -> list[str]:
        return [
            line.strip()
            for line in strip_ansi(self.stderr).splitlines()
            if line.strip().startswith("warning:") and "--add-root" not in line
        ]


class NixCommandFailed(Exception):
    def __init__(self, run: NixRun) -> None:
        super().__init__(run.error_text())
        self.run = run


def nix_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    return nix_environment_of(os.environ if environ is None else environ)


def detect_settings(env: Mapping[str, str]) -> NixSettings:
    """Ask the local Nix for its system, extra platforms and system features (synchronously: the
    worker needs them before it connects)."""
    if (
        shutil.which("nix", path=env.get("PATH")) is None
        or shutil.which("nix-store", path=env.get("PATH")) is None
    ):
        raise ExecutorUnavailable(
            "the nix executor needs Nix (`nix` and `nix-store` on PATH); on Debian: apt-get install nix-bin"
        )
    try:
        shown = subprocess.run(
            ["nix", "show-config", "--json"], env=dict(env), capture_output=True, text=True, timeout=60
        )
        version = subprocess.run(
            ["nix", "--version"], env=dict(env), capture_output=True, text=True, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ExecutorUnavailable(f"cannot run nix: {exc}") from None
    if shown.returncode != 0:
        raise ExecutorUnavailable(f"nix show-config failed: {strip_ansi(shown.stderr).strip()}")
    try:
        return settings_from_show_config(json.loads(shown.stdout), version=version)
    except ValueError as exc:
        raise ExecutorUnavailable(f"cannot read nix show-config: {exc}") from None


def _chunks(items: Sequence[str], size: int = PATHS_PER_CALL) -> Iterable[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class NixExecutor(Executor):
    name = "nix"

    def __init__(
        self, *, settings: NixSettings, environ: Mapping[str, str] | None = None, kill_grace_secs: float = 5.0
    ) -> None:
        self.settings = settings
        self.env = nix_environment(environ)
        self.kill_grace_secs = kill_grace_secs
        self._running: dict[str, set[asyncio.subprocess.Process]] = {}

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None, **kwargs: Any) -> NixExecutor:
        env = nix_environment(environ)
        settings = detect_settings(env)
        log.info(
            "%s: system %s, extra platforms %s, features %s",
            settings.version or "nix",
            settings.system,
            " ".join(settings.extra_platforms) or "none",
            " ".join(settings.system_features) or "none",
        )
        return cls(settings=settings, environ=environ, **kwargs)

    def default_architectures(self) -> list[str]:
        return self.settings.platforms

    def default_system_features(self) -> list[str]:
        return list(self.settings.system_features)

    # --- processes -----------------------------------------------------------------------------------

    async def _run(
        self,
        argv: Sequence[str],
        ctx: JobContext | None = None,
        *,
        on_stderr: Callable[[str], Awaitable[None]] | None = None,
    ) -> NixRun:
        """Run one Nix command in its own process group, streaming stderr lines to `on_stderr`.
        Cancelled, it stops the group (see `_stop`) before the cancellation goes on."""
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self.env,
                start_new_session=True,
                limit=STREAM_LIMIT,
            )
        except OSError as exc:
            raise ExecutorFailure(BuildFailureKind.TRANSIENT, f"cannot run {argv[0]}: {exc}") from None
        key = ctx.assignment_id if ctx is not None else ""
        self._running.setdefault(key, set()).add(process)
        # The internal-json stream is for `on_stderr`; the error text keeps the last readable lines.
        readable: deque[str] = deque(maxlen=STDERR_LINES_KEPT)

        async def read_stderr() -> None:
            assert process.stderr is not None
            async for raw in process.stderr:
                line = raw.decode(errors="replace").rstrip("\n")
                if not line.startswith("@nix "):
                    readable.append(line)
                if on_stderr is not None:
                    await on_stderr(line)

        try:
            assert process.stdout is not None
            stdout, _ = await asyncio.gather(process.stdout.read(), read_stderr())
            returncode = await process.wait()
        except BaseException:
            await asyncio.shield(self._stop(process))
            raise
        finally:
            running = self._running.get(key)
            if running is not None:
                running.discard(process)
                if not running:
                    self._running.pop(key, None)
        return NixRun(tuple(argv), returncode, stdout.decode(errors="replace"), "\n".join(readable))

    async def _stop(self, process: asyncio.subprocess.Process) -> None:
        """SIGTERM to the process group (Nix then stops its builder, which runs in a session of its
        own, and releases its locks); SIGKILL if it is still there after the grace."""
        if process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), timeout=self.kill_grace_secs)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()

    async def _json(self, argv: Sequence[str], ctx: JobContext | None = None, **kwargs: Any) -> Any:
        run = await self._run(argv, ctx, **kwargs)
        if run.returncode != 0:
            raise NixCommandFailed(run)
        try:
            return json.loads(run.stdout)
        except ValueError:
            raise ExecutorFailure(
                BuildFailureKind.TRANSIENT, f"{' '.join(argv[:3])} printed no JSON: {run.stdout[:200]!r}"
            ) from None

    async def abort(self, ctx: JobContext) -> None:
        """Stop every Nix process still running for this job."""
        processes = list(self._running.pop(ctx.assignment_id, set()))
        await asyncio.gather(*(self._stop(p) for p in processes), return_exceptions=True)

    # --- the store -----------------------------------------------------------------------------------

    async def path_info(self, paths: Iterable[str], ctx: JobContext | None = None) -> dict[str, int]:
        """The given store paths (not derivations: see `valid_derivations`) that are valid in the local
        store, with their NAR sizes."""
        wanted = list(dict.fromkeys(p for p in paths if is_store_path(p) and not p.endswith(".drv")))
        valid: dict[str, int] = {}
        for chunk in _chunks(wanted):
            answer = await self._json(["nix", "path-info", "--json", *chunk], ctx)
            valid.update(nar_sizes_from_path_info(answer))
        return valid

    async def valid_derivations(self, paths: Iterable[str], ctx: JobContext | None = None) -> set[str]:
        """The given .drv files that are valid in the local store (`nix path-info` would answer for a
        derivation's outputs instead)."""
        wanted = list(dict.fromkeys(p for p in paths if is_store_path(p) and p.endswith(".drv")))
        valid: set[str] = set()
        for chunk in _chunks(wanted):
            run = await self._run(["nix-store", "--check-validity", "--print-invalid", *chunk], ctx)
            if run.returncode != 0:
                raise NixCommandFailed(run)
            invalid = set(run.stdout.split())
            valid.update(p for p in chunk if p not in invalid)
        return valid

    async def present_paths(self, paths: Sequence[str]) -> set[str]:
        try:
            return set(await self.path_info(paths)) | await self.valid_derivations(paths)
        except (NixCommandFailed, ExecutorFailure) as exc:
            log.warning("cannot query the local store for scoring: %s", exc)
            return set()

    async def _ensure_valid(self, store_path: str, ctx: JobContext) -> None:
        """A source or derivation the job needs must be in the local store (substituted if it can be)."""
        if not is_store_path(store_path):
            raise ExecutorFailure(BuildFailureKind.PERMANENT, f"{store_path!r} is not a Nix store path")
        if store_path in await self.present_paths([store_path]):
            return
        run = await self._run(["nix-store", "--realise", store_path], ctx)
        if run.returncode != 0:
            raise ExecutorFailure(
                BuildFailureKind.SUBSTITUTE_UNAVAILABLE,
                f"{store_path} is not in the local store and cannot be substituted: {run.error_text()}",
                missing_paths=[store_path],
            )

    # --- FetchFlake ----------------------------------------------------------------------------------

    @staticmethod
    def repository_ref(url: str, commit: str) -> str:
        """The flake reference of a repository URL at a commit; a plain absolute directory is a git
        work tree (`git+file://`) or a `path:`."""
        if url.startswith("/"):
            directory = Path(url)
            if not directory.is_dir():
                raise NixInputError(f"{url} is not a directory on this worker")
            url = local_flake_ref(str(directory.resolve()), is_git=(directory / ".git").exists())
        return flake_ref(url, commit)

    async def fetch(self, source: FlakeSource, ctx: JobContext) -> str:
        if isinstance(source, CachedSource):
            await self._ensure_valid(source.store_path, ctx)
            return source.store_path
        assert isinstance(source, RepositorySource)
        try:
            ref = self.repository_ref(source.url, source.commit)
        except NixInputError as exc:
            raise ExecutorFailure(BuildFailureKind.PERMANENT, f"cannot fetch {source.url}: {exc}") from None
        await self._eval_progress(ctx, "fetching", 0, 1)
        try:
            metadata = await self._json(["nix", "flake", "metadata", "--json", ref], ctx)
        except NixCommandFailed as failed:
            # A local repository that cannot be read will not be readable on the next try either.
            local = ref.startswith(("path:", "git+file:", "/"))
            kind = BuildFailureKind.PERMANENT if local else BuildFailureKind.TRANSIENT
            raise ExecutorFailure(kind, f"fetching {ref} failed: {failed.run.error_text()}") from None
        path = str(metadata.get("path") or "")
        if not is_store_path(path):
            raise ExecutorFailure(
                BuildFailureKind.TRANSIENT, f"nix flake metadata gave no store path for {ref}"
            )
        await self._eval_progress(ctx, "fetching", 1, 1)
        log.info("fetched %s to %s (revision %s)", ref, path, metadata.get("revision") or "none")
        return path

    async def _eval_progress(self, ctx: JobContext, phase: str, done: int, total: int | None) -> None:
        await ctx.progress(
            EvalProgress(
                job_id=ctx.job_id,
                assignment_id=ctx.assignment_id,
                phase="fetching" if phase == "fetching" else "evaluating",
                done=done,
                total=total,
            )
        )

    # --- EvaluateFlake / EvaluateDerivations ---------------------------------------------------------

    async def _flake_for_eval(self, flake: str, ctx: JobContext) -> str:
        """A fetched source (a store path) or, without a fetch step, a repository URL, locked: pure
        evaluation takes only a locked flake."""
        if flake.startswith("/nix/store/"):
            await self._ensure_valid(flake, ctx)
            ref = store_flake_ref(flake)
        else:
            try:
                ref = self.repository_ref(flake, "")
            except NixInputError as exc:
                raise ExecutorFailure(BuildFailureKind.PERMANENT, str(exc)) from None
        try:
            return locked_flake_ref(await self._json(["nix", "flake", "metadata", "--json", ref], ctx))
        except NixCommandFailed as failed:
            raise ExecutorFailure(
                BuildFailureKind.PERMANENT, f"locking {ref} failed: {failed.run.error_text()}"
            ) from None
        except NixInputError as exc:
            raise ExecutorFailure(BuildFailureKind.TRANSIENT, f"locking {ref} failed: {exc}") from None

    async def _eval(self, ref: str, ctx: JobContext, args: dict[str, Any]) -> tuple[Any, NixRun]:
        run = await self._run(eval_argv({"flake": ref, **args}), ctx)
        if run.returncode != 0:
            raise NixCommandFailed(run)
        try:
            return json.loads(run.stdout), run
        except ValueError:
            raise ExecutorFailure(
                BuildFailureKind.TRANSIENT, f"nix eval printed no JSON: {run.stdout[:200]!r}"
            ) from None

    async def evaluate_flake(self, flake: str, wildcards: list[str], ctx: JobContext) -> FlakeEvaluation:
        ref = await self._flake_for_eval(flake, ctx)
        try:
            patterns = wildcard_patterns(wildcards, self.settings.system)
        except NixInputError as exc:
            raise ExecutorFailure(BuildFailureKind.PERMANENT, f"bad wildcard: {exc}") from None
        try:
            selected, run = await self._eval(ref, ctx, {"mode": "attrs", "patterns": patterns})
        except NixCommandFailed as failed:
            raise ExecutorFailure(
                BuildFailureKind.PERMANENT, f"evaluating {ref} failed: {failed.run.error_text()}"
            ) from None
        attrs = sorted({format_attr_path(path) for path in selected})
        await self._eval_progress(ctx, "evaluating", 0, len(attrs))
        log.info("%s: %d attributes selected by %s", ref, len(attrs), ", ".join(wildcards) or "the defaults")
        return FlakeEvaluation(attrs=attrs, warnings=run.warnings())

    async def _drv_path_alone(self, ref: str, attr: str, ctx: JobContext) -> tuple[str | None, str | None]:
        """(derivation path, None) or (None, the error) for one attribute: the fallback that names the
        attribute that broke a whole evaluation."""
        run = await self._run(["nix", "eval", "--raw", f"{ref}#{attr}.drvPath"], ctx)
        if run.returncode == 0 and is_store_path(run.stdout.strip()):
            return run.stdout.strip(), None
        return None, run.error_text()

    async def evaluate_derivations(
        self, flake: str, attrs: list[str], ctx: JobContext
    ) -> DerivationEvaluation:
        ref = await self._flake_for_eval(flake, ctx)
        try:
            paths = [split_attr_path(a) for a in attrs]
        except NixInputError as exc:
            raise ExecutorFailure(BuildFailureKind.PERMANENT, f"bad attribute: {exc}") from None
        errors: list[str] = []
        warnings: list[str] = []
        drv_of: dict[str, str | None] = {}
        try:
            answer, run = await self._eval(ref, ctx, {"mode": "drvs", "attrs": paths})
            warnings.extend(run.warnings())
            drv_of = {format_attr_path(row["attr"]): row["drv"] for row in answer}
        except NixCommandFailed as failed:
            log.info("evaluating %d attributes together failed, one by one now: %s", len(attrs), failed)
        named: dict[str, str] = {}
        for attr in sorted(format_attr_path(p) for p in paths):
            drv = drv_of.get(attr)
            if drv is None:
                drv, error = await self._drv_path_alone(ref, attr, ctx)
                if drv is None:
                    errors.append(f"{attr}: {error}")
                    continue
            named.setdefault(drv, attr)
        await self._eval_progress(ctx, "evaluating", len(named), len(attrs))
        show: dict[str, Any] = {}
        # The server is asked about the top-level derivations before their closures are walked: a known
        # one is named in known_drvs, its closure not read.
        known = await ctx.known_derivations(sorted(named))
        roots = sorted(d for d in named if d not in known)
        try:
            for chunk in _chunks(roots):
                show.update(await self._json(["nix", "show-derivation", "-r", *chunk], ctx))
            valid = await self.path_info([o.path for d in show.values() for o in outputs_of(d)], ctx)
        except NixCommandFailed as failed:
            raise ExecutorFailure(
                BuildFailureKind.TRANSIENT, f"reading the derivations failed: {failed.run.error_text()}"
            ) from None
        derivations = discovered_derivations(show, named, valid)
        await self._eval_progress(ctx, "evaluating", len(derivations), len(derivations))
        log.info(
            "%s: %d derivations (%d named, %d known), %d with cached outputs, %d errors",
            ref,
            len(derivations),
            len(named),
            len(known),
            sum(1 for d in derivations if d.cached_outputs),
            len(errors),
        )
        return DerivationEvaluation(
            derivations=derivations, warnings=warnings, errors=errors, known_drvs=sorted(known)
        )

    # --- Build ---------------------------------------------------------------------------------------

    async def build(self, spec: BuildSpec, ctx: JobContext) -> BuildResult:
        drv = spec.drv_path
        if not is_store_path(drv) or not drv.endswith(".drv"):
            raise ExecutorFailure(BuildFailureKind.PERMANENT, f"{drv!r} is not a derivation path")
        argv = ["nix-store", "--realise", drv, "--log-format", "internal-json"]
        if spec.timeout_secs:
            argv += ["--timeout", str(spec.timeout_secs)]
        if spec.max_silent_secs:
            argv += ["--max-silent-time", str(spec.max_silent_secs)]
        build_log = NixBuildLog()
        last_progress = 0.0

        async def on_stderr(line: str) -> None:
            nonlocal last_progress
            for event in build_log.feed(line):
                if event.kind == "building":
                    log.info("nix: building %s", event.drv_path)
                elif event.kind == "substituting":
                    log.info("nix: substituting %s", event.drv_path)
                elif event.kind == "log":
                    log.info("%s> %s", _short(event.drv_path), event.text)
                    # The builder's own lines go to the build's log; those of an input Nix had to build
                    # too are marked with its name.
                    own = event.drv_path in (None, drv)
                    ctx.build_log(
                        spec.build_id,
                        f"{event.text}\n" if own else f"{_short(event.drv_path)}> {event.text}\n",
                    )
                elif event.kind == "message":
                    log.debug("nix: %s", event.text)
                elif event.kind == "download" and time.monotonic() - last_progress >= PROGRESS_EVERY_SECS:
                    last_progress = time.monotonic()
                    await ctx.progress(
                        BuildProgress(
                            job_id=ctx.job_id,
                            assignment_id=ctx.assignment_id,
                            build_id=spec.build_id,
                            phase="download",
                            bytes_done=event.bytes_done,
                            bytes_total=event.bytes_total,
                        )
                    )

        run = await self._run(argv, ctx, on_stderr=on_stderr)
        if run.returncode != 0 and drv not in await self.valid_derivations([drv], ctx):
            raise ExecutorFailure(
                BuildFailureKind.INPUTS_UNAVAILABLE,
                f"{drv} is not in this worker's store (it was evaluated elsewhere)",
                missing_paths=[drv],
            )
        if run.returncode != 0:
            failure = classify_build_failure(run.returncode, build_log, drv)
            error = failure.error
            if builds_elsewhere(error):
                error += "\n(this worker's --arch or --features promise more than its Nix builds)"
            log.warning("%s failed (%s): %s", drv, failure.kind, error.splitlines()[0] if error else "")
            raise ExecutorFailure(failure.kind, error, failure.missing_paths)
        extra = [d for d in build_log.built if d != drv]
        if extra:
            log.warning("%s: Nix also built %s (missing inputs)", drv, ", ".join(extra))
        outputs = await self._outputs(spec, set(run.stdout.split()), ctx)
        sizes = await self.path_info([o.path for o in outputs], ctx)
        missing = [o.path for o in outputs if o.path not in sizes]
        if missing:
            raise ExecutorFailure(
                BuildFailureKind.TRANSIENT, f"{drv} was realised but {', '.join(missing)} is not valid"
            )
        # Not built here: its outputs were valid already (or were substituted).
        substituted = drv not in build_log.built
        if substituted:
            log.info("%s: its outputs were valid or substituted, nothing was built", drv)
        return BuildResult(
            outputs=[BuiltOutput(name=o.name, path=o.path, nar_size=sizes[o.path]) for o in outputs],
            substituted=substituted,
        )

    async def _outputs(self, spec: BuildSpec, realised: set[str], ctx: JobContext) -> list[OutputPath]:
        """The derivation's outputs: the BuildSpec's when they are what Nix realised, otherwise the
        derivation's own (`nix show-derivation`)."""
        if spec.outputs and {o.path for o in spec.outputs} == realised:
            return list(spec.outputs)
        try:
            shown = await self._json(["nix", "show-derivation", spec.drv_path], ctx)
        except NixCommandFailed as failed:
            raise ExecutorFailure(
                BuildFailureKind.TRANSIENT, f"reading {spec.drv_path} failed: {failed.run.error_text()}"
            ) from None
        return outputs_of(shown.get(spec.drv_path) or {})


def _short(drv_path: str | None) -> str:
    if not drv_path:
        return "nix"
    return drv_path.rsplit("/", 1)[-1].split("-", 1)[-1].removesuffix(".drv")
