"""The project stands on its own: what its code imports is declared, what its text cites is in the tree."""

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

from tests.source_ast import parse

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"distpool", "prefill", "decode", "transfer", "tests"}
SOURCE_DIRS = ("distpool", "prefill", "decode", "transfer", "tests", "scripts")


def python_files() -> list[Path]:
    return sorted(path for folder in SOURCE_DIRS for path in (ROOT / folder).rglob("*.py"))


def imported_top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def declared_distributions() -> set[str]:
    """Every distribution distpool names, in its dependencies or any extra, normalised."""
    requirements = importlib.metadata.requires("distpool") or []
    names = {re.match(r"[A-Za-z0-9_.-]+", line).group(0) for line in requirements}
    return {re.sub(r"[-_.]+", "-", name).lower() for name in names}


def test_every_third_party_import_is_declared_in_pyproject():
    local_scripts = {path.stem for path in (ROOT / "scripts").glob("*.py")}
    providers = importlib.metadata.packages_distributions()
    declared = declared_distributions()
    undeclared = {}
    for path in python_files():
        for name in imported_top_level_names(path):
            if name in sys.stdlib_module_names or name in FIRST_PARTY or name in local_scripts:
                continue
            dists = {re.sub(r"[-_.]+", "-", d).lower() for d in providers.get(name, [name])}
            if not dists & declared:
                undeclared.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_the_benchmark_plots_are_an_extra_the_tests_also_install():
    requirements = importlib.metadata.requires("distpool") or []
    matplotlib = [line for line in requirements if line.startswith("matplotlib")]
    assert matplotlib and all("extra ==" in line for line in matplotlib)
    assert {re.search(r"extra == .(\w+).", line).group(1) for line in matplotlib} >= {"bench", "test"}


def test_every_markdown_file_the_project_cites_is_in_the_tree():
    cited = re.compile(r"\b([\w./-]+\.md)\b")
    texts = [*python_files(), ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    missing = {}
    for path in texts:
        for name in cited.findall(path.read_text()):
            if not any((base / name).exists() for base in (ROOT, path.parent)):
                missing.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"cited but not in the repository: {missing}"


PACKAGES = ("distpool", "prefill", "decode", "transfer")


def test_no_package_module_checks_with_assert():
    """`python -O` drops `assert`: a check that must hold raises a typed error instead."""
    found = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = [node.lineno for node in ast.walk(parse(path)) if isinstance(node, ast.Assert)]
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    assert found == {}


CITED_FILE = re.compile(r"`((?:distpool|prefill|decode|transfer|scripts|tests)/[\w/]+\.py)`")
CITED_NAME = re.compile(r"`((?:distpool|prefill|decode|transfer)(?:\.\w+)+)`")


def module_of(parts: list[str]) -> tuple[Path | None, list[str]]:
    """The longest leading part of a dotted name that is a module's file, and the names after it."""
    for k in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:k])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.exists():
                return candidate, parts[k:]
    return None, parts


def test_every_module_the_project_cites_is_where_it_says():
    """A file path (`transfer/ends/staging.py`) or a dotted name (`transfer.plans.reshard.plan_pair`)
    in the README or a docstring names a file that exists and, after the module, a name it defines:
    a module moved or folded leaves no pointer to where it was."""
    texts = [ROOT / "README.md", *(p for p in python_files() if p.parts[len(ROOT.parts)] != "tests")]
    missing = {}
    for path in texts:
        text = path.read_text()
        for cited in CITED_FILE.findall(text):
            if not (ROOT / cited).exists():
                missing.setdefault(cited, []).append(str(path.relative_to(ROOT)))
        for cited in CITED_NAME.findall(text):
            module, names = module_of(cited.split("."))
            defined = module is not None and len(names) <= 2
            if defined and names:
                name = re.escape(names[0])
                pattern = rf"^\s*(?:def|class)\s+{name}\b|^{name}\b\s*[:=]|\b{name},|import .*\b{name}\b"
                defined = re.search(pattern, module.read_text(), re.M) is not None
            if not defined:
                missing.setdefault(cited, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"cited but not where the citation says: {missing}"
