"""The architecture of docs/architecture.md, checked: the layer contracts (import-linter, in pyproject.toml)
fail on a wrong import, no module imports itself back, no app imports another app's private names, and
no code outside the transport dispatches on a message's `type` string."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gradient"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _sources() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield module, path


def _app(module: str) -> str:
    """The app a module belongs to (`gradient.scheduling.services.x` -> `gradient.scheduling`)."""
    return ".".join(module.split(".")[:2])


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("tree")
    shutil.copytree(PACKAGE, tree / "gradient", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed")
def test_the_layer_contracts_hold_and_a_wrong_import_breaks_them(tree_copy: Path) -> None:
    kept = _lint_imports(tree_copy)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    offers = tree_copy / "gradient" / "scheduling" / "services" / "offers.py"
    source = offers.read_text()
    offers.write_text(source + "\nfrom gradient.clusters.services import cluster_abort  # noqa\n")
    try:
        broken = _lint_imports(tree_copy)
    finally:
        offers.write_text(source)
    assert broken.returncode != 0
    assert "gradient.scheduling.services.offers -> gradient.clusters.services" in broken.stdout
    assert "BROKEN" in broken.stdout


def test_no_module_imports_itself_back() -> None:
    graph = grimp.build_graph("gradient")
    modules = {m for m in graph.modules if ".migrations" not in m}
    cycles = []
    for module in sorted(modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if imported in modules and graph.chain_exists(importer=imported, imported=module):
                cycles.append((module, imported))
    assert cycles == []


def _imported_modules(tree: ast.Module, module: str) -> dict[str, str]:
    """Local names bound to modules of other apps (`from gradient.x import mod`, `import a.b as c`)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("gradient.") and alias.asname:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gradient"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                if (PACKAGE.parent / (candidate.replace(".", "/") + ".py")).exists() or (
                    PACKAGE.parent / candidate.replace(".", "/") / "__init__.py"
                ).exists():
                    bound[alias.asname or alias.name] = candidate
    return {name: target for name, target in bound.items() if _app(target) != _app(module)}


def test_no_app_imports_a_private_name_of_another() -> None:
    offences = []
    for module, path in _sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gradient."):
                if _app(node.module) == _app(module):
                    continue
                for alias in node.names:
                    if alias.name.startswith("_"):
                        offences.append(f"{module}: from {node.module} import {alias.name}")
                if any(part.startswith("_") for part in node.module.split(".")):
                    offences.append(f"{module}: from {node.module} import ...")
        others = _imported_modules(tree, module)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in others
            ):
                offences.append(f"{module}:{node.lineno}: {node.value.id}.{node.attr}")
    assert offences == []


TRANSPORT = ("gradient.workers.proto", "gradient.core.protocol")
WORKER_PROGRAM = ("gradient.workers.client", "gradient.workers.executors")  # reads Nix's own JSON logs


def test_no_code_outside_the_transport_reads_a_messages_type_string() -> None:
    offences = []
    for module, path in _sources():
        if module.startswith(TRANSPORT + WORKER_PROGRAM):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            reads_type = (
                isinstance(node, ast.Subscript)
                and isinstance(node.slice, ast.Constant)
                and node.slice.value == "type"
            ) or (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and bool(node.args)
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == "type"
            )
            if reads_type:
                offences.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert offences == []
