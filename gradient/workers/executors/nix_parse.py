"""The pure half of the `nix` executor: what it passes to Nix and what it makes of Nix's answers.

No process runs here. Flake references from a repository URL and commit, attribute wildcards, the
settings of `nix show-config --json`, the derivations of `nix show-derivation -r` turned into the
protocol's DiscoveredDerivation (dependencies first), the `--log-format internal-json` stream of a
build, and a failed realisation mapped to a BuildFailureKind. Everything is driven by tests directly.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode

from gradient.core.protocol import BuildFailureKind, CachedOutput, DiscoveredDerivation, OutputPath

STORE_DIR = "/nix/store"
# A store path: the store, 32 characters of Nix's base32, a dash and a name.
_STORE_PATH = re.compile(r"^/nix/store/[0-9abcdfghijklmnpqrsvwxyz]{32}-[A-Za-z0-9+\-._?=]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_'\-]*$")
# Flake reference types that take `rev=` / `ref=` (Nix's git-like fetchers).
_GIT_LIKE = ("git+", "github:", "gitlab:", "sourcehut:")

# What every nix call of the executor needs on top of the operator's own configuration.
EXECUTOR_NIX_CONFIG = "extra-experimental-features = nix-command flakes"
# A local store without a daemon, build users or network: what this project's tests and demo use.
OFFLINE_NIX_CONFIG = "\n".join(
    [
        "experimental-features = nix-command flakes",
        "sandbox = false",
        "build-users-group =",
        "substituters =",
        "flake-registry =",
    ]
)


class NixInputError(ValueError):
    """A repository URL, wildcard or attribute the executor cannot turn into a Nix argument."""


def is_store_path(path: str) -> bool:
    return bool(_STORE_PATH.match(path))


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def with_executor_config(nix_config: str | None) -> str:
    """NIX_CONFIG for the executor's calls: the operator's, plus the experimental features it needs."""
    base = (nix_config or "").rstrip("\n")
    return f"{base}\n{EXECUTOR_NIX_CONFIG}\n" if base else f"{EXECUTOR_NIX_CONFIG}\n"


# --- Flake references --------------------------------------------------------------------------------


def flake_ref(url: str, commit: str) -> str:
    """The flake reference that fetches `url` (a flake URL; see `local_flake_ref` for a directory) at
    `commit`. For git-like references a 40-hex commit pins `rev=` (with `allRefs=1` for `git+`, so a
    commit on any branch is found), an empty commit or `HEAD` takes the default branch, and anything
    else names a branch or tag (`ref=`). A URL that pins its own `rev=` keeps it. `path:` and other
    references carry no revision: the commit is ignored.
    """
    url = url.strip()
    if not url:
        raise NixInputError("the repository URL is empty")
    if url.startswith("sim:"):
        raise NixInputError(f"{url} is a sim: URL; run this evaluation on a worker with --executor sim")
    if not url.startswith(_GIT_LIKE):
        return url
    commit = commit.strip()
    if not commit or commit == "HEAD":
        return url
    base, _, raw_query = url.partition("?")
    query = dict(parse_qsl(raw_query, keep_blank_values=True))
    if "rev" in query or ("ref" in query and not _COMMIT.match(commit)):
        return url  # the URL pins its own revision
    if _COMMIT.match(commit):
        query["rev"] = commit
        if url.startswith("git+"):
            query["allRefs"] = "1"
    else:
        query["ref"] = commit
    return f"{base}?{urlencode(query, safe='/:')}"


def local_flake_ref(path: str, *, is_git: bool) -> str:
    """A plain absolute directory as a flake URL: `git+file://` for a git work tree, else `path:`."""
    return f"git+file://{path}" if is_git else f"path:{path}"


def store_flake_ref(store_path: str) -> str:
    """A fetched source in the store, as the flake reference evaluations use."""
    return f"path:{store_path}"


# --- Attributes and wildcards ------------------------------------------------------------------------


def split_attr_path(text: str) -> list[str]:
    """`packages.x86_64-linux."a.b"` -> ["packages", "x86_64-linux", "a.b"]."""
    segments: list[str] = []
    current: list[str] = []
    quoted = False
    started = False
    i = 0
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\" and i + 1 < len(text):
                current.append(text[i + 1])
                i += 1
            elif c == '"':
                quoted = False
            else:
                current.append(c)
        elif c == '"':
            quoted = started = True
        elif c == ".":
            if not started:
                raise NixInputError(f"empty attribute name in {text!r}")
            segments.append("".join(current))
            current, started = [], False
        else:
            current.append(c)
            started = True
        i += 1
    if quoted:
        raise NixInputError(f"unterminated quote in {text!r}")
    if not started:
        raise NixInputError(f"empty attribute name in {text!r}")
    segments.append("".join(current))
    return segments


def format_attr_path(segments: Sequence[str]) -> str:
    """The inverse of split_attr_path: names that are not plain identifiers are quoted."""
    out = []
    for s in segments:
        if _IDENTIFIER.match(s):
            out.append(s)
        else:
            escaped = s.replace("\\", "\\\\").replace('"', '\\"').replace("${", "\\${")
            out.append(f'"{escaped}"')
    return ".".join(out)


def glob_to_regex(segment: str) -> str:
    """One attribute-name glob (`*` any run, `?` one character) as a POSIX extended regex for
    `builtins.match`, which must match the whole name."""
    out = []
    for c in segment:
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c.isalnum() or c in "_-'":
            out.append(c)
        else:
            out.append(f"[{c}]" if c not in "^\\" else f"\\{c}")
    return "".join(out)


def default_wildcards(system: str) -> list[str]:
    return [f"packages.{system}.*", f"checks.{system}.*"]


def wildcard_patterns(wildcards: Iterable[str], system: str) -> list[list[str]]:
    """The job's wildcards (default `packages.<system>.*` and `checks.<system>.*`) as lists of
    per-segment regexes. A segment matches one attribute name; a selected value that is a derivation
    is an attribute of the evaluation."""
    chosen = [w.strip() for w in wildcards if w.strip()] or default_wildcards(system)
    return [[glob_to_regex(s) for s in split_attr_path(w)] for w in chosen]


# The evaluation itself, one pure `nix eval --json --expr EVAL_EXPRESSION --argstr request <json>
# result` (eval_argv): the arguments come as one JSON string through --argstr, so no value is ever
# spliced into Nix source, and the evaluation is pure, so the evaluated flake reads neither the worker's
# environment (builtins.getEnv is "") nor its files: only a locked flake (`locked_flake_ref`).
# Nix 2.8's `nix eval --expr` calls a function with --arg values only on the way along an attribute
# path, hence the function returns `{ result = ...; }` and the path `result` is asked for.
#   mode "attrs": every attribute path the patterns select whose value is a derivation; a value that
#     fails to evaluate is listed too (its error surfaces when its derivation is evaluated);
#   mode "drvs": the derivation path of each given attribute path, or null when it throws.
EVAL_EXPRESSION = r"""
{ request }:
let
  args = builtins.fromJSON request;
  outputs = (builtins.getFlake args.flake).outputs;
  isDrv = v: builtins.isAttrs v && (v.type or null) == "derivation";
  walk = path: value: segs:
    if segs == [ ] then (if isDrv value then [ path ] else [ ])
    else if !(builtins.isAttrs value) || isDrv value then [ ]
    else builtins.concatMap
      (name:
        let r = builtins.tryEval value.${name}; in
        if r.success then walk (path ++ [ name ]) r.value (builtins.tail segs) else [ (path ++ [ name ]) ])
      (builtins.filter (n: builtins.match (builtins.head segs) n != null) (builtins.attrNames value));
  drvOf = path:
    let r = builtins.tryEval (builtins.foldl' (v: n: v.${n}) outputs path).drvPath;
    in { attr = path; drv = if r.success then r.value else null; };
in
{
  result =
    if args.mode == "attrs" then builtins.concatMap (p: walk [ ] outputs p) args.patterns
    else map drvOf args.attrs;
}
"""


def eval_argv(request: Mapping[str, Any]) -> list[str]:
    """The pure `nix eval` of EVAL_EXPRESSION with `request` (the locked flake and the mode's values)."""
    return [
        "nix",
        "eval",
        "--json",
        "--expr",
        EVAL_EXPRESSION,
        "--argstr",
        "request",
        json.dumps(request),
        "result",
    ]


def locked_flake_ref(metadata: Mapping[str, Any]) -> str:
    """The locked reference (with its narHash or revision) that `nix flake metadata --json` gives: pure
    evaluation takes only a locked flake."""
    url = metadata.get("url")
    if not isinstance(url, str) or not url:
        raise NixInputError("nix flake metadata gave no locked reference")
    return url


# Of the worker's environment, only what Nix itself reads reaches a nix process: never a GRADIENT_*
# variable (the worker's token above all), nor anything else of the worker's. Pure evaluation already
# keeps an evaluated flake from reading the environment; this keeps what Nix or git is not meant to
# see out of their reach too. SSH_AUTH_SOCK and the proxies: fetching a private or remote repository.
NIX_ENVIRONMENT_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "TMPDIR",
        "TZ",
        "LANG",
        "LC_ALL",
        "SSL_CERT_FILE",
        "SSH_AUTH_SOCK",
        "XDG_CACHE_HOME",
        "XDG_CONFIG_HOME",
        "XDG_CONFIG_DIRS",
        "XDG_DATA_HOME",
        "XDG_STATE_HOME",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
    }
)


def nix_environment_of(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of every nix child: the allow-listed names and Nix's own NIX_* variables of
    `environ`, with the executor's experimental features added to NIX_CONFIG."""
    env = {k: v for k, v in environ.items() if k in NIX_ENVIRONMENT_NAMES or k.startswith("NIX_")}
    env["NIX_CONFIG"] = with_executor_config(env.get("NIX_CONFIG"))
    return env


# --- nix show-config ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class NixSettings:
    system: str
    extra_platforms: tuple[str, ...] = ()
    system_features: tuple[str, ...] = ()
    version: str = ""

    @property
    def platforms(self) -> list[str]:
        """Every system this Nix builds: its own, then its extra platforms."""
        return list(dict.fromkeys([self.system, *self.extra_platforms]))


def _setting(data: Mapping[str, Any], key: str) -> Any:
    value = data.get(key)
    return value.get("value") if isinstance(value, dict) else value


def _words(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(value.split())
    return tuple(str(v) for v in value)


def settings_from_show_config(data: Mapping[str, Any], version: str = "") -> NixSettings:
    """`nix show-config --json`: each setting is `{value, defaultValue, ...}` (2.4+) or a bare value."""
    system = _setting(data, "system")
    if not isinstance(system, str) or not system:
        raise ValueError("nix show-config has no system")
    return NixSettings(
        system=system,
        extra_platforms=_words(_setting(data, "extra-platforms")),
        system_features=_words(_setting(data, "system-features")),
        version=version,
    )


# --- nix show-derivation -----------------------------------------------------------------------------


def required_features_of(drv: Mapping[str, Any]) -> list[str]:
    """`requiredSystemFeatures` of a derivation, from its environment or its structured attributes."""
    env = drv.get("env") or {}
    raw: Any = env.get("requiredSystemFeatures")
    if raw is None and "__json" in env:
        try:
            raw = json.loads(env["__json"]).get("requiredSystemFeatures")
        except (ValueError, AttributeError):
            raw = None
    return sorted(set(_words(raw)))


def outputs_of(drv: Mapping[str, Any]) -> list[OutputPath]:
    """The derivation's outputs with their paths, `out` first (content-addressed outputs, which have
    no path before they are built, are left out)."""
    outputs = [
        OutputPath(name=name, path=str(spec["path"]))
        for name, spec in (drv.get("outputs") or {}).items()
        if isinstance(spec, dict) and spec.get("path")
    ]
    return sorted(outputs, key=lambda o: (o.name != "out", o.name))


def dependency_order(show: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Derivation paths with each one after all its input derivations (stable: by path otherwise)."""
    done: dict[str, None] = {}
    for root in sorted(show):
        stack: list[tuple[str, bool]] = [(root, False)]
        while stack:
            path, expanded = stack.pop()
            if path in done:
                continue
            if expanded:
                done[path] = None
                continue
            stack.append((path, True))
            for dep in sorted((show[path].get("inputDrvs") or {}), reverse=True):
                if dep in show and dep not in done:
                    stack.append((dep, False))
    return list(done)


def discovered_derivations(
    show: Mapping[str, Mapping[str, Any]],
    attrs: Mapping[str, str],
    valid: Mapping[str, int],
) -> list[DiscoveredDerivation]:
    """The eval_result's derivations: every derivation of `show` (a `nix show-derivation -r` answer),
    dependencies first, with its system, required features, outputs and input derivations; `attrs`
    names the selected ones (drv path -> attribute), `valid` gives the NAR size of each output path
    already valid in the local store (cached_outputs)."""
    result = []
    for path in dependency_order(show):
        drv = show[path]
        outputs = outputs_of(drv)
        result.append(
            DiscoveredDerivation(
                drv_path=path,
                attr=attrs.get(path),
                system=str(drv.get("system") or ""),
                required_features=required_features_of(drv),
                outputs=outputs,
                input_drvs=sorted(drv.get("inputDrvs") or {}),
                cached_outputs=[
                    CachedOutput(path=o.path, nar_size=valid[o.path]) for o in outputs if o.path in valid
                ],
            )
        )
    return result


def nar_sizes_from_path_info(data: Any) -> dict[str, int]:
    """`nix path-info --json`: the valid paths and their NAR sizes (invalid ones say `valid: false`)."""
    rows = data.values() if isinstance(data, dict) else data
    out: dict[str, int] = {}
    for row in rows or []:
        if isinstance(row, dict) and row.get("path") and row.get("valid", True) is not False:
            out[str(row["path"])] = int(row.get("narSize") or 0)
    return out


# --- Builds: the internal-json log and failures --------------------------------------------------------

# Nix's activity and result types (libutil/logging.hh).
ACT_FILE_TRANSFER = 101
ACT_BUILD = 105
ACT_SUBSTITUTE = 108
RES_BUILD_LOG_LINE = 101
RES_PROGRESS = 105
RES_POST_BUILD_LOG_LINE = 107
LOG_TAIL_LINES = 25
MAX_ERROR_CHARS = 8000


@dataclass
class LogEvent:
    """One thing worth telling from a line of Nix's stderr."""

    kind: str  # "log" (a builder's line), "building", "substituting", "download", "message"
    text: str = ""
    drv_path: str | None = None
    bytes_done: int = 0
    bytes_total: int | None = None


@dataclass
class NixBuildLog:
    """Follows `--log-format internal-json` on a realisation's stderr: which derivations were built or
    substituted, each builder's last lines, Nix's own error messages and download progress."""

    built: list[str] = field(default_factory=list)
    substituted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    tails: dict[str, deque[str]] = field(default_factory=dict)
    _activities: dict[int, tuple[int, str | None]] = field(default_factory=dict)

    def feed(self, line: str) -> list[LogEvent]:
        if not line.startswith("@nix "):
            text = strip_ansi(line.rstrip("\n"))
            return [LogEvent("message", text)] if text.strip() else []
        try:
            event = json.loads(line[5:])
        except ValueError:
            return []
        if not isinstance(event, dict):
            return []
        action = event.get("action")
        if action == "start":
            return self._start(event)
        if action == "result":
            return self._result(event)
        if action == "msg":
            text = strip_ansi(str(event.get("msg") or ""))
            if event.get("level") == 0:
                self.errors.append(text.removeprefix("error: ").strip())
            return [LogEvent("message", text)] if text.strip() else []
        return []

    def _start(self, event: dict[str, Any]) -> list[LogEvent]:
        kind = event.get("type")
        fields = event.get("fields") or []
        subject = str(fields[0]) if fields else None
        ident = event.get("id")
        if isinstance(ident, int) and isinstance(kind, int):
            self._activities[ident] = (kind, subject)
        if kind == ACT_BUILD and subject:
            self.built.append(subject)
            self.tails.setdefault(subject, deque(maxlen=LOG_TAIL_LINES))
            return [LogEvent("building", strip_ansi(str(event.get("text") or "")), drv_path=subject)]
        if kind == ACT_SUBSTITUTE and subject:
            self.substituted.append(subject)
            return [LogEvent("substituting", strip_ansi(str(event.get("text") or "")), drv_path=subject)]
        return []

    def _result(self, event: dict[str, Any]) -> list[LogEvent]:
        kind = event.get("type")
        fields = event.get("fields") or []
        ident = event.get("id")
        activity = self._activities.get(ident) if isinstance(ident, int) else None
        if kind in (RES_BUILD_LOG_LINE, RES_POST_BUILD_LOG_LINE) and fields:
            text = strip_ansi(str(fields[0]))
            drv = activity[1] if activity and activity[0] == ACT_BUILD else None
            if drv is not None:
                self.tails.setdefault(drv, deque(maxlen=LOG_TAIL_LINES)).append(text)
            return [LogEvent("log", text, drv_path=drv)]
        if kind == RES_PROGRESS and activity and activity[0] == ACT_FILE_TRANSFER and len(fields) >= 2:
            done, expected = int(fields[0] or 0), int(fields[1] or 0)
            return [LogEvent("download", bytes_done=done, bytes_total=expected or None)]
        return []

    def tail(self, drv_path: str | None) -> list[str]:
        if drv_path is not None and drv_path in self.tails:
            return list(self.tails[drv_path])
        return list(self.tails[self.built[-1]]) if self.built and self.built[-1] in self.tails else []


@dataclass(frozen=True)
class BuildFailure:
    kind: BuildFailureKind
    error: str
    missing_paths: list[str] | None = None


_EXIT_BUILD_FAILED = 100  # Nix: 100 + 1 (timeout) + 2 (hash mismatch) + 4 (check mismatch)
_NOT_HERE = re.compile(r"is required to build '([^']+)', but I am a")
_INTERRUPTED = "interrupted by the user"


def classify_build_failure(returncode: int, log: NixBuildLog, drv_path: str) -> BuildFailure:
    """A failed `nix-store --realise`: a builder's non-zero exit (or a hash mismatch) is permanent, a
    timeout (`--timeout` or `--max-silent-time`) is timeout, an interrupted Nix is canceled, a
    derivation this Nix cannot build here (its system or features) is transient, so another worker
    takes it; anything else (the store, the machine) is transient too. The error keeps Nix's message
    and the builder's last lines."""
    message = "\n".join(e for e in log.errors if e) or f"nix-store --realise exited with {returncode}"
    tail = log.tail(drv_path)
    error = message
    if tail:
        error += f"\nlast {len(tail)} log lines:\n" + "\n".join(f"> {line}" for line in tail)
    if len(error) > MAX_ERROR_CHARS:
        error = error[: MAX_ERROR_CHARS // 2] + "\n…\n" + error[-MAX_ERROR_CHARS // 2 :]
    if returncode < 0 or _INTERRUPTED in message:
        return BuildFailure(BuildFailureKind.CANCELED, error)
    if _EXIT_BUILD_FAILED <= returncode < _EXIT_BUILD_FAILED + 8:
        if (returncode - _EXIT_BUILD_FAILED) & 1:
            return BuildFailure(BuildFailureKind.TIMEOUT, error)
        return BuildFailure(BuildFailureKind.PERMANENT, error)
    if "timed out after" in message:
        return BuildFailure(BuildFailureKind.TIMEOUT, error)
    return BuildFailure(BuildFailureKind.TRANSIENT, error)


def builds_elsewhere(message: str) -> bool:
    """Nix refused the derivation because of its system or required features."""
    return bool(_NOT_HERE.search(message))
